"""Many machines: one launcher per node, the coordinator on node 0, whole nodes lost and replaced.

The coordinator (the supervisor, in node 0's launcher) owns the store and the membership, as on one
machine. Every other node runs a NodeAgent: it starts the worker processes the coordinator asks
for, watches them without polling (pidfds), reports their exits, kills on command, and beats. The
coordinator's load grows with nodes, not ranks: one heartbeat counter per node (the workers'
training heartbeats are read only to tell a hung worker, as on one machine).

    coordinator (node 0)                           agent (node k)
    --------------------                           --------------
                                              <--- node/k/hello   {host, procs, pid}
    node/k/cmds (counter), node/k/cmd/<i>      ---> spawn {wid, slot, spare} | kill {wid}
                                              <--- node/k/pid/<wid>, node/k/exit/<wid>
                                              <--- node/k/beat    (counter, every beat_s)
    node/k/fenced  (the node was declared lost) ---> kill every local worker, exit
    shutdown                                   ---> stop every local worker, exit 0

A node is lost when its beat counter has not moved for `node_timeout_s` (its launcher is gone, the
machine is down, or the link is cut): every worker on it is failed together, in one generation,
and the node is fenced. A fenced node that comes back finds the fence and kills its processes;
they hold no rank in any newer plan, so nothing they do reaches the new generation. An agent that
cannot reach the coordinator for `node_timeout_s` stops its workers and exits non-zero: losing
the coordinator cannot be recovered in-process (resume from the newest durable checkpoint).
Workers die with their agent (PR_SET_PDEATHSIG), so a launcher killed with SIGKILL leaves none.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from . import protocol
from .processes import Worker, WorkerPool, die_with_parent

BEAT_S = 0.5


def hello_key(node: int) -> str:
    return f"node/{node}/hello"


def beat_key(node: int) -> str:
    return f"node/{node}/beat"


def cmds_key(node: int) -> str:
    return f"node/{node}/cmds"


def cmd_key(node: int, i: int) -> str:
    return f"node/{node}/cmd/{i}"


def pid_key(node: int, wid: int) -> str:
    return f"node/{node}/pid/{wid}"


def exit_key(node: int, wid: int) -> str:
    return f"node/{node}/exit/{wid}"


def fenced_key(node: int) -> str:
    return f"node/{node}/fenced"


# ---- the agent side ------------------------------------------------------------------------
class NodeAgent:
    """Owns the worker processes of one node that is not the coordinator's."""

    def __init__(self, store, node: int, cmd: list[str], env: dict, store_host: str,
                 store_port: int, node_timeout_s: float, log=print):
        self.store, self.node, self.cmd, self.env = store, node, cmd, env
        self.host, self.port = store_host, store_port
        self.node_timeout_s = node_timeout_s
        self.log = log
        self.procs: dict[int, subprocess.Popen] = {}
        self.reported: set[int] = set()
        self.done_cmds = 0

    def run(self, procs_here: int) -> int:
        """Serve the coordinator until the job ends (0), this node is fenced (3) or the
        coordinator is unreachable (4)."""
        self.store.set(hello_key(self.node), json.dumps(
            {"host": os.uname().nodename, "procs": procs_here, "pid": os.getpid(),
             "t": time.time()}))
        last_ok = time.time()
        next_beat = 0.0
        asked: list[str] = []
        for sig in (signal.SIGTERM, signal.SIGINT):  # preemption: the coordinator stops the job
            signal.signal(sig, lambda s, _f: asked.append(signal.Signals(s).name))
        try:
            while True:
                try:
                    now = time.time()
                    if now >= next_beat:
                        self.store.add(beat_key(self.node), 1)
                        next_beat = now + BEAT_S
                    if self.store.check([fenced_key(self.node)]):
                        self.log(f"[node {self.node}] fenced by the coordinator "
                                 f"({self.store.get(fenced_key(self.node)).decode()}): stopping "
                                 "this node's workers")
                        return 3
                    if self.store.check([protocol.SHUTDOWN]):
                        return 0
                    if asked:
                        self.store.set(protocol.PREEMPT_ASK, f"{asked[0]} on node {self.node}")
                        asked.clear()
                    self._serve_commands()
                    self._report_exits()
                    last_ok = time.time()
                except (RuntimeError, OSError) as exc:  # the store (the coordinator) is gone
                    if time.time() - last_ok > self.node_timeout_s:
                        self.log(f"[node {self.node}] the coordinator has been unreachable for "
                                 f"{self.node_timeout_s:g} s ({type(exc).__name__}); stopping "
                                 "this node's workers. Losing the coordinator cannot be "
                                 "recovered in-process: resume from the newest durable "
                                 "checkpoint (checkpoint.resume=auto)")
                        return 4
                    time.sleep(0.2)
                    continue
                self._sleep(0.1)
        finally:
            self.stop_all()

    def _serve_commands(self) -> None:
        n = self.store.add(cmds_key(self.node), 0)
        while self.done_cmds < n:
            c = json.loads(self.store.get(cmd_key(self.node, self.done_cmds)))
            self.done_cmds += 1
            if c["op"] == "spawn":
                self._spawn(c["wid"], c["slot"], c["spare"])
            elif c["op"] == "kill" and c["wid"] in self.procs:
                _kill_tree(self.procs[c["wid"]])

    def _spawn(self, wid: int, slot: int, spare: bool) -> None:
        env = dict(self.env, **protocol.worker_env(self.host, self.port, wid, slot, spare))

        def setup():
            os.setpgid(0, 0)
            die_with_parent()

        p = subprocess.Popen(self.cmd, env=env, preexec_fn=setup)
        self.procs[wid] = p
        self.store.set(pid_key(self.node, wid), str(p.pid))

    def _report_exits(self) -> None:
        for wid, p in self.procs.items():
            if wid not in self.reported and p.poll() is not None:
                self.reported.add(wid)
                self.store.set(exit_key(self.node, wid), str(p.returncode))

    def _sleep(self, timeout_s: float) -> None:
        fds = []
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    fds.append(os.pidfd_open(p.pid))
                except (AttributeError, OSError):
                    pass
        try:
            if fds:
                poller = select.poll()
                for fd in fds:
                    poller.register(fd, select.POLLIN)
                poller.poll(timeout_s * 1000)
            else:
                time.sleep(timeout_s)
        finally:
            for fd in fds:
                os.close(fd)

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                _kill_tree(p, signal.SIGTERM)
        deadline = time.time() + 10
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                _kill_tree(p)


