"""Many machines, the coordinator's side: one launcher per node, whole nodes lost and replaced.

The coordinator (the supervisor, in node 0's launcher or stand-alone) owns the store and the
membership, as on one machine. Every other node runs an agent (agent.py) that starts and kills
the workers the coordinator asks for, and judges them; the keys they share are in protocol.py.
The coordinator's load grows with nodes, not ranks: one read of one counter per wake-up (agents
move it when a worker exits), and every health_every_s one read of every node's health record
(its workers' heartbeats, stopped processes and exits) in a single call.

A node is lost when its health record has not changed for `node_timeout_s` (its launcher is gone,
the machine is down, or the link is cut): every worker on it is failed together, in one
generation, and the node is fenced. A fenced node that comes back finds the fence and kills its processes;
they hold no rank in any newer plan, so nothing they do reaches the new generation.
"""
from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field

from .. import protocol
from .bells import Bells
from ..protocol.records import SILENT, NodeCommand, NodeOp, NodeRecord, NodeWord, Word, is_record
from .processes import Worker, WorkerPool, stop_all
from .remote_proc import RemoteProc

D = protocol.DEFAULTS


@dataclass
class NodeState:
    procs: int  # processes this node runs (workers + spares)
    spare_node: bool
    seq: int = 0  # its health record's sequence number when last read
    beat_seen_at: float = 0.0  # when that number last moved
    lost: bool = False
    beats: dict = field(default_factory=dict)  # wid -> heartbeat, as its record gave them
    stopped: frozenset = frozenset()  # its workers whose processes are stopped
    left: bool = False  # its agent wrote its last record: its workers are stopped
    raw: bytes = b""  # the record as last read: one read again unchanged is not parsed again


