"""One size of the scale harness (harness.py measures it): the real coordinator in a process of
its own, the simulated nodes split over shard processes (sim.py), and what the harness asks
them through pipes: the coordinator's store calls and its failures, the generations the ranks
reached, CPU time, and one rank's or one node's loss followed to the barrier."""
from __future__ import annotations

import collections
import json
import multiprocessing as mp
import os
import sys
import threading
import time

from checkpointless import protocol
from checkpointless.protocol import SupervisorConfig

from launcher.bench.scale import text as scale_text
from launcher.bench.scale.proc import cpu_s, free_port, tcp_segments, wait_port
from launcher.bench.scale.sim import Counter, Wrapped, connect, shard_main


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
