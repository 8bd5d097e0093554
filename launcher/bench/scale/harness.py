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
the simulated nodes are split over processes (shards: cluster.py starts them and the coordinator
for each size, and drives them).

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
import os
import time

from checkpointless import protocol
from checkpointless.control.agent import record_interval_s

from launcher.bench.scale import text as scale_text
from launcher.bench.scale.text import print_row
from launcher.bench.scale.cluster import Harness
from launcher.bench.scale.proc import coordinator_connections

# NCCL communicator creation at scale cannot be run here. NVIDIA's NCCL 2.23 release notes
# (2024, "scalable init" with ncclCommInitRankScalable) report about 1 s at 1,000s of GPUs and
# several seconds before it; launcher/bench/model.py assumed 2 s at 1,024 GPUs, 5 s at 16,384.
REGROUP_S_GIVEN = {1024: 2.0, 16384: 5.0}


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

