"""The simulated side of the scale harness (scale.py): ranks that speak the worker's protocol
without training, the nodes whose real agents start them, and the counted store clients.

A `SimRank` is what a node agent takes for a worker process (Popen's surface, as far as the agent
uses it). It runs the worker's side with the library's own steps: it writes `ready`, waits for
the next plan, reads its node's part (`membership.follow_steps`, what `membership.follow` runs),
meets the others at the per-node barrier (`membership.barrier_steps`). Its node beats for it
into the node store once a step, as each worker's reporter thread does, and rank 0's node writes
the step records. The ranks of a shard are programs of one event loop, over connections of their
own (scale_wire.py): thousands of threads would measure the GIL, not the protocol.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import traceback

from checkpointless.protocol import membership
from checkpointless import protocol
from checkpointless.control.agent import NodeAgent
from checkpointless.control.node_door import StoreDoor

from launcher.bench.scale import wire
from launcher.bench.scale.proc import cpu_s


SWITCH_S = float(os.environ.get("SCALE_SWITCH_S", "0.05"))  # shard_main says why


class Counter:
    def __init__(self):
        self.n = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.n += 1


class Wrapped:
    """A store client whose every call first runs `before()` (count it; or fail, as a killed
    node's would) and, given a `lock`, takes turns with other threads (a client is not
    thread-safe)."""

    def __init__(self, store, before=None, lock=None):
        self._store, self._before, self._lock = store, before, lock

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*a, **k):
            if self._before is not None:
                self._before()
            if self._lock is None:
                return attr(*a, **k)
            with self._lock:
                return attr(*a, **k)
        return call


def connect(port: int, counter: Counter, timeout_s: float = 120.0):
    """A client of the store on `port` (127.0.0.1) whose calls `counter` counts."""
    return Wrapped(membership.connect("127.0.0.1", port, timeout_s), counter.add)


# ---- a simulated rank ----------------------------------------------------------------------
class SimRank:
    """What a node agent takes for a worker process (Popen's surface, as far as the agent uses
    it), running the worker's side of the protocol as a program of its shard's event loop
    (scale_wire.Loop), over connections of its own: one to the coordinator's store, one to its
    node's store, as a worker has."""

    def __init__(self, env: dict, node: "SimNode"):
        self.wid = int(env[protocol.ENV_WORKER_ID])
        self.store_port = int(env[protocol.ENV_STORE_PORT])
        self.node = node
        self.pid = 0  # no process: /proc has no pid 0, so it is never seen as stopped
        self.returncode: int | None = None
        self.rank, self.gen = -1, -1
        self.times: dict[int, tuple[float, float]] = {}  # gen -> (plan read, barrier done)
        self._fd = os.eventfd(0)
        self._conns: list = []
        self._program = self._run()
        node.harness.loop.start(self._program, on_error=self._failed)

    # Popen's surface
    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.time() + timeout
        while self.returncode is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(f"sim {self.wid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def signal_tree(self, sig) -> None:
        self.die(-int(sig))

    def open_fd(self) -> int:
        return os.dup(self._fd)

    def die(self, code: int = -9) -> None:
        """Killed (from any thread): its connections close, as a dead process's sockets do."""
        if self.returncode is None:
            self.returncode = code
            os.eventfd_write(self._fd, 1)  # the agent's poll wakes, as on a pidfd
            self.node.harness.loop.stop(self._program, self._conns)

    def _failed(self, exc: Exception) -> None:
        """A store connection broke: the coordinator is gone, the harness is over."""
        if os.environ.get("SCALE_DEBUG"):
            print(f"[sim rank {self.wid}] {type(exc).__name__}: {exc}", flush=True)
        self.die(1)

    # the worker's side: a generator of store calls (scale_wire.Loop runs it)
    def _run(self):
        h = self.node.harness
        # the coordinator's address a worker is given: its node's door (node_door.py)
        job = yield ("open", self.store_port, h.main_ops.add)
        self._conns.append(job)
        node = yield ("open", self.node.agent.node_server.port, h.node_ops.add)
        self._conns.append(node)
        stores = {"job": job, "node": node}
        yield (job, "set", protocol.ready_key(self.wid), f"{time.time():.6f}")
        seen = -1
        while True:
            # as a worker's watch does: the plans wait in the node's store (its agent copies
            # them there)
            yield (node, "wait", [protocol.plan_key(seen + 1)])
            g = seen + 1  # a newer one, if any, is read on the next turn
            # the library's own steps: what membership.follow and membership.barrier run
            seat = yield from wire.on(membership.follow_steps(
                self.wid, self.node.k, self.rank, seen, g), stores)
            seen, t_plan = g, time.time()
            if seat is None:
                if self.rank >= 0:  # dropped from the plan
                    return self.die(1)
                continue
            self.rank = seat.rank
            if (yield from wire.on(membership.barrier_steps(seat), stores)):
                self.gen = g
                self.times[g] = (t_plan, time.time())


class SimNode:
    """One node: a real NodeAgent in a thread, starting SimRanks, and a program that writes
    its live ranks' heartbeats into the node store every step (what each worker's reporter
    does), and rank 0's step records into the job's."""

    def __init__(self, harness, k: int, procs: int):  # harness: the Shard it belongs to
        self.harness, self.k, self.port = harness, k, harness.port
        self.ranks: list[SimRank] = []
        self.dead = False
        # the node's door, as run_agent stands it: every process of the node reaches the
        # coordinator through it, over one connection whatever the ranks per node
        self.said: list[str] = []  # what its agent and its door logged, newest last
        self.ended: str | None = None  # how its agent's loop ended, if it did
        self.door = StoreDoor(hold=False, log=self._say)
        self.door.retarget("127.0.0.1", self.port)
        self.agent_store = connect(self.door.port, harness.main_ops)
        self.agent = NodeAgent(Wrapped(self.agent_store, self._alive), k, ["sim"], {}, "127.0.0.1",
                               self.door.port, harness.node_timeout_s, log=self._say,
                               starter=self._start, connect=self._connect)
        harness.loop.start(self._beat())
        self.thread = threading.Thread(target=self._run_agent, args=(procs,), daemon=True,
                                       name=f"node{k}-agent")
        self.thread.start()
        self.seen = (0, time.time())  # its agent's records written, when that last moved

    def _say(self, m: str) -> None:
        self.said = self.said[-4:] + [f"{time.strftime('%H:%M:%S')} {m}"]
        if os.environ.get("SCALE_DEBUG"):
            print(f"[node {self.k}] {m}", file=sys.stderr, flush=True)

    def _run_agent(self, procs: int) -> None:
        """The agent's loop; how it ended is kept (an agent that ends is a node gone silent)."""
        try:
            self.ended = f"exit {self.agent.run(procs)}"
        except BaseException as exc:  # noqa: BLE001  said in the harness's report
            self.ended = f"{type(exc).__name__}: {exc}"
            raise

    def _connect(self, host: str, port: int):
        """The agent's own threads' connections (commands, plans), counted with the rest."""
        return connect(port, self.harness.main_ops if port == self.door.port else
                       self.harness.node_ops)

    def _start(self, cmd, env):
        r = SimRank(env, self)
        self.ranks.append(r)
        return r

    def _beat(self):
        h = self.harness
        beats = yield ("open", self.agent.node_server.port, h.node_ops.add)
        job = None  # for rank 0's step records, if this node holds it
        step = 0
        while not self.dead:
            yield ("sleep", h.step_s)
            step += 1
            for r in list(self.ranks):
                if r.returncode is None and r.gen >= 0:
                    yield (beats, "set", protocol.heartbeat_key(r.wid), json.dumps(
                        {"t": time.time(), "step": step, "gen": r.gen, "phase": "step"}))
                    if r.rank == 0:  # rank 0's step record, as its reporter writes it
                        job = job or (yield ("open", self.door.port, h.main_ops.add))
                        yield (job, "multi_set", [protocol.step_key(step), protocol.LAST_STEP],
                               [f"{time.time() - h.step_s:.6f},{time.time():.6f}", str(step)])

    def _alive(self) -> None:
        """Before each of its agent's calls: once the node is killed, its launcher is gone and
        no health record reaches the coordinator any more."""
        if self.dead:
            time.sleep(1.0)
            raise RuntimeError("node killed by the harness")

    def kill(self) -> None:
        """The whole node goes down at once: its launcher silent, its workers dead."""
        self.dead = True
        for r in self.ranks:
            r.die(-9)
        self.door.close()  # the node's connections to the coordinator go with it


# ---- a shard: some of the simulated nodes, in a process of their own ------------------------
class Shard:
    """The simulated nodes `node_ids`: their agents' threads, and one event loop for all their
    ranks. The agents are real (torch's store client, a thread per call in flight); a few
    hundred agents with their threads fit one Python process, so a big job is split over
    several processes, each a shard."""

    def __init__(self, port: int, node_ids: list[int], per_node: int, step_s: float,
                 node_timeout_s: float):
        from concurrent.futures import ThreadPoolExecutor
        self.port, self.step_s, self.node_timeout_s = port, step_s, node_timeout_s
        self.main_ops, self.node_ops = Counter(), Counter()
        self.loop = wire.Loop()  # every simulated rank of the shard, on one thread
        with ThreadPoolExecutor(64) as pool:
            self.nodes = {k: n for k, n in zip(node_ids, pool.map(
                lambda k: SimNode(self, k, per_node), node_ids))}

    def ranks(self) -> list[SimRank]:
        """The ranks alive and holding a rank."""
        return [r for n in self.nodes.values() for r in n.ranks
                if r.returncode is None and r.rank >= 0]

    def answer(self, op: str, arg):
        if op == "ops":
            return self.main_ops.n, self.node_ops.n
        if op == "cpu_by_thread":  # CPU seconds by kind of thread; "c++": torch's store servers
            return cpu_by_thread()
        if op == "status":  # ranks alive, and how many of them completed generation `arg`
            ranks = self.ranks()
            return len(ranks), sum(1 for r in ranks if r.gen >= arg)
        if op == "times":  # the last plan read and the last barrier passed of generation `arg`
            ranks = [r for r in self.ranks() if arg in r.times]
            return (max((r.times[arg][0] for r in ranks), default=0.0),
                    max((r.times[arg][1] for r in ranks), default=0.0))
        if op == "stalled":  # SCALE_DEBUG: agents with no record for `arg` s, one's stack
            return _stalled(self, arg)
        if op == "ended":  # the agents whose loop ended, not killed by the harness: how, and
            return {k: (n.ended, n.said) for k, n in self.nodes.items()  # their last words
                    if n.ended is not None and not n.dead}
        if op == "kill_rank":
            next(r for r in self.nodes[arg].ranks if r.returncode is None and r.rank >= 0).die(-9)
            return True
        if op == "kill_node":
            self.nodes[arg].kill()
            return True
        raise ValueError(op)


def _stalled(shard, after_s: float) -> tuple[int, str]:
    """How many of the shard's live agents wrote no record for `after_s`, and where one of
    them stands (its thread's stack)."""
    now, stalled = time.time(), []
    for n in shard.nodes.values():
        if n.agent.seq != n.seen[0]:
            n.seen = (n.agent.seq, now)
        elif now - n.seen[1] > after_s and n.ended is None and not n.dead:
            stalled.append(n)
    if not stalled:
        return 0, ""
    frame = sys._current_frames().get(stalled[0].thread.ident)
    where = "".join(traceback.format_stack(frame)[-6:]) if frame else "?"
    return len(stalled), f"node {stalled[0].k}, silent {now - stalled[0].seen[1]:.1f} s:\n{where}"


def cpu_by_thread() -> dict[str, float]:
    """This process's CPU seconds by kind of thread: the agents' loops, their command and plan
    threads, the doors, the ranks' event loop, the main thread; what Python does not know of
    (the node stores' servers, torch's own threads) as "c++"."""
    import re
    names = {t.native_id: re.sub(r"^node\d+-", "", t.name) for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            used = cpu_s(os.getpid(), tid)
        except OSError:  # ended meanwhile
            continue
        kind = names.get(tid, "c++")
        out[kind] = out.get(kind, 0.0) + used
    return out


def shard_main(port: int, node_ids: list[int], per_node: int, step_s: float,
               node_timeout_s: float, pipe) -> None:
    """A shard's process: build it, say so, then answer the harness through the pipe."""
    # A shard's threads (64 nodes' agents, doors, relays and command threads at 2,048 nodes:
    # about 260) share one interpreter lock, which real nodes never do. A thread waiting for it
    # wakes every switch interval to ask again: at 5 ms, once a recovery made most of them wait
    # at once, those wake-ups alone outran two cores, and a rank's loss at 16,384 ranks took
    # 47-53 s (90 s of CPU) or did not complete. At 50 ms: 7.4 s (13 s of CPU). docs/scale.md.
    sys.setswitchinterval(SWITCH_S)
    shard = Shard(port, node_ids, per_node, step_s, node_timeout_s)
    pipe.send("ready")
    while True:
        try:
            op, arg = pipe.recv()
        except EOFError:  # the harness is gone
            os._exit(0)
        pipe.send(shard.answer(op, arg))
