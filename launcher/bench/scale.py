"""The control plane at thousands of ranks: the real coordinator and node agents, simulated ranks.

    python -m launcher.bench.scale --nodes 512 --ranks-per-node 8 [--out scale.json]
    python -m launcher.bench.scale --curve            (256 .. 16,384 ranks, as far as it goes)

What runs is the product's own code: the coordinator is checkpointless's `Supervisor` (its
`ClusterPool`, a stand-alone coordinator) in a process of its own, and every node is a real
`NodeAgent` (health records, the node store, commands). Only the workers are simulated: a
`SimRank` speaks the worker's side of the protocol with the library's own functions (ready, its
plan part read with `membership.follow`, the per-node `membership.barrier`, heartbeats into its
node store, rank 0's step records) but trains nothing and builds no process group, so thousands
fit on one small machine. A thread each; one connection to the coordinator each, as a worker has.

It measures, for each size: the coordinator's store operations per second in steady state (every
call any client makes to its store, its own included) and its process's CPU share; then for one
rank killed and one node killed, the times of detection, decision (the plan published), the plan
read by every rank, and the barrier complete (every rank ready to build its group).

Given, not measured (nothing here can build a communicator across real machines): the time to
build the NCCL communicator of the new generation (`--regroup-s`, whose default cites its source);
the output marks every figure as measured or given.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import threading
import time

from checkpointless import protocol
from checkpointless.protocol import SupervisorConfig

from .scale_sim import Counter, SimNode, SimRank, Wrapped, connect

# NCCL communicator creation at scale cannot be run here. NVIDIA's NCCL 2.23 release notes
# (2024, "scalable init" with ncclCommInitRankScalable) report about 1 s at 1,000s of GPUs and
# several seconds before it; launcher/bench/model.py assumed 2 s at 1,024 GPUs, 5 s at 16,384.
REGROUP_S_GIVEN = {1024: 2.0, 16384: 5.0}


# ---- the coordinator's process -------------------------------------------------------------
def _coordinator(cfg_fields: dict, pipe) -> None:
    """The real supervisor, its store counted; tells the harness its own count of store calls
    and its failures on request (through a pipe, not the store)."""
    from checkpointless.supervisor import JobFailed, Supervisor
    counter = Counter()
    quiet = not os.environ.get("SCALE_DEBUG")
    sup = Supervisor(["sim"], SupervisorConfig(**cfg_fields),
                     log=(lambda m: None) if quiet else (lambda m: print(m, file=sys.stderr)),
                     wrap_store=lambda s: Wrapped(s, counter.add))

    def serve():
        while True:
            pipe.recv()
            pipe.send((counter.n, [f.__dict__.copy() for f in sup.failures]))

    threading.Thread(target=serve, daemon=True).start()
    try:
        sup.run()
    except JobFailed as exc:
        print(f"[scale] the coordinator stopped: {exc}", file=sys.stderr, flush=True)


# ---- one size ------------------------------------------------------------------------------
class Harness:
    def __init__(self, nodes: int, per_node: int, spare_nodes: int, step_s: float,
                 node_timeout_s: float):
        self.nodes_n, self.per_node, self.spare_nodes = nodes, per_node, spare_nodes
        self.step_s, self.node_timeout_s = step_s, node_timeout_s
        self.main_ops, self.node_ops = Counter(), Counter()
        self.port = _free_port()
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        cfg = dict(nproc=nodes * per_node, spares=0, refill=True, nodes=nodes,
                   spare_nodes=spare_nodes, standalone=True, port=self.port,
                   node_timeout_s=node_timeout_s, heartbeat_timeout_s=30.0,
                   spare_wait_s=1800.0)  # also how long it waits for every node to join
        self.proc = ctx.Process(target=_coordinator, args=(cfg, child),
                                daemon=True)
        self.proc.start()
        _wait_port(self.port)
        self.step_store = Wrapped(connect(self.port, self.main_ops), lock=threading.Lock())
        # Every simulated rank's connection is made first, in parallel: a c10d client's connect
        # stalls for 5 s now and then on this machine (seen on loopback, torch 2.13, about one
        # in 20), and while many are in flight the process's other store calls stall with
        # them, which would make healthy nodes look silent. A real job connects each worker
        # once, in its own process, before it trains.
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(256) as pool:
            self.connections = list(pool.map(lambda _: connect(self.port, self.main_ops),
                                             range((nodes + spare_nodes) * per_node + 4)))
            self.nodes = list(pool.map(lambda k: SimNode(self, k, per_node),
                                       range(nodes + spare_nodes)))
        self.store = connect(self.port, self.main_ops)

    def ask(self):
        """The coordinator's own count of store calls, and its failures so far."""
        self.pipe.send("?")
        return self.pipe.recv()

    def ops(self) -> int:
        """Every call made to the coordinator's store so far, from any client."""
        return self.main_ops.n + self.ask()[0]

    def active(self) -> list[SimRank]:
        return [r for n in self.nodes for r in n.ranks if r.returncode is None and r.rank >= 0]

    def wait_gen(self, gen: int, timeout_s: float) -> bool:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            ranks = self.active()
            if len(ranks) == self.nodes_n * self.per_node and all(r.gen >= gen for r in ranks):
                return True
            time.sleep(0.05)
        return False

    def cpu_s(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def steady(self, window_s: float) -> dict:
        ops0, cpu0, t0 = self.ops(), self.cpu_s(), time.time()
        node0 = self.node_ops.n
        time.sleep(window_s)
        dt = time.time() - t0
        return {"store_ops_per_s": round((self.ops() - ops0) / dt, 1),
                "coordinator_cpu_share": round((self.cpu_s() - cpu0) / dt, 4),
                "node_store_ops_per_s_each": round((self.node_ops.n - node0) / dt /
                                                   len(self.nodes), 1)}

    def failure(self, kind: str, gen: int, timeout_s: float) -> dict:
        """Kill one rank (on node 1) or one node (node 2, or 1 with two nodes); time each phase
        of the generation that replaces it."""
        node = self.nodes[min(1 if kind == "rank" else 2, self.nodes_n - 1)]
        cpu0, own0 = self.cpu_s(), _own_cpu_s()
        t_fail = time.time()
        if kind == "rank":
            next(r for r in node.ranks if r.returncode is None and r.rank >= 0).die(-9)
        else:
            node.kill()
        if not self.wait_gen(gen, timeout_s):
            return {"kind": kind, "error": f"generation {gen} not complete in {timeout_s} s"}
        cpu, own = self.cpu_s() - cpu0, _own_cpu_s() - own0
        failures = [f for f in self.ask()[1] if f["gen"] == gen]
        head = json.loads(self.store.get(protocol.plan_key(gen)))
        ranks = self.active()
        t_detect = min(f["t_detect"] for f in failures)
        t_plan = max(r.times[gen][0] for r in ranks)
        t_barrier = max(r.times[gen][1] for r in ranks)
        return {"kind": kind, "lost_ranks": len(failures),
                "detect_s": round(t_detect - t_fail, 4),
                "decide_s": round(head["t"] - t_detect, 4),
                "plan_to_every_rank_s": round(t_plan - head["t"], 4),
                "barrier_complete_s": round(t_barrier - head["t"], 4),
                "decision_to_barrier_s": round(t_barrier - t_detect, 4),
                # where the CPU went from the kill to every rank ready: the simulated ranks'
                # own client work runs here on two cores, the coordinator's in its process
                "cpu_s": {"coordinator": round(cpu, 3), "simulated_nodes_and_ranks": round(own, 3)}}

    def close(self) -> None:
        self.proc.kill()
        self.proc.join(5)


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the coordinator never listened on port {port}")


def measure(nodes: int, per_node: int, spare_nodes: int = 2, step_s: float = 1.0,
            steady_s: float = 5.0, node_timeout_s: float = protocol.DEFAULTS.node_timeout_s,
            start_timeout_s: float = 300.0) -> dict:
    ranks = nodes * per_node
    t0 = time.time()
    h = Harness(nodes, per_node, spare_nodes, step_s, node_timeout_s)
    try:
        if not h.wait_gen(0, start_timeout_s):
            raise RuntimeError(f"{ranks} simulated ranks did not all start within "
                               f"{start_timeout_s:g} s")
        started_s = time.time() - t0
        time.sleep(2 * max(step_s, protocol.DEFAULTS.node_beat_s))  # every node reporting
        out = {"nodes": nodes, "ranks_per_node": per_node, "ranks": ranks,
               "spare_nodes": spare_nodes, "step_s": step_s, "start_s": round(started_s, 2),
               "steady": h.steady(steady_s)}
        out["rank_failure"] = h.failure("rank", 1, 60.0)
        time.sleep(1.0)
        out["node_failure"] = h.failure("node", 2, 60.0 + node_timeout_s)
        given = min(REGROUP_S_GIVEN, key=lambda n: abs(n - ranks))
        out["given"] = {"regroup_s": REGROUP_S_GIVEN[given],
                        "regroup_source": f"communicator build at about {given} GPUs: NCCL's "
                        "published init times, as assumed in launcher/bench/model.py"}
        out["measured"] = ["steady", "rank_failure", "node_failure", "start_s"]
        return out
    finally:
        h.close()


def _print(row: dict) -> None:
    st = row["steady"]
    print(f"{row['nodes']:>6} nodes x {row['ranks_per_node']} = {row['ranks']:>6} ranks: "
          f"steady {st['store_ops_per_s']:>8.1f} store ops/s, coordinator CPU "
          f"{100 * st['coordinator_cpu_share']:.1f}% of a core (started in {row['start_s']} s)")
    for key in ("rank_failure", "node_failure"):
        f = row[key]
        if "error" in f:
            print(f"    {f['kind']} loss: {f['error']}")
            continue
        print(f"    {f['kind']} loss ({f['lost_ranks']} rank(s)): detected {f['detect_s']:.3f} s, "
              f"plan published {f['decide_s']:.3f} s after, read by every rank "
              f"{f['plan_to_every_rank_s']:.3f} s after that, barrier complete "
              f"{f['barrier_complete_s']:.3f} s after it (decision to barrier "
              f"{f['decision_to_barrier_s']:.3f} s); CPU meanwhile: coordinator "
              f"{f['cpu_s']['coordinator']:.2f} s, simulated nodes and ranks "
              f"{f['cpu_s']['simulated_nodes_and_ranks']:.2f} s")
    print(f"    given, not measured: regroup {row['given']['regroup_s']} s "
          f"({row['given']['regroup_source']})", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m launcher.bench.scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=512)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--spare-nodes", type=int, default=2)
    p.add_argument("--step-s", type=float, default=1.0, help="simulated step time")
    p.add_argument("--steady-s", type=float, default=5.0, help="steady-state window")
    p.add_argument("--curve", action="store_true",
                   help="256, 1,024, 4,096 and 16,384 ranks at 8 per node, and 512 nodes x 1")
    p.add_argument("--out", help="write the figures as JSON here")
    a = p.parse_args(argv)
    sizes = [(a.nodes, a.ranks_per_node)]
    if a.curve:
        sizes = [(32, 8), (128, 8), (512, 1), (512, 8), (2048, 8)]
    rows = []
    for nodes, per_node in sizes:
        try:
            row = measure(nodes, per_node, a.spare_nodes, a.step_s, a.steady_s)
        except (RuntimeError, OSError) as exc:  # past what this machine can hold
            print(f"{nodes} nodes x {per_node}: {exc}", flush=True)
            break
        _print(row)
        rows.append(row)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # the simulated ranks' threads are blocked in the store of a coordinator that is gone; an
    # ordinary exit would let c10d raise into them as the interpreter shuts down
    os._exit(code)
