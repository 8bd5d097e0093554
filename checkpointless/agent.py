"""A node agent: the launcher of a node that is not the coordinator's (cluster.py: the other side).

It starts the worker processes the coordinator asks for, watches them without polling (pidfds),
pushes their exits into one record of its node (protocol.node_exited_key, behind one counter), kills
on command, and beats. It stops its workers and exits when the job is over (0), when the
coordinator fenced this node (3: it was declared lost; its processes hold no rank in any newer
plan), or when the coordinator has been unreachable for `node_timeout_s` (4: losing the coordinator
cannot be recovered in-process). Workers die with their agent (PR_SET_PDEATHSIG), so a launcher
killed with SIGKILL leaves none.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta

from . import protocol
from .processes import (Worker, close_reaped, kill_tree, open_pidfd, start_process, stop_all,
                        wait_for_exit)

D = protocol.DEFAULTS


class NodeAgent:
    """Owns the worker processes of one node that is not the coordinator's."""

    def __init__(self, store, node: int, cmd: list[str], env: dict, store_host: str,
                 store_port: int, node_timeout_s: float, log=print):
        self.store, self.node, self.cmd, self.env = store, node, cmd, env
        self.host, self.port = store_host, store_port
        self.node_timeout_s = node_timeout_s
        self.log = log
        self.workers: dict[int, Worker] = {}
        self.exited: dict[int, int] = {}  # wid -> exit code, as pushed to the coordinator
        self.done_cmds = 0

    def run(self, procs_here: int) -> int:
        """Serve the coordinator until the job ends (0), this node is fenced (3) or the
        coordinator is unreachable (4)."""
        self.store.add(protocol.node_exits_key(self.node), 0)  # the coordinator reads it at once
        self.store.set(protocol.node_hello_key(self.node), json.dumps(
            {"host": os.uname().nodename, "procs": procs_here, "pid": os.getpid(),
             "t": time.time()}))
        asked: list[str] = []
        for sig in (signal.SIGTERM, signal.SIGINT):  # preemption: the coordinator stops the job
            signal.signal(sig, lambda s, _f: asked.append(signal.Signals(s).name))
        try:
            return self._serve(asked)
        finally:
            stop_all(list(self.workers.values()))
            try:  # the coordinator waits for these exits as the job ends
                self.push_exits()
            except (RuntimeError, OSError):
                pass

    def _serve(self, asked: list[str]) -> int:
        last_ok, next_beat = time.time(), 0.0
        while True:
            try:
                now = time.time()
                if now >= next_beat:
                    self.store.add(protocol.node_beat_key(self.node), 1)
                    next_beat = now + D.node_beat_s
                fenced = protocol.node_fenced_key(self.node)
                if self.store.check([fenced]):
                    self.log(f"[node {self.node}] fenced by the coordinator "
                             f"({self.store.get(fenced).decode()}): stopping this node's workers")
                    return 3
                if self.store.check([protocol.SHUTDOWN]):
                    return 0
                if asked:
                    self.store.set(protocol.PREEMPT_ASK, f"{asked[0]} on node {self.node}")
                    asked.clear()
                self.serve_commands()
                self.push_exits()
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
            close_reaped(self.workers.values())
            wait_for_exit(list(self.workers.values()), D.agent_poll_s)

    def serve_commands(self) -> None:
        n = self.store.add(protocol.node_cmds_key(self.node), 0)
        while self.done_cmds < n:
            c = json.loads(self.store.get(protocol.node_cmd_key(self.node, self.done_cmds)))
            self.done_cmds += 1
            if c["op"] == "spawn":
                self._spawn(c["wid"], c["slot"], c["spare"])
            elif c["op"] == "kill" and c["wid"] in self.workers:
                kill_tree(self.workers[c["wid"]].proc)

    def _spawn(self, wid: int, slot: int, spare: bool) -> None:
        env = dict(self.env, **protocol.worker_env(self.host, self.port, wid, slot, spare))
        proc = start_process(self.cmd, env)
        self.workers[wid] = Worker(wid=wid, proc=proc, slot=slot, started=time.time(),
                                   node=self.node, pidfd=open_pidfd(proc.pid))
        self.store.set(protocol.node_pid_key(self.node, wid), str(proc.pid))

    def push_exits(self) -> None:
        """Children that exited since the last call go into this node's record, then its
        counter moves: two store writes per batch of exits, none while nothing exits."""
        new = {wid: w.proc.returncode for wid, w in self.workers.items()
               if wid not in self.exited and w.proc.poll() is not None}
        if not new:
            return
        self.exited.update(new)
        self.store.set(protocol.node_exited_key(self.node),
                       json.dumps({str(k): v for k, v in self.exited.items()}))
        self.store.add(protocol.node_exits_key(self.node), len(new))


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
    store.set_timeout(timedelta(seconds=max(2.0, node_timeout_s)))
    agent = NodeAgent(store, node, cmd, dict(os.environ), host, port, node_timeout_s,
                      log=lambda m: print(m, file=sys.stderr, flush=True))
    return agent.run(procs_here)
