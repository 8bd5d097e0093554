"""The control plane at thousands of ranks: the real coordinator and node agents, simulated ranks.

    python -m launcher.bench.scale --nodes 512 --ranks-per-node 8 [--out scale.json]
    python -m launcher.bench.scale --curve            (256 .. 32,768 ranks, as far as it goes)

What runs is the product's own code: the coordinator is checkpointless's `Supervisor` (its
`ClusterPool`, a stand-alone coordinator) in a process of its own, and every node is a real
`NodeAgent` (health records, the node store, commands, the plan relay). Only the workers are
simulated: a `SimRank` speaks the worker's side of the protocol with the library's own functions
(ready, its plan part read with `membership.follow` in its node store, where its agent copies it,
the per-node `membership.barrier`, heartbeats into its node store, rank 0's step records) but
trains nothing and builds no process group, so thousands fit on one small machine. Each has one
connection to its node's door (the coordinator's address a worker is given: every node reaches
the coordinator over one connection, checkpointless/control/node_door.py) and one to its node's
store, as a worker has; the ranks of a shard are programs of one event loop (scale_wire.py), and
the simulated nodes are split over processes (shards).

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
import collections
import json
import multiprocessing as mp
import os
import sys
import threading
import time

from checkpointless import protocol
from checkpointless.control.agent import record_interval_s
from checkpointless.protocol import SupervisorConfig

from launcher.bench.scale import text as scale_text
from launcher.bench.scale.text import print_row
from launcher.bench.scale.proc import coordinator_connections, cpu_s, free_port, tcp_segments, wait_port
from launcher.bench.scale.sim import Counter, Wrapped, connect, shard_main

# NCCL communicator creation at scale cannot be run here. NVIDIA's NCCL 2.23 release notes
# (2024, "scalable init" with ncclCommInitRankScalable) report about 1 s at 1,000s of GPUs and
# several seconds before it; launcher/bench/model.py assumed 2 s at 1,024 GPUs, 5 s at 16,384.
REGROUP_S_GIVEN = {1024: 2.0, 16384: 5.0}


# ---- the coordinator's process -------------------------------------------------------------
def _coordinator(cfg_fields: dict, pipe) -> None:
    """The real supervisor, its store counted; tells the harness its own count of store calls
    and its failures on request (through a pipe, not the store)."""
    from checkpointless.control.supervisor import JobFailed, Supervisor
    counter = Counter()
    def say(m: str) -> None:  # SCALE_DEBUG: the coordinator's log, timed
        print(time.strftime("%X"), m, file=sys.stderr, flush=True)

    quiet = not os.environ.get("SCALE_DEBUG")
    sup = Supervisor(["sim"], SupervisorConfig(**cfg_fields),
                     log=(lambda m: None) if quiet else say,
                     wrap_store=lambda s: Wrapped(s, counter.add))

    prof = None
    if os.environ.get("SCALE_PROFILE"):  # the coordinator's own Python, written at each ask
        import cProfile
        prof = cProfile.Profile()
        prof.enable()

    def serve():
        while True:
            pipe.recv()
            if prof is not None:
                prof.dump_stats(os.environ["SCALE_PROFILE"])
            pipe.send((counter.n, [f.__dict__.copy() for f in sup.failures]))

    threading.Thread(target=serve, daemon=True).start()
    try:
        sup.run()
    except JobFailed as exc:
        print(f"[scale] the coordinator stopped: {exc}", file=sys.stderr, flush=True)


# ---- one size ------------------------------------------------------------------------------
class Harness:
    """The coordinator's process and the shards' (scale_sim.Shard: the simulated nodes, split
    over processes), driven through pipes."""

    def __init__(self, nodes: int, per_node: int, spare_nodes: int, step_s: float,
                 node_timeout_s: float, shards: int):
        self.nodes_n, self.per_node, self.spare_nodes = nodes, per_node, spare_nodes
        self.node_timeout_s = node_timeout_s
        self.main_ops = Counter()
        self._lock = threading.Lock()
        self.port = free_port()
        ctx = mp.get_context("spawn")
        self.pipe, child = ctx.Pipe()
        cfg = dict(nproc=nodes * per_node, spares=0, refill=True, nodes=nodes,
                   spare_nodes=spare_nodes, standalone=True, port=self.port,
                   node_timeout_s=node_timeout_s, heartbeat_timeout_s=30.0,
                   spare_wait_s=1800.0)  # also how long it waits for every node to join
        self.proc = ctx.Process(target=_coordinator, args=(cfg, child), daemon=True)
        self.proc.start()
        wait_port(self.port)
        total = nodes + spare_nodes
        shards = max(1, min(shards, total))
        self.shard_of = {k: k % shards for k in range(total)}
        self.shards = []
        for i in range(shards):
            mine, theirs = ctx.Pipe()
            ids = [k for k in range(total) if self.shard_of[k] == i]
            proc = ctx.Process(target=shard_main, daemon=True,
                               args=(self.port, ids, per_node, step_s, node_timeout_s, theirs))
            proc.start()
            self.shards.append((proc, mine))
        for proc, pipe in self.shards:
            if not pipe.poll(600) or pipe.recv() != "ready":
                raise RuntimeError(f"a shard of simulated nodes (pid {proc.pid}) did not start")
        self.store = connect(self.port, self.main_ops)
        if os.environ.get("SCALE_DEBUG"):
            threading.Thread(target=scale_text.monitor, args=(self,), daemon=True).start()

    def _ask(self, i: int, op: str, arg=None):
        with self._lock:  # a question and its answer, not interleaved with another's
            pipe = self.shards[i][1]
            pipe.send((op, arg))
            return pipe.recv()

    def _all(self, op: str, arg=None) -> list:
        with self._lock:
            for _, pipe in self.shards:  # every shard works on it at once
                pipe.send((op, arg))
            return [pipe.recv() for _, pipe in self.shards]

    def ask(self):
        """The coordinator's own count of store calls, and its failures so far."""
        with self._lock:  # SCALE_DEBUG's monitor asks too
            self.pipe.send("?")
            return self.pipe.recv()

    def ops(self) -> tuple[int, int, int]:
        """Every call made to the coordinator's store so far, from any client; the coordinator's
        own among them; and every call made to the node stores."""
        counts = self._all("ops")
        own = self.ask()[0]
        return (self.main_ops.n + own + sum(m for m, _ in counts), own,
                sum(n for _, n in counts))

    def wait_gen(self, gen: int, timeout_s: float) -> bool:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            status = self._all("status", gen)
            alive, done = sum(a for a, _ in status), sum(d for _, d in status)
            if alive == self.nodes_n * self.per_node and done == alive:
                return True
            # the figures are the ranks' own clocks, not when this sees them: a slow look costs
            # nothing, a fast one takes every shard's CPU from the recovery it measures
            time.sleep(0.25)
        return False

    def why_not_complete(self, gen: int) -> str:
        """What stood when generation `gen` did not complete: the newest generation published,
        the ranks alive and through `gen`'s barrier, and the coordinator's losses since."""
        try:
            newest = int(self.store.get(protocol.GEN))
            status = self._all("status", gen)
            lost = [f for f in self.ask()[1] if f["gen"] >= gen]
        except (OSError, EOFError, RuntimeError, ValueError) as exc:
            return f"the harness could not look ({type(exc).__name__}: {exc})"
        alive, done = sum(a for a, _ in status), sum(d for _, d in status)
        kinds = dict(collections.Counter(f["cause"] for f in lost))
        return (f"generation {newest} is the newest published; {alive} of "
                f"{self.nodes_n * self.per_node} ranks alive, {done} through generation {gen}'s "
                f"barrier; {len(lost)} rank(s) lost from generation {gen} on, by cause {kinds}"
                + self.agents_ended())

    def agents_ended(self) -> str:
        """The simulated nodes whose agent's loop ended though the harness killed none of them
        (to the coordinator, nodes gone silent): how many, how, and one's last words."""
        return scale_text.ended({k: v for shard in self._all("ended") for k, v in shard.items()})

    def cpu_s(self) -> float:
        return cpu_s(self.proc.pid)

    def shards_cpu_s(self) -> float:
        return sum(cpu_s(proc.pid) for proc, _ in self.shards)

    def threads_cpu_s(self) -> dict[str, float]:
        """The shards' CPU seconds by kind of thread (scale_sim.cpu_by_thread), summed."""
        out: dict[str, float] = {}
        for part in self._all("cpu_by_thread"):
            for k, v in part.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def steady(self, window_s: float) -> dict:
        # each count is read as close to the window's ends as it can be: under load a question
        # to 32 shards takes seconds, and CPU read after it would count them
        cpu0, own0, seg0, t0 = self.cpu_s(), self.shards_cpu_s(), tcp_segments(), time.time()
        ops0, mine0, node0 = self.ops()
        threads0 = self.threads_cpu_s()
        t1 = time.time()
        time.sleep(window_s)
        cpu, own, dt_cpu = self.cpu_s() - cpu0, self.shards_cpu_s() - own0, time.time() - t0
        seg = tcp_segments() - seg0
        ops1, mine1, node1 = self.ops()
        dt_ops = time.time() - t1
        threads = self.threads_cpu_s()
        dt_threads = time.time() - t1
        return {"store_ops_per_s": round((ops1 - ops0) / dt_ops, 1),
                "coordinator_own_ops_per_s": round((mine1 - mine0) / dt_ops, 1),
                "coordinator_cpu_share": round(cpu / dt_cpu, 4),
                # the simulated side: its agents, node stores and ranks, on this machine's cores
                "simulated_cpu_share": round(own / dt_cpu, 4),
                # every loopback message of the harness (records, beats, the door's calls)
                "tcp_segments_per_s": round(seg / dt_cpu, 1),
                "simulated_cpu_share_by_thread": {
                    k: round((v - threads0.get(k, 0.0)) / dt_threads, 4)
                    for k, v in sorted(threads.items(), key=lambda kv: -kv[1])},
                "node_store_ops_per_s_each": round((node1 - node0) / dt_ops /
                                                   (self.nodes_n + self.spare_nodes), 1)}

    def failure(self, kind: str, gen: int, timeout_s: float) -> dict:
        """Kill one rank (on node 1) or one node (node 2, or 1 with two nodes); time each phase
        of the generation that replaces it."""
        node = min(1 if kind == "rank" else 2, self.nodes_n - 1)
        threads0 = self.threads_cpu_s()  # first: a question to every shard takes a while
        cpu0, own0 = self.cpu_s(), self.shards_cpu_s()
        lost0, t_fail = int(self.store.add(protocol.LOST, 0)), time.time()
        self._ask(self.shard_of[node], "kill_rank" if kind == "rank" else "kill_node", node)
        # the coordinator counts the loss first thing (replacing._handle): from there on the
        # CPU and the messages are the recovery's (the steady state's share aside)
        deadline = t_fail + timeout_s  # for the detection and the generation together
        while int(self.store.add(protocol.LOST, 0)) == lost0 and time.time() < deadline:
            time.sleep(0.02)
        at_lost = (time.time(), self.cpu_s() + self.shards_cpu_s(), tcp_segments())
        if not self.wait_gen(gen, max(1.0, deadline - time.time())):
            return {"kind": kind, "error": f"generation {gen} not complete in {timeout_s} s: "
                    f"{self.why_not_complete(gen)}"}
        cpu1, own1, seg1, t_seen = self.cpu_s(), self.shards_cpu_s(), tcp_segments(), time.time()
        cpu, own = cpu1 - cpu0, own1 - own0
        threads = {k: round(v - threads0.get(k, 0.0), 2) for k, v in self.threads_cpu_s().items()}
        failures = [f for f in self.ask()[1] if f["gen"] == gen]
        head = json.loads(self.store.get(protocol.plan_key(gen)))
        times = self._all("times", gen)
        t_detect = min(f["t_detect"] for f in failures)
        t_plan = max(p for p, _ in times)
        t_barrier = max(b for _, b in times)
        return {"kind": kind, "lost_ranks": len(failures),
                "detect_s": round(t_detect - t_fail, 4),
                "decide_s": round(head["t"] - t_detect, 4),
                "plan_to_every_rank_s": round(t_plan - head["t"], 4),
                "barrier_complete_s": round(t_barrier - head["t"], 4),
                # from the detection: the decision's gather window and publication included
                "decision_to_barrier_s": round(t_barrier - t_detect, 4),
                # from the loss counted until the harness saw every rank through: CPU (the
                # coordinator's and the simulated side's) and TCP segments, the steady
                # state's share among them (scale_text.beyond_steady takes it out)
                "from_detection": {"window_s": round(t_seen - at_lost[0], 3),
                                   "cpu_s": round(cpu1 + own1 - at_lost[1], 3),
                                   "tcp_segments": seg1 - at_lost[2]},
                # where the CPU went from the kill to every rank ready: the simulated ranks'
                # own client work runs here on two cores, the coordinator's in its process
                "cpu_s": {"coordinator": round(cpu, 3), "simulated_nodes_and_ranks": round(own, 3),
                          # the ranks' event loops (sim-ranks), the agents, their doors...
                          "simulated_ranks": threads.get("sim-ranks", 0.0),
                          # by kind of thread (read a moment after the rest)
                          "simulated_by_thread": dict(sorted(threads.items(),
                                                             key=lambda kv: -kv[1]))}}

    def close(self) -> None:
        for proc, _ in self.shards:
            proc.kill()
        self.proc.kill()
        for proc, _ in self.shards:
            proc.join(5)
        self.proc.join(5)


