"""A node agent: the launcher of a node that is not the coordinator's (cluster.py: the other side).

It starts the worker processes the coordinator asks for, watches them without polling (pidfds),
judges them (exits, heartbeats, stopped processes) and reports one health record per node: every
`node_beat_s`, and at once when a worker exits. Its workers beat into a small store the agent hosts
(the node store), so the coordinator's steady load grows with nodes, not ranks. A thread of its
own blocks on the coordinator's next command (spawn, kill), so nothing polls for them either.
Another copies each new generation's plan, and its barrier's outcome, into the node store, where
the node's workers wait for them: a new generation wakes one waiter per node in the job's store.

It stops its workers and exits when the job is over (0), when the coordinator fenced this node
(3: it was declared lost; its processes hold no rank in any newer plan), or when the coordinator
has been unreachable for `node_timeout_s` (4: losing the coordinator cannot be recovered
in-process). Workers die with their agent (PR_SET_PDEATHSIG), so a launcher killed with SIGKILL
leaves none.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
import time
from datetime import timedelta

from . import detection
from .agent_threads import follow_commands, relay_plans
from ..protocol import membership
from .. import protocol
from ..protocol.records import (RUN, AgentExit, NodeCommand, NodeOp, NodeRecord, NodeWord, Word,
                                is_record)
from .processes import (SERVER_WAIT_S, Worker, close_reaped, kill_tree, open_pidfd, start_process,
                        stop_all, wait_for_exit, warm_server)

D = protocol.DEFAULTS


def record_interval_s(node_timeout_s: float) -> float:
    """How often an agent writes its node's record: every node_beat_s, or six times per node
    timeout when that is longer (a job that gives its nodes longer to be silent, thousands of
    nodes, sends fewer records)."""
    return max(D.node_beat_s, node_timeout_s / 6)


class NodeAgent:
    """Owns the worker processes of one node that is not the coordinator's, and its node store.

    `starter(cmd, env)` starts one worker (start_process; the scale harness passes simulated
    ranks that speak the protocol without training), and `connect(host, port)` makes the
    connections of its threads (the harness counts their calls)."""

    def __init__(self, store, node: int, cmd: list[str], env: dict, store_host: str,
                 store_port: int, node_timeout_s: float, log=print, starter=start_process,
                 connect=membership.connect, role_watch=None):
        self.store, self.node, self.cmd, self.env = store, node, cmd, env
        self.host, self.port = store_host, store_port
        self.node_timeout_s = node_timeout_s
        self.beat_s = record_interval_s(node_timeout_s)
        self.log = log
        self.starter, self.connect = starter, connect
        self.workers: dict[int, Worker] = {}
        self.exited: dict[int, int] = {}  # wid -> exit code, as reported to the coordinator
        self.seq = 0  # health records written
        # what this node's health key holds, as of this agent's last write: its own last record,
        # or the coordinator's word ("fenced: ...", "shutdown") that replaced it
        self._held = ""
        self.spare_wids: set[int] = set()  # started as spares (said in a hello)
        self.next_cmd = 0  # the number of the coordinator's next command
        self.bell_at: int | None = None  # the ring of its group's bell the command thread awaits
        # coordinator=etcd (role_watch.py): who coordinates is looked up in etcd, the store is
        # reached through the node's door, and the coordinator's loss is waited out
        self.role_watch = role_watch
        self.beaten: set[int] = set()  # workers whose heartbeat key exists (read in one call)
        # the node store: its workers' heartbeats and the barrier's first gathering
        self.node_server, self.node_store = membership.host("127.0.0.1")
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self.leaving = False  # run() is over: a broken relay connection is the end
        self._wake_r, self._wake_w = os.pipe()  # the command thread wakes the loop through it
        os.set_blocking(self._wake_r, False)
        if starter is start_process:  # the fork server preloads while the agent connects
            warm_server(cmd, env, 0)

    def run(self, procs_here: int) -> int:
        """Serve the coordinator until the job ends (0), this node is fenced (3) or the
        coordinator is unreachable (4)."""
        if self.starter is start_process:  # before the hello: the loop must not wait on it
            warm_server(self.cmd, self.env, SERVER_WAIT_S)
        self.hello(procs_here)
        asked: list[str] = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):  # preemption: the coordinator stops it
                signal.signal(sig, lambda s, _f: asked.append(signal.Signals(s).name))
        threading.Thread(target=self._follow_commands, daemon=True,
                         name=f"node{self.node}-commands").start()
        threading.Thread(target=self._relay_plans, daemon=True,
                         name=f"node{self.node}-plans").start()
        try:
            return self._serve(asked)
        finally:
            self.leaving = True
            stop_all(list(self.workers.values()))
            try:  # the coordinator waits for these exits as the job ends
                self.health(news=bool(self.new_exits()), final=True)
            except (RuntimeError, OSError):
                pass

    def hello(self, procs_here: int) -> None:
        """Say who this node is, and (to a coordinator taking over) what runs here: every
        process it started (its slot, spare or not, its exit code if it exited) and the number
        of the next command it waits for."""
        self.procs_here = procs_here
        self.health(news=False)  # the coordinator finds a record at once
        lost_at = self.role_watch.coordinator_lost_at if self.role_watch else None
        self.store.set(protocol.node_hello_key(self.node), json.dumps(
            {"host": os.uname().nodename, "procs": procs_here, "pid": os.getpid(),
             "t": time.time(), "node_store_port": self.node_server.port,
             "next_cmd": self.next_cmd, "bell": self.bell_at, "coordinator_lost_at": lost_at,
             "workers": {str(wid): {"slot": w.slot, "spare": wid in self.spare_wids,
                                    "code": self.exited.get(wid), "pid": w.proc.pid,
                                    "ready": self._ready(wid)}
                         for wid, w in self.workers.items()}}))

    def _ready(self, wid: int) -> bool:
        """The worker said it is warm (joining.py writes it into the node store too)."""
        try:
            return bool(self.node_store.check([protocol.ready_key(wid)]))
        except (RuntimeError, OSError):
            return False

    def _serve(self, asked: list[str]) -> int:
        last_ok, next_health = time.time(), 0.0
        while True:
            rw = self.role_watch
            if rw is not None:
                if rw.fenced:
                    self.log(f"[node {self.node}] fenced ({rw.fenced}): stopping this node's "
                             "workers")
                    return AgentExit.FENCED
                if rw.gave_up:
                    self.log(f"[node {self.node}] {rw.gave_up}; stopping this node's workers. "
                             "Resume from the newest durable checkpoint "
                             "(checkpoint.resume=auto)")
                    return AgentExit.COORDINATOR_LOST
            try:
                if rw is not None and rw.moved.is_set():  # a new coordinator: say hello to it
                    rw.moved.clear()
                    self.hello(self.procs_here)
                said = self.serve_commands()
                if said is not None and said.kind is Word.SHUTDOWN:
                    return AgentExit.OK
                if said is not None:  # the job failed: the coordinator stopped it (its log
                    self.log(f"[node {self.node}] the coordinator {said}")  # says why)
                    return AgentExit.COORDINATOR_LOST
                news = self.new_exits()
                if news or time.time() >= next_health:
                    state = self.health(news=bool(news))
                    next_health = time.time() + self.beat_s
                    if state.kind is Word.FENCED:
                        self.log(f"[node {self.node}] fenced by the coordinator ({state}): "
                                 "stopping this node's workers")
                        return AgentExit.FENCED
                    if state.kind is Word.SHUTDOWN:
                        return AgentExit.OK
                    if state.kind is Word.STOPPED:
                        self.log(f"[node {self.node}] the coordinator {state}")
                        return AgentExit.COORDINATOR_LOST
                if asked:
                    self.store.set(protocol.PREEMPT_ASK, f"{asked[0]} on node {self.node}")
                    asked.clear()
                last_ok = time.time()
            except (RuntimeError, OSError) as exc:  # the store (the coordinator) is gone
                if rw is None and time.time() - last_ok > self.node_timeout_s:
                    self.log(f"[node {self.node}] the coordinator has been unreachable for "
                             f"{self.node_timeout_s:g} s ({type(exc).__name__}); stopping "
                             "this node's workers. Losing the coordinator cannot be "
                             "recovered in-process: resume from the newest durable "
                             "checkpoint (checkpoint.resume=auto)")
                    return AgentExit.COORDINATOR_LOST
                time.sleep(D.store_retry_s)
                continue
            close_reaped(self.workers.values())
            wait_for_exit(list(self.workers.values()), max(0.0, next_health - time.time()),
                          extra_fds=[self._wake_r])

    # the bodies of its two threads (agent_threads.py), each given this agent
    _follow_commands, _relay_plans = follow_commands, relay_plans

    def command_came(self, c: NodeCommand) -> None:
        """From the command thread (agent_threads.py): queue `c` and wake the loop."""
        self._cmds.put(c)
        os.write(self._wake_w, b"c")

    def serve_commands(self) -> NodeWord | None:
        """Carry out the queued commands; the word of a shutdown (the job is over, or it
        stopped: why), else None."""
        try:
            os.read(self._wake_r, 4096)
        except BlockingIOError:
            pass
        while not self._cmds.empty():
            c = self._cmds.get()
            if c.op is NodeOp.SPAWN:
                self._spawn(c.wid, c.slot, c.spare)
            elif c.op is NodeOp.KILL and c.wid in self.workers:
                kill_tree(self.workers[c.wid].proc)
            elif c.op is NodeOp.SHUTDOWN:
                return NodeWord(Word.STOPPED, c.why) if c.why else NodeWord(Word.SHUTDOWN)
        return None

    def _spawn(self, wid: int, slot: int, spare: bool) -> None:
        env = dict(self.env, **protocol.worker_env(self.host, self.port, wid, slot, spare,
                                                   self.node, self.node_server.port))
        proc = self.starter(self.cmd, env)
        if spare:
            self.spare_wids.add(wid)
        fd = proc.open_fd() if hasattr(proc, "open_fd") else open_pidfd(proc.pid)
        self.workers[wid] = Worker(wid=wid, proc=proc, slot=slot, started=time.time(),
                                   node=self.node, pidfd=fd)
        self.store.set(protocol.node_pid_key(self.node, wid), str(proc.pid))

    def new_exits(self) -> dict[int, int]:
        """Children that exited since the last call (kept for every later record)."""
        new = {wid: w.proc.returncode for wid, w in self.workers.items()
               if wid not in self.exited and w.proc.poll() is not None}
        self.exited.update(new)
        return new

    def health(self, news: bool, final: bool = False) -> NodeWord:
        """Write this node's record: each live worker's last heartbeat (its step, how long ago,
        its generation and phase, its newest steps' own times for the straggler check), which
        are stopped (SIGSTOP, a frozen container: only this node can see it) and every exit so
        far. With news (an exit), the job's event counter moves so the coordinator reads the
        records at once. Returns the coordinator's word for
        this node ("run", "fenced: ...", "shutdown"), read in the same call. `final`: the
        agent is leaving, its workers stopped."""
        live = [wid for wid, w in self.workers.items() if wid not in self.exited]
        beats = detection.read_beats(self.node_store, live, self.beaten)
        now = time.time()
        self.seq += 1
        record = NodeRecord(
            seq=self.seq, t=now,
            beats={str(w): [b["step"], round(now - b["t"], 3), b["gen"], b["phase"],
                            b.get("pace", [])] for w, b in beats.items() if b},
                  # only a silent worker can be judged hung, and a stopped one beats no more:
                  # /proc is read for those whose beat is older than STOPPED_AFTER_S
            stopped=[w for w in live if (not beats.get(w) or now - beats[w]["t"] >
                                         detection.STOPPED_AFTER_S)
                     and detection.process_stopped(self.workers[w].proc.pid)],
            exited={str(k): v for k, v in self.exited.items()}, final=final)
        raw = record.to_json()
        state = self._write(raw)
        if final and state.kind not in (Word.RUN, Word.FENCED):
            state = self._write(raw)  # the job's end: its last record replaces the word
        if news:
            self.store.add(protocol.NODE_EVENTS, 1)
        return state

    def _write(self, raw: str) -> NodeWord:
        """Write the record `raw` unless the coordinator replaced this node's record with its
        word ("fenced: <why>", "shutdown", "stopped: <why>"), in one call (a compare_set that
        expects what this agent wrote last): the word comes back instead, and a fenced node
        cannot write again. Returns RUN or the word."""
        held = NodeWord.parse(self._held) if self._held else None
        if held is not None and held.kind is Word.FENCED:
            return held
        key, want = protocol.node_health_key(self.node), raw.encode()
        for _ in range(3):
            got = self.store.compare_set(key, self._held, raw)
            if got == want:
                self._held = raw
                return RUN
            text = got.decode()
            if not is_record(text):
                self._held = text
                return NodeWord.parse(text)
            # a record not this one: the key is absent (a new coordinator's store; compare_set
            # then answers what it expected), or the coordinator wrote one for a silent node
            self._held = "" if text == self._held else text
        raise RuntimeError(f"node {self.node}'s health record could not be written")


def run_agent(node: int, cmd: list[str], host: str, port: int, node_timeout_s: float,
              procs_here: int, connect_timeout_s: float = 300.0) -> int:
    """A node's launcher when it is not the coordinator: connect, serve, return an exit code.
    The node's processes (its workers, the agent's threads) reach the coordinator through the
    node's door (node_door.py): one connection per node, whatever the ranks per node."""
    from .node_door import StoreDoor
    try:  # the coordinator is up (said plainly if not) before the door stands in front of it
        membership.connect(host, port, timeout_s=connect_timeout_s)
    except Exception as exc:  # noqa: BLE001
        print(f"[node {node}] cannot reach the coordinator at {host}:{port}: {exc}",
              file=sys.stderr, flush=True)
        return AgentExit.COORDINATOR_LOST
    door = StoreDoor(hold=False)  # one coordinator for the job's life: its loss fails calls
    door.retarget(host, port)
    store = membership.connect("127.0.0.1", door.port, timeout_s=connect_timeout_s)
    store.set_timeout(timedelta(seconds=max(2.0, node_timeout_s)))
    agent = NodeAgent(store, node, cmd, dict(os.environ), "127.0.0.1", door.port,
                      node_timeout_s, log=lambda m: print(m, file=sys.stderr, flush=True))
    return agent.run(procs_here)
