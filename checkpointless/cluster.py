"""Many machines, the coordinator's side: one launcher per node, whole nodes lost and replaced.

The coordinator (the supervisor, in node 0's launcher or stand-alone) owns the store and the
membership, as on one machine. Every other node runs an agent (agent.py) that starts and kills
the workers the coordinator asks for; the keys they share are in protocol.py. The coordinator's
load grows with nodes, not ranks: per node, one beat counter and one exit counter (the workers'
training heartbeats are read only to tell a hung worker, as on one machine).

A node is lost when its beat counter has not moved for `node_timeout_s` (its launcher is gone, the
machine is down, or the link is cut): every worker on it is failed together, in one generation,
and the node is fenced. A fenced node that comes back finds the fence and kills its processes;
they hold no rank in any newer plan, so nothing they do reaches the new generation.
"""
from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass

from . import protocol
from .processes import Worker, WorkerPool, stop_all

D = protocol.DEFAULTS


class RemoteProc:
    """A worker process on another node, seen through its agent's exit notices (Popen's
    interface as far as the supervisor uses it). Its exit code is what the pool last read from
    the node's record (ClusterPool.refresh)."""

    def __init__(self, pool: "ClusterPool", node: int, wid: int):
        self.pool, self.node, self.wid = pool, node, wid
        self.returncode: int | None = None
        self._pid: int | None = None

    @property
    def pid(self) -> int:
        key = protocol.node_pid_key(self.node, self.wid)
        if self._pid is None and self.pool.store.check([key]):
            self._pid = int(self.pool.store.get(key))
        return self._pid if self._pid is not None else -1

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.time() + timeout
        while True:
            self.pool.refresh_node(self.node)
            if self.returncode is not None:
                return self.returncode
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.wid}", timeout)
            time.sleep(0.02)


@dataclass
class NodeState:
    procs: int  # processes this node runs (workers + spares)
    spare_node: bool
    beat: int = 0
    beat_seen_at: float = 0.0
    lost: bool = False
    exits: int = 0  # the node's exit counter when its record was last read