class ClusterPool(WorkerPool):
    """The supervisor's workers over every node: node 0's are local processes (WorkerPool's own),
    the others' are started and killed through their nodes' agents. Worker ids are global."""

    def __init__(self, cmd, env, host, refill_nice, *, nodes: int, spare_nodes: int,
                 per_node: int, spares_per_node: int, node_timeout_s: float,
                 join_timeout_s: float = D.spare_wait_s, refill: bool = D.refill, log=print,
                 local: bool = True):
        super().__init__(cmd, env, host, per_node, refill_nice, spares_per_node, refill, local)
        # local: node 0 is this process's own machine (the coordinator runs in node 0's
        # launcher); else every node, 0 included, is served by an agent (a stand-alone
        # coordinator on a login node)
        self.local = local
        self.per_node = per_node
        self.node_timeout_s = node_timeout_s
        self.join_timeout_s = join_timeout_s  # how long start() waits for every agent
        self.log = log
        self.nodes = {k: NodeState(per_node + spares_per_node, False) for k in range(nodes)}
        for k in range(nodes, nodes + spare_nodes):
            self.nodes[k] = NodeState(per_node, True)
        self._cmds: dict[int, int] = {}
        self.bells = Bells()  # a command's wake-up, shared by a group of nodes
        self._events = -1  # the agents' event counter when last read
        self._health_at = 0.0  # when every node's record was last read
        self.on_fence = lambda k, why: None  # the supervisor's facts (etcd) learn of a fence
        self.exits: set[int] = set()  # remote workers known to have exited
        self._locals: set[int] = set()  # node 0's workers, this process's children

    def adopted(self, wid: int, node: int, slot: int, now: float, pid: int | None = None,
                code: int | None = None) -> Worker:
        """A worker already running on a node, taken over from a lost coordinator."""
        w = Worker(wid=wid, proc=RemoteProc(self, node, wid, pid, code), slot=slot, started=now,
                   node=node)
        self.workers[wid] = w
        self.next_wid = max(self.next_wid, wid + 1)
        return w

    def resume_node(self, k: int, heard_at: float, next_cmd: int | None,
                    bell: int | None = None) -> None:
        """A node as a takeover found it: last heard of at `heard_at`, its agent's next
        command numbered `next_cmd` (None: it never answered, so it is silent), the ring of
        its group's bell it awaits `bell`."""
        self.nodes[k].beat_seen_at = heard_at
        if next_cmd is not None:
            self._cmds[k] = next_cmd
            self.bells.resumed(k, bell)
        else:  # the silent record written for it is no news: it stays heard of at heard_at
            self.nodes[k].seq = SILENT.seq

    def start(self, store) -> list[Worker]:
        """Every node's agent joins; then each active node K starts ranks K*P..K*P+P-1 in its
        slots 0..P-1 and its own spares after them, and each spare node P spares."""
        self.store, self.port = store, store.port
        self.wait_for_nodes(self.join_timeout_s)
        if self.local:
            self.forks_ready()
        per_node, out = self.per_node, []
        self.bells.open(store, self.nodes)  # where each group's rings stand: the agents read it
        with self.bells.held(store):  # one ring per group of nodes for all their spawns
            for node, n in self.nodes.items():
                for slot in range(n.procs):
                    active = not n.spare_node and slot < per_node
                    w = self.spawn_on(node, slot, spare=not active)
                    if active:
                        w.rank = node * per_node + slot
                        out.append(w)
        active_nodes = sum(1 for n in self.nodes.values() if not n.spare_node)
        self.log(f"[checkpointless] {active_nodes} node(s) x {per_node} workers "
                 f"(+{self.spares_per_node} spare(s) each) and "
                 f"{len(self.nodes) - active_nodes} spare node(s) started")
        return out

    def wait_for_nodes(self, timeout_s: float) -> None:
        """Every node's agent says hello, or the run stops naming the missing ones."""
        deadline, said = time.time() + timeout_s, time.time()
        keys = {k: protocol.node_hello_key(k) for k in self.nodes if self.remote(k)}
        while keys and not self.store.check(list(keys.values())):  # one call while waiting
            if time.time() > deadline or time.time() - said > 10:
                missing = [k for k, key in keys.items() if not self.store.check([key])]
                if time.time() > deadline:
                    raise RuntimeError(
                        f"node(s) {missing} never joined within {timeout_s:g} s: start "
                        "`python -m launcher train ...` with distributed.node_rank=K on each, "
                        "pointing at this node's master_addr:master_port")
                self.log(f"[checkpointless] waiting for node(s) {missing} to join")
                said = time.time()
            time.sleep(D.join_poll_s)
        now = time.time()
        for n in self.nodes.values():
            n.beat_seen_at = now

    def remote(self, node: int) -> bool:
        return node != 0 or not self.local

    def spawn(self, *args, **kwargs) -> Worker:
        w = super().spawn(*args, **kwargs)  # a local process: node 0's
        self._locals.add(w.wid)
        return w

    def maybe_exited(self, wids) -> list[int]:
        """Those of `wids` (in their order) that may have exited: node 0's, polled, and the
        remote ones whose exit a record brought. Looked at on every turn of the loop: one pass
        over every rank cost about 8 ms a turn at 16,384 ranks."""
        found = {w for w in self.exits if w in wids} | {w for w in self._locals if w in wids}
        return [w for w in wids if w in found] if found else []

    def _command(self, node: int, c: NodeCommand) -> None:
        """The node's next command, then its group's bell (its agent blocks on the bell: no
        polling)."""
        i = self._cmds.get(node, 0)
        self._cmds[node] = i + 1
        self.store.set(protocol.node_cmd_key(node, i), c.to_json())
        self.bells.command_written(self.store, node)

    def spawn_on(self, node: int, slot: int, spare: bool, background: bool = False) -> Worker:
        if not self.remote(node):
            return self.spawn(slot, background=background, spare=spare)
        wid = self.next_wid
        self.next_wid += 1
        self._command(node, NodeCommand(NodeOp.SPAWN, wid=wid, slot=slot, spare=spare))
        w = Worker(wid=wid, proc=RemoteProc(self, node, wid), slot=slot, started=time.time(),
                   node=node)
        self.workers[wid] = w
        return w

    def respawn(self, w: Worker) -> Worker | None:
        """A refill for a worker lost on a healthy node: same node, same slot, as a spare; none
        on a lost node (its spare node took the ranks)."""
        if self.nodes[w.node].lost:
            return None
        return self.spawn_on(w.node, w.slot, spare=True, background=True)

    def kill(self, w: Worker) -> None:
        node = w.node
        if not self.remote(node):
            return WorkerPool.kill(w)
        if not self.nodes[node].lost and w.proc.poll() is None:
            # the newest records first (a lost node's whole set of workers needs none: its
            # loss stands; reading every node's record per worker took 35 ms a worker at 512
            # nodes, on the decision's critical path)
            self.refresh(force=True)
        if self.nodes[node].lost or w.proc.poll() is not None:
            if w.proc.returncode is None:
                w.proc.returncode = -9
            return
        self._command(node, NodeCommand(NodeOp.KILL, wid=w.wid))
        try:
            w.proc.wait(timeout=self.node_timeout_s + 1)
        except subprocess.TimeoutExpired:  # the node went silent meanwhile: it will be fenced
            w.proc.returncode = -9

    def sleep(self, active, timeout_s: float) -> None:
        local = [wid for wid in active if wid in self._locals] if self.local else []
        if len(local) == len(active):
            return super().sleep(active, timeout_s)
        super().sleep(local, min(timeout_s, D.remote_poll_s))

    def refresh(self, force: bool = False) -> None:
        """Learn what the agents reported: one read of the event counter (an exit moves it), and
        every health_every_s, or when it moved, or `force`d, every live node's record in one
        call."""
        now = time.time()
        events = self.store.add(protocol.NODE_EVENTS, 0)
        if not force and events == self._events and now - self._health_at < D.health_every_s:
            return
        self._events, self._health_at = events, now
        live = [k for k, n in self.nodes.items() if self.remote(k) and not n.lost]
        if not live:
            return
        records = self.store.multi_get([protocol.node_health_key(k) for k in live])
        for k, raw in zip(live, records):
            n = self.nodes[k]
            # unchanged since the last read (the agent writes every node_beat_s or more; this
            # reads every health_every_s): nothing new, and its beats keep their times
            if raw != n.raw and is_record(raw):  # not replaced by this coordinator's word
                n.raw = raw
                self._read_health(k, NodeRecord.parse(raw), now)

    def _read_health(self, k: int, record: NodeRecord, now: float) -> None:
        n = self.nodes[k]
        if record.seq != n.seq:
            n.seq, n.beat_seen_at = record.seq, now
        # a heartbeat's age as the agent saw it, on the coordinator's clock
        n.beats = {int(w): {"t": now - b[1], "step": b[0], "gen": b[2], "phase": b[3],
                            "pace": b[4] if len(b) > 4 else []}
                   for w, b in record.beats.items()}
        n.stopped = frozenset(record.stopped)
        n.left = record.final
        for wid, code in record.exited.items():
            w = self.workers.get(int(wid))
            if w is not None and w.proc.returncode is None:
                w.proc.returncode = code

    def beats(self, wids) -> dict:
        """wid -> last heartbeat: node 0's read here, the others' from their nodes' records."""
        local = [w for w in wids if not self.remote(self.workers[w].node)]
        out = super().beats(local) if local else {}
        for w in wids:
            if w not in out:
                out[w] = self.nodes[self.workers[w].node].beats.get(w)
        return out

    def unheard(self, node: int) -> bool:
        """A remote node whose record has missed two of its writes: what its workers do is not
        known until it writes again, or is found lost (fence_silent_nodes, node_timeout_s)."""
        if not self.remote(node):
            return False
        from .agent import record_interval_s
        return time.time() - self.nodes[node].beat_seen_at > \
            2 * record_interval_s(self.node_timeout_s)

    def stopped(self, w: Worker) -> bool:
        if not self.remote(w.node):
            return super().stopped(w)
        return w.wid in self.nodes[w.node].stopped

    def fence_silent_nodes(self) -> list[int]:
        """Nodes whose health record has not changed for node_timeout_s: declared lost (once),
        fenced, and every worker on them counted as exited."""
        now, found = time.time(), []
        silent = [k for k, n in self.nodes.items() if self.remote(k) and not n.lost
                  and now - n.beat_seen_at > self.node_timeout_s]
        if silent and now - self._health_at > D.health_every_s:
            # this coordinator itself has not read the records for a while (a long start, a
            # stall): a node is silent only if its record has not moved when read now
            self.refresh(force=True)
        for k, n in self.nodes.items():
            if k not in silent or now - n.beat_seen_at <= self.node_timeout_s:
                continue
            self.log(f"[checkpointless] node {k} lost: its launcher has been silent for "
                     f"{self.node_timeout_s:g} s; its workers fail together and the node is "
                     "fenced")
            self.fence(k, f"silent for {now - n.beat_seen_at:.1f} s")
            for w in self.workers.values():
                if w.node == k and w.proc.returncode is None:
                    w.proc.returncode = -9
                    w.node_lost = True
                    w.lost_at = n.beat_seen_at  # its last sign of life
            found.append(k)
        return found

    def fence(self, k: int, why: str) -> None:
        """Node `k` takes no further part: lost to the spare choice, and its agent, told at its
        next record (the word replaces the record, and its write answers it), stops its
        processes."""
        self.nodes[k].lost = True
        word = str(NodeWord(Word.FENCED, why))
        self.store.set(protocol.node_health_key(k), word)
        self.on_fence(k, word)

    def lost_node_ids(self) -> set[int]:
        return {k for k, n in self.nodes.items() if n.lost}

    def spare_node_ids(self) -> set[int]:
        return {k for k, n in self.nodes.items() if n.spare_node}

    def spares(self, store, ready: bool) -> list[Worker]:
        return [w for w in super().spares(store, ready) if not self.nodes[w.node].lost]

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Node 0's processes here; every agent is told to stop its own, and its last health
        record (its exits, written as it leaves) is waited for, at most `grace_s`: an agent
        that finds the coordinator gone before it heard of the end would take it for lost."""
        live = [k for k, n in self.nodes.items() if self.remote(k) and not n.lost]
        why = getattr(self, "stop_why", None)  # a job that failed: its agents say why
        with self.bells.held(self.store):
            for k in live:
                if not self.nodes[k].left:  # a final record already read stays (its exits)
                    self.store.set(protocol.node_health_key(k),  # heard at its next record
                                   str(NodeWord(Word.STOPPED, why) if why else
                                       NodeWord(Word.SHUTDOWN)))
                self._command(k, NodeCommand(NodeOp.SHUTDOWN, why=why or None))
        stop_all([w for w in self.workers.values() if not self.remote(w.node)], grace_s)
        deadline = time.time() + grace_s
        while time.time() < deadline:
            self.refresh(force=True)
            if all(not w.alive() or self.nodes[w.node].lost for w in self.workers.values()) \
                    and all(self.nodes[k].left or self.nodes[k].lost for k in live):
                return
            time.sleep(D.shutdown_poll_s)


def pool_for(cfg, cmd: list[str], env: dict, log=print) -> WorkerPool:
    """The supervisor's pool for `cfg` (a SupervisorConfig): one machine's, or every node's."""
    if cfg.nodes > 1 or cfg.spare_nodes > 0 or cfg.standalone:
        return ClusterPool(cmd, env, cfg.host, cfg.refill_nice, nodes=cfg.nodes,
                           spare_nodes=cfg.spare_nodes, per_node=cfg.per_node,
                           spares_per_node=cfg.spares, node_timeout_s=cfg.node_timeout_s,
                           join_timeout_s=cfg.spare_wait_s, refill=cfg.refill, log=log,
                           local=not cfg.standalone)
    return WorkerPool(cmd, env, cfg.host, spares_from_slot=cfg.nproc, refill_nice=cfg.refill_nice,
                      spares_per_node=cfg.spares, refill=cfg.refill)
