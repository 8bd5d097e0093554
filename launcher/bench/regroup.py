"""How long forming a new generation's group takes, by world size: `python -m launcher.bench.regroup`.

What a recovery pays between the plan and the first collective of the new generation, done here
exactly as the workers do it (checkpointless/protocol/membership.py, checkpointless/worker/group.py): every member
arrives at a counter on the coordinator's store, waits for the others, then builds a gloo process
group on the generation's own store prefix, and one small all-reduce proves the group works. Each
world size runs `generations` of these back to back in fresh processes; the figure is the median
over generations of the slowest member's time (the group is ready when its last member is).

    python -m launcher.bench.regroup                     # 4, 8, 16, 32 processes, 5 generations
    python -m launcher.bench.regroup --sizes 4,8 --generations 3 --out regroup.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from datetime import timedelta


def bench_start_key(gen: int) -> str:
    """The benchmark's own counter on the store: members ready for `gen`."""
    return f"start/{gen}"


def _member(rank: int, world: int, port: int, generations: int, out) -> None:
    import torch
    import torch.distributed as dist

    from checkpointless.protocol import membership
    from checkpointless import protocol
    torch.set_num_threads(1)
    store = membership.connect("127.0.0.1", port)
    times = []
    for gen in range(generations):
        store.add(bench_start_key(gen), 1)  # all ready: time only the regroup itself
        while membership.counter(store, bench_start_key(gen)) < world:
            time.sleep(0.001)
        t0 = time.perf_counter()
        key = protocol.barrier_key(gen)
        store.add(key, 1)
        while membership.counter(store, key) < world:
            time.sleep(0.002)
        pg_store = dist.PrefixStore(protocol.group_prefix(gen), store)
        dist.init_process_group("gloo", store=pg_store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        t = torch.ones(1)
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
        dist.destroy_process_group()
    out.put((rank, times))


def measure(world: int, generations: int) -> dict:
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, world, store.port, generations, out))
             for r in range(world)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=600) for _ in range(world))
    for p in procs:
        p.join()
    slowest = [max(got[r][g] for r in range(world)) for g in range(generations)]
    return {"processes": world, "generations": generations,
            "regroup_s_median": round(statistics.median(slowest), 4),
            "regroup_s_all": [round(x, 4) for x in slowest]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="4,8,16,32")
    ap.add_argument("--generations", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    rows = []
    for world in (int(x) for x in a.sizes.split(",")):
        r = measure(world, a.generations)
        rows.append(r)
        print(f"{world:4d} processes: regroup {r['regroup_s_median'] * 1000:8.1f} ms median "
              f"(each generation's slowest member: {r['regroup_s_all']})", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"machine_cores": mp.cpu_count(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