class ClusterPool(WorkerPool):
    """The supervisor's workers over every node: node 0's are local processes (WorkerPool's own),
    the others' are started and killed through their nodes' agents. Worker ids are global."""

    def __init__(self, cmd, env, host, refill_nice, *, nodes: int, spare_nodes: int,
                 per_node: int, spares_per_node: int, node_timeout_s: float,
                 join_timeout_s: float = D.spare_wait_s, refill: bool = D.refill, log=print,
                 local: bool = True):
        super().__init__(cmd, env, host, per_node, refill_nice, spares_per_node, refill)
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

    def start(self, store) -> list[Worker]:
        """Every node's agent joins; then each active node K starts ranks K*P..K*P+P-1 in its
        slots 0..P-1 and its own spares after them, and each spare node P spares."""
        self.store, self.port = store, store.port
        self.wait_for_nodes(self.join_timeout_s)
        per_node, out = self.per_node, []
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
        deadline, said = time.time() + timeout_s, 0.0
        while True:
            missing = [k for k in self.nodes if self.remote(k) and
                       not self.store.check([protocol.node_hello_key(k)])]
            if not missing:
                break
            if time.time() > deadline:
                raise RuntimeError(f"node(s) {missing} never joined within {timeout_s:g} s: start "
                                   "`python -m launcher train ...` with distributed.node_rank=K "
                                   "on each, pointing at this node's master_addr:master_port")
            if time.time() - said > 10:
                self.log(f"[checkpointless] waiting for node(s) {missing} to join")
                said = time.time()
            time.sleep(0.1)
        now = time.time()
        for n in self.nodes.values():
            n.beat_seen_at = now

    def remote(self, node: int) -> bool:
        return node != 0 or not self.local

    def local_pid(self, w: Worker) -> int:
        return -1 if self.remote(w.node) else w.proc.pid

    def _command(self, node: int, **c) -> None:
        i = self._cmds.get(node, 0)
        self._cmds[node] = i + 1
        self.store.set(protocol.node_cmd_key(node, i), json.dumps(c))
        self.store.add(protocol.node_cmds_key(node), 1)

    def spawn_on(self, node: int, slot: int, spare: bool, background: bool = False) -> Worker:
        if not self.remote(node):
            return self.spawn(slot, background=background, spare=spare)
        wid = self._next_wid
        self._next_wid += 1
        self._command(node, op="spawn", wid=wid, slot=slot, spare=spare)
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
        self.refresh_node(node)
        if self.nodes[node].lost or w.proc.poll() is not None:
            if w.proc.returncode is None:
                w.proc.returncode = -9
            return
        self._command(node, op="kill", wid=w.wid)
        try:
            w.proc.wait(timeout=self.node_timeout_s + 1)
        except subprocess.TimeoutExpired:  # the node went silent meanwhile: it will be fenced
            w.proc.returncode = -9

    def sleep(self, active, timeout_s: float) -> None:
        local = [wid for wid in active if not self.remote(self.workers[wid].node)]
        if len(local) == len(active):
            return super().sleep(active, timeout_s)
        super().sleep(local, min(timeout_s, D.remote_poll_s))

    def refresh(self) -> None:
        """Read every live remote node's exit counter (one store operation each), and its
        record of exits when the counter moved."""
        for k in self.nodes:
            self.refresh_node(k)

    def refresh_node(self, k: int) -> None:
        """Node k's exit notices: its counter, and its record when the counter moved."""
        n = self.nodes[k]
        if not self.remote(k) or n.lost:
            return
        exits = self.store.add(protocol.node_exits_key(k), 0)
        if exits != n.exits:
            n.exits = exits
            record = json.loads(self.store.get(protocol.node_exited_key(k)))
            for wid, code in record.items():
                w = self.workers.get(int(wid))
                if w is not None and w.proc.returncode is None:
                    w.proc.returncode = code

    def fence_silent_nodes(self) -> list[int]:
        """Nodes whose agent's beat has not moved for node_timeout_s: declared lost (once),
        fenced, and every worker on them counted as exited."""
        now, found = time.time(), []
        for k, n in self.nodes.items():
            if not self.remote(k) or n.lost:
                continue
            beat = self.store.add(protocol.node_beat_key(k), 0)
            if beat != n.beat:
                n.beat, n.beat_seen_at = beat, now
            elif now - n.beat_seen_at > self.node_timeout_s:
                n.lost = True
                self.log(f"[checkpointless] node {k} lost: its launcher has been silent for "
                         f"{self.node_timeout_s:g} s; its workers fail together and the node is "
                         "fenced")
                self.store.set(protocol.node_fenced_key(k),
                               f"silent for {now - n.beat_seen_at:.1f} s")
                for w in self.workers.values():
                    if w.node == k and w.proc.returncode is None:
                        w.proc.returncode = -9
                        w.node_lost = True
                        w.lost_at = n.beat_seen_at  # its last sign of life
                found.append(k)
        return found

    def lost_node_ids(self) -> set[int]:
        return {k for k, n in self.nodes.items() if n.lost}

    def spare_node_ids(self) -> set[int]:
        return {k for k, n in self.nodes.items() if n.spare_node}

    def spares(self, store, ready: bool) -> list[Worker]:
        return [w for w in super().spares(store, ready) if not self.nodes[w.node].lost]

    def stop_all(self, grace_s: float = 10.0) -> None:
        """Node 0's processes here; the agents stop theirs on `shutdown` and push their exits,
        which are waited for (at most `grace_s`)."""
        stop_all([w for w in self.workers.values() if not self.remote(w.node)], grace_s)
        deadline = time.time() + grace_s
        while time.time() < deadline:
            self.refresh()
            if all(not w.alive() or self.nodes[w.node].lost for w in self.workers.values()):
                return
            time.sleep(0.05)


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