def measure(nodes: int, per_node: int, spare_nodes: int = 2, step_s: float = 1.0,
            steady_s: float = 5.0, node_timeout_s: float = protocol.DEFAULTS.node_timeout_s,
            start_timeout_s: float = 300.0, shards: int = 0) -> dict:
    ranks = nodes * per_node
    # A shard's agents take turns at one interpreter lock, which real nodes never share: at 4,096
    # ranks, 8 shards (64 agents each) took 5-7 s from decision to barrier here, 16 shards 3.7-4.1 s
    # and 32 shards 3.0-3.3 s on the same two cores (2026-12-02). About 230 MB of memory each.
    shards = shards or min(32, max(1, ranks // 128))
    t0 = time.time()
    h = Harness(nodes, per_node, spare_nodes, step_s, node_timeout_s, shards)
    try:
        if not h.wait_gen(0, start_timeout_s):
            raise RuntimeError(scale_text.not_started(h, start_timeout_s))
        started_s = time.time() - t0
        time.sleep(2 * max(step_s, record_interval_s(node_timeout_s)))  # every node reporting
        out = {"nodes": nodes, "ranks_per_node": per_node, "ranks": ranks,
               "spare_nodes": spare_nodes, "step_s": step_s, "start_s": round(started_s, 2),
               "node_timeout_s": node_timeout_s,
               "shards": len(h.shards),
               "steady": h.steady(steady_s)}
        # the coordinator's connections, as its process holds them (its own and the harness's
        # included): about one per node, through each node's door, whatever the ranks per node
        out["coordinator_connections"] = coordinator_connections(h.proc.pid, h.port)
        out["cores"] = len(os.sched_getaffinity(0))
        out["rank_failure"] = h.failure("rank", 1, 60.0)
        time.sleep(1.0)
        out["node_failure"] = h.failure("node", 2, 60.0 + node_timeout_s)
        for f in (out["rank_failure"], out["node_failure"]):
            if "error" not in f:
                scale_text.beyond_steady(out, f)
        given = min(REGROUP_S_GIVEN, key=lambda n: abs(n - ranks))
        out["given"] = {"regroup_s": REGROUP_S_GIVEN[given],
                        "regroup_source": f"communicator build at about {given} GPUs: NCCL's "
                        "published init times, as assumed in launcher/bench/model.py"}
        out["measured"] = ["steady", "rank_failure", "node_failure", "start_s"]
        return out
    finally:
        h.close()


def node_timeout_for(nodes: int) -> float:
    """The node timeout the harness gives a size by default: the product's (3 s) up to 512
    nodes, 12 s per 512 nodes beyond. Every simulated node's real agent runs on this machine's
    cores: at 2,048 nodes with 3 s their records alone took more CPU than it has, and with 12 s
    (and the shards' old 5 ms switch interval) forming generation 0 starved whole shards' agents
    for 25-50 s, and healthy nodes were fenced (docs/scale.md). A record comes six times per
    node timeout (agent.py). A cluster's nodes each have their own cores and need no such thing;
    decision to barrier, reported apart from detection, does not depend on it."""
    d = protocol.DEFAULTS.node_timeout_s
    return d if nodes <= 512 else 4 * d * nodes / 512


def main(argv=None) -> int:
    # Every c10d client looks up the name of its own socket as it connects. This machine's
    # resolver has no local answer for a v4-mapped loopback address and its DNS server drops
    # about one query in 20, which glibc waits 5 s for: thousands of connections then take
    # minutes. One second and no retry (set before the first lookup; the children inherit it).
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")
    # that lookup's warning, thousands of times
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if os.environ.get("SCALE_DEBUG"):  # kill -USR1 <pid>: every thread's stack on stderr
        import faulthandler
        import signal
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    p = argparse.ArgumentParser(prog="python -m launcher.bench.scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=512)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--spare-nodes", type=int, default=2)
    p.add_argument("--step-s", type=float, default=1.0, help="simulated step time")
    p.add_argument("--steady-s", type=float, default=5.0, help="steady-state window")
    p.add_argument("--node-timeout-s", type=float, default=None,
                   help="a node's silence before it is declared lost (default: the product's "
                   "3 s up to 512 nodes, 12 s per 512 nodes beyond: see node_timeout_for)")
    p.add_argument("--shards", type=int, default=0,
                   help="processes holding the simulated nodes (0: one per 128 ranks, up to 32)")
    p.add_argument("--start-timeout-s", type=float, default=300.0,
                   help="how long every simulated rank may take to pass generation 0")
    p.add_argument("--curve", action="store_true",
                   help="256, 1,024, 4,096, 16,384 and 32,768 ranks at 8 per node, and 512 "
                   "nodes x 1; stops at the first size that cannot be measured (exit 1)")
    p.add_argument("--out", help="write the figures as JSON here")
    a = p.parse_args(argv)
    sizes = [(a.nodes, a.ranks_per_node)]
    if a.curve:
        sizes = [(32, 8), (128, 8), (512, 1), (512, 8), (2048, 8), (4096, 8)]
    rows, code = [], 0
    for nodes, per_node in sizes:
        try:
            timeout_s = a.node_timeout_s or node_timeout_for(nodes)
            row = measure(nodes, per_node, a.spare_nodes, a.step_s, a.steady_s, timeout_s,
                          start_timeout_s=a.start_timeout_s, shards=a.shards)
        except (RuntimeError, OSError, EOFError) as exc:  # past what this machine can hold
            why = str(exc) if isinstance(exc, RuntimeError) else f"{type(exc).__name__}: {exc}"
            print(f"{nodes} nodes x {per_node}: could not be measured: {why}", flush=True)
            # said in the JSON too, and in the exit status: a size that did not run is a failure
            rows.append({"nodes": nodes, "ranks_per_node": per_node, "ranks": nodes * per_node,
                         "error": why})
            code = 1
        else:
            print_row(row)
            rows.append(row)
            if any("error" in row[k] for k in ("rank_failure", "node_failure")):
                code = 1  # a recovery that did not complete is no figure
        if a.out:
            with open(a.out, "w") as f:
                json.dump(rows, f, indent=1)
        if code:
            break
    return code

