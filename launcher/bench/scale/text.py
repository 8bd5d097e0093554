"""The scale harness's figures as lines of text (scale.py measures them)."""
from __future__ import annotations

import collections
import sys
import time

from checkpointless.control.agent import record_interval_s

from launcher.bench.scale.proc import fd_limit, sockets


def print_row(row: dict) -> None:
    """One size's figures, as the harness prints them (its --out JSON has them all)."""
    st = row["steady"]
    print(f"{row['nodes']:>6} nodes x {row['ranks_per_node']} = {row['ranks']:>6} ranks: "
          f"steady {st['store_ops_per_s']:>8.1f} store ops/s, coordinator CPU "
          f"{100 * st['coordinator_cpu_share']:.1f}% of a core, simulated side "
          f"{100 * st['simulated_cpu_share']:.0f}% (started in {row['start_s']} s); the "
          f"coordinator holds {row['coordinator_connections']['store']} store connections "
          f"({row['nodes'] + row['spare_nodes']} nodes); node timeout {row['node_timeout_s']:g} s")
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
              f"{f['cpu_s']['simulated_nodes_and_ranks']:.2f} s (the ranks "
              f"{f['cpu_s']['simulated_ranks']:.2f} s of it)" + _beyond(row, f))
    print(f"    given, not measured: regroup {row['given']['regroup_s']} s "
          f"({row['given']['regroup_source']})", flush=True)


def beyond_steady(row: dict, f: dict) -> None:
    """What a recovery `f` cost from its detection on, beyond the steady state's share, added:
    CPU (the coordinator's and the simulated side's), per node, and the least time that CPU
    takes on this machine's cores; and the loopback TCP segments, per node. Every simulated
    node's agent, door, node store and ranks run here on a few cores: a recovery that needs
    more CPU than cores x seconds cannot be faster, whatever its protocol's latency."""
    st, nodes, d = row["steady"], row["nodes"] + row["spare_nodes"], f["from_detection"]
    cpu = d["cpu_s"] - (st["coordinator_cpu_share"] + st["simulated_cpu_share"]) * d["window_s"]
    segments = d["tcp_segments"] - st["tcp_segments_per_s"] * d["window_s"]
    f["beyond_steady"] = {"cpu_s": round(cpu, 3), "cpu_ms_per_node": round(1e3 * cpu / nodes, 2),
                          "cpu_bound_s": round(cpu / row["cores"], 3),
                          "tcp_segments_per_node": round(segments / nodes, 1)}


def _beyond(row: dict, f: dict) -> str:
    b = f.get("beyond_steady")
    if b is None:
        return ""
    return (f"; beyond the steady state: {b['cpu_ms_per_node']:.1f} ms of CPU and "
            f"{b['tcp_segments_per_node']:.0f} TCP segments a node, at least "
            f"{b['cpu_bound_s']:.2f} s of {row['cores']} cores")


def ended(agents: dict) -> str:
    """What the report says of agents whose loop ended by itself (node -> (how, last words))."""
    if not agents:
        return ""
    how = dict(collections.Counter(e for e, _ in agents.values()))
    k = min(agents)
    return (f"; {len(agents)} agent(s) ended by themselves ({how}); node {k}'s last words: "
            f"{agents[k][1]}")


def monitor(h) -> None:
    """SCALE_DEBUG: every second, the calls the coordinator's store took (its own apart) and
    the ranks alive and through generation 0, from the harness `h`."""
    last = (time.time(), 0, 0)
    while True:
        time.sleep(1.0)
        status, (ops, own, _) = h._all("status", 0), h.ops()
        dt = time.time() - last[0]
        print(f"[scale {time.strftime('%X')}] coordinator's store: {(ops - last[1]) / dt:.0f} "
              f"calls/s, {(own - last[2]) / dt:.0f} its own; ranks alive and through "
              f"generation 0: {sum(a for a, _ in status)}, {sum(d for _, d in status)}",
              file=sys.stderr, flush=True)
        last = (time.time(), ops, own)
        after = 2 * record_interval_s(h.node_timeout_s)  # two records missed
        stalled = [s for s in h._all("stalled", after) if s[0]]
        if stalled:
            print(f"[scale {time.strftime('%X')}] {sum(n for n, _ in stalled)} agent(s) wrote "
                  f"no record for {after:g} s; {stalled[0][1]}", file=sys.stderr, flush=True)


def not_started(h, timeout_s: float) -> str:
    """What stood at the start's deadline for the harness `h` (scale.Harness): the ranks up,
    the coordinator alive, its sockets."""
    try:
        status = h._all("status", 0)
        alive, done = sum(a for a, _ in status), sum(d for _, d in status)
    except (OSError, EOFError):
        alive = done = -1
    coord = "alive" if h.proc.is_alive() else f"exited ({h.proc.exitcode})"
    return (f"{h.nodes_n * h.per_node} simulated ranks did not all start within "
            f"{timeout_s:g} s: {alive} held a rank, {done} passed generation 0's barrier; "
            f"the coordinator's process {coord}, holding {sockets(h.proc.pid)} "
            f"connections (this process may open {fd_limit()} files)")