def _kill_tree(p: subprocess.Popen, sig=signal.SIGKILL) -> None:
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            p.send_signal(sig)
        except ProcessLookupError:
            pass


# ---- the coordinator side ------------------------------------------------------------------
class RemoteProc:
    """A worker process on another node, seen through its agent's reports (Popen's interface as
    far as the supervisor uses it)."""

    def __init__(self, pool: "ClusterPool", node: int, wid: int):
        self.pool, self.node, self.wid = pool, node, wid
        self.returncode: int | None = None
        self._pid: int | None = None

    @property
    def pid(self) -> int:
        if self._pid is None and self.pool.store.check([pid_key(self.node, self.wid)]):
            self._pid = int(self.pool.store.get(pid_key(self.node, self.wid)))
        return self._pid if self._pid is not None else -1

    def poll(self):
        if self.returncode is None:
            key = exit_key(self.node, self.wid)
            if self.pool.store.check([key]):
                self.returncode = int(self.pool.store.get(key))
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.wid}", timeout)
            time.sleep(0.02)
        return self.returncode


@dataclass
class NodeState:
    procs: int  # processes this node runs (workers + spares)
    spare_node: bool
    beat: int = 0
    beat_seen_at: float = 0.0
    lost: bool = False


class ClusterPool(WorkerPool):
    """The supervisor's workers over every node: node 0's are local processes (WorkerPool's own),
    the others' are started and killed through their nodes' agents. Worker ids are global."""

    def __init__(self, cmd, env, host, spares_from_slot, refill_nice, nodes: int,
                 spare_nodes: int, per_node: int, spares_per_node: int, node_timeout_s: float,
                 log=print, local: bool = True):
        super().__init__(cmd, env, host, spares_from_slot, refill_nice)
        # local: node 0 is this process's own machine (the coordinator runs in node 0's
        # launcher); else every node, 0 included, is served by an agent (a stand-alone
        # coordinator on a login node)
        self.local = local
        self.store = None
        self.per_node, self.spares_per_node = per_node, spares_per_node
        self.node_timeout_s = node_timeout_s
        self.log = log
        self.nodes = {k: NodeState(per_node + spares_per_node, False) for k in range(nodes)}
        for k in range(nodes, nodes + spare_nodes):
            self.nodes[k] = NodeState(per_node, True)
        self._cmds: dict[int, int] = {}

    def wait_for_nodes(self, timeout_s: float) -> None:
        """Every node's agent says hello, or the run stops naming the missing ones."""
        deadline, said = time.time() + timeout_s, 0.0
        while True:
            missing = [k for k in self.nodes if self.remote(k) and
                       not self.store.check([hello_key(k)])]
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
        for k, n in self.nodes.items():
            n.beat_seen_at = now

    def remote(self, node: int) -> bool:
        return node != 0 or not self.local

    def spawn_on(self, node: int, slot: int, spare: bool, background: bool = False) -> Worker:
        if not self.remote(node):
            return self.spawn(slot, background=background, spare=spare)
        wid = self._next_wid
        self._next_wid += 1
        i = self._cmds.get(node, 0)
        self._cmds[node] = i + 1
        self.store.set(cmd_key(node, i), json.dumps(
            {"op": "spawn", "wid": wid, "slot": slot, "spare": spare}))
        self.store.add(cmds_key(node), 1)
        w = Worker(wid=wid, proc=RemoteProc(self, node, wid), slot=slot, started=time.time(),
                   node=node)
        self.workers[wid] = w
        return w

    def respawn(self, w: Worker) -> Worker:
        """A refill for a worker lost on a healthy node: same node, same slot, as a spare; none
        on a lost node (its spare node took the ranks)."""
        node = w.node
        if self.nodes[node].lost:
            return None
        return self.spawn_on(node, w.slot, spare=True, background=True)

    def kill(self, w: Worker) -> None:
        node = w.node
        if not self.remote(node):
            return WorkerPool.kill(w)
        if self.nodes[node].lost or w.proc.poll() is not None:
            if w.proc.returncode is None:
                w.proc.returncode = -9
            return
        i = self._cmds.get(node, 0)
        self._cmds[node] = i + 1
        self.store.set(cmd_key(node, i), json.dumps({"op": "kill", "wid": w.wid}))
        self.store.add(cmds_key(node), 1)
        try:
            w.proc.wait(timeout=self.node_timeout_s + 1)
        except subprocess.TimeoutExpired:  # the node went silent meanwhile: it will be fenced
            w.proc.returncode = -9

    def sleep(self, active, timeout_s: float) -> None:
        local = [wid for wid in active if not self.remote(self.workers[wid].node)]
        if len(local) == len(active):
            return super().sleep(active, timeout_s)
        super().sleep(local, min(timeout_s, 0.05))

    def lost_nodes(self) -> list[int]:
        """Nodes whose agent's beat has not moved for node_timeout_s: declared lost (once),
        fenced, and every worker on them counted as exited."""
        now, found = time.time(), []
        for k, n in self.nodes.items():
            if not self.remote(k) or n.lost:
                continue
            beat = self.store.add(beat_key(k), 0)
            if beat != n.beat:
                n.beat, n.beat_seen_at = beat, now
            elif now - n.beat_seen_at > self.node_timeout_s:
                n.lost = True
                self.store.set(fenced_key(k), f"silent for {now - n.beat_seen_at:.1f} s")
                for w in self.workers.values():
                    if w.node == k and w.proc.returncode is None:
                        w.proc.returncode = -9
                        w.node_lost = True
                        w.lost_at = n.beat_seen_at  # its last sign of life
                found.append(k)
        return found

    def spares(self, store, ready: bool) -> list[Worker]:
        return [w for w in super().spares(store, ready)
                if not self.nodes[w.node].lost]

    def choose_spares(self, store, failed: list[tuple[int, int]]) -> list[Worker] | None:
        """Ready spares for the failed (node, slot) pairs, or None when too few are ready.

        A whole node's ranks go together to one ready spare node, each to the same local slot
        (device); a process lost on a healthy node goes to a spare on that node when there is
        one, else to any."""
        ready = self.spares(store, ready=True)
        chosen: list[Worker | None] = [None] * len(failed)
        by_node: dict[int, list[int]] = {}
        for i, (node, _) in enumerate(failed):
            by_node.setdefault(node, []).append(i)
        used: set[int] = set()
        for node, idx in by_node.items():
            if not self.nodes[node].lost:
                continue
            for k, n in self.nodes.items():
                here = {w.slot: w for w in ready if w.node == k
                        and w.wid not in used}
                if n.spare_node and all(failed[i][1] in here for i in idx):
                    for i in idx:
                        chosen[i] = here[failed[i][1]]
                        used.add(chosen[i].wid)
                    break
        for i, (node, _) in enumerate(failed):
            if chosen[i] is not None:
                continue
            same = [w for w in ready if w.node == node and w.wid not in used]
            others = [w for w in ready if w.wid not in used and not self.nodes[node].lost]
            pick = (same or others or [w for w in ready if w.wid not in used] or [None])[0]
            if pick is None:
                return None
            chosen[i] = pick
            used.add(pick.wid)
        return chosen

    def stop_all(self) -> None:
        super().stop_all()  # node 0's processes; the agents stop theirs on `shutdown`


def run_agent(node: int, cmd: list[str], host: str, port: int, node_timeout_s: float,
              procs_here: int, connect_timeout_s: float = 300.0) -> int:
    """A node's launcher when it is not the coordinator: connect, serve, return an exit code."""
    from .membership import connect
    try:
        store = connect(host, port, timeout_s=connect_timeout_s)
    except Exception as exc:  # noqa: BLE001
        print(f"[node {node}] cannot reach the coordinator at {host}:{port}: {exc}",
              file=sys.stderr, flush=True)
        return 4
    store.set_timeout(__import__("datetime").timedelta(seconds=max(2.0, node_timeout_s)))
    agent = NodeAgent(store, node, cmd, dict(os.environ), host, port, node_timeout_s,
                      log=lambda m: print(m, file=sys.stderr, flush=True))
    return agent.run(procs_here)
