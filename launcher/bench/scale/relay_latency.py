"""A worker's added latency per call through its node's door (checkpointless/control/
node_door.py), measured with torch's own client:

    python -m launcher.bench.scale.relay_latency [--calls 2000] [--json FILE]

The coordinator's store (a torch TCPStore server) and the door each run in a process of their
own, as on a node (the door in the agent's process, the worker in its own). The same client
calls are timed over a direct connection and through the door, alternating in blocks so that
the machine's load falls on both alike; the figure is the difference of the medians. As on a
node, a wait is armed through the door all along (the agent's plan relay and command thread
each wait for their next key), so that a call which expects an answer goes up behind a
CANCEL_WAIT and the wait is armed again behind it. The door's process's CPU per call is said too.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta

from launcher.bench.scale.proc import cpu_s

SERVER = ("import time, torch.distributed as d; from datetime import timedelta; "
          "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, "
          "timeout=timedelta(seconds=60)); print(s.port, flush=True); time.sleep(3600)")
DOOR = ("import sys, time; from checkpointless.control.node_door import StoreDoor; "
        "d = StoreDoor(hold=False); d.retarget('127.0.0.1', int(sys.argv[1])); "
        "print(d.port, flush=True); time.sleep(3600)")


def _timed(store, kind: str, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        if kind == "add":
            store.add("lat/n", 1)
        elif kind == "compare_set":  # membership.peek's call: one round trip, nothing changed
            store.compare_set("lat/v", "\x00none", "\x00none")
        else:  # get: a wait for the key, then the read (torch's client)
            store.get("lat/v")
        out.append(time.perf_counter() - t0)
    return out


def _wait_forever(store) -> None:
    try:
        store.wait(["lat/never"], timedelta(days=1))
    except Exception:  # noqa: BLE001  the door is gone: the measurement is over
        pass


def measure(calls: int = 2000, block: int = 100) -> dict:
    import torch.distributed as dist
    procs = []
    try:
        server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE,
                                  text=True)
        procs.append(server)
        port = int(server.stdout.readline())
        door = subprocess.Popen([sys.executable, "-c", DOOR, str(port)], stdout=subprocess.PIPE,
                                text=True)
        procs.append(door)
        door_port = int(door.stdout.readline())
        conn = {name: dist.TCPStore("127.0.0.1", p, is_master=False,
                                    timeout=timedelta(seconds=30))
                for name, p in (("direct", port), ("door", door_port))}
        conn["direct"].set("lat/v", "x")
        waiter = dist.TCPStore("127.0.0.1", door_port, is_master=False,
                               timeout=timedelta(seconds=30))
        threading.Thread(target=_wait_forever, args=(waiter,), daemon=True).start()
        time.sleep(0.2)
        out = {}
        for kind in ("add", "compare_set", "get"):
            t, door_cpu = {"direct": [], "door": []}, 0.0
            for _ in range(max(1, calls // block)):
                for name in ("direct", "door"):
                    cpu0 = cpu_s(door.pid)
                    t[name] += _timed(conn[name], kind, block)
                    door_cpu += (cpu_s(door.pid) - cpu0) if name == "door" else 0.0
            med = {k: statistics.median(v) * 1e6 for k, v in t.items()}
            out[kind] = {"direct_us": round(med["direct"], 1), "door_us": round(med["door"], 1),
                         "added_us": round(med["door"] - med["direct"], 1), "calls": len(t["door"]),
                         "door_cpu_us": round(door_cpu / len(t["door"]) * 1e6, 1)}
        return out
    finally:
        for p in procs:
            p.kill()
            p.wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m launcher.bench.scale.relay_latency",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000, help="calls of each kind, each way")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    got = measure(a.calls)
    for kind, r in got.items():
        print(f"{kind:>12}: direct {r['direct_us']:7.1f} us, through the node's door "
              f"{r['door_us']:7.1f} us: +{r['added_us']:.1f} us a call (median of {r['calls']}); "
              f"the door's CPU {r['door_cpu_us']:.0f} us a call")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(got, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
