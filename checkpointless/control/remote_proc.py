"""A worker process on another node, as the coordinator sees it (cluster.py): Popen's surface,
fed by its node's records."""
from __future__ import annotations

import subprocess
import time

from .. import protocol

D = protocol.DEFAULTS


class RemoteProc:
    """A worker process on another node, seen through its agent's exit notices (Popen's
    interface as far as the supervisor uses it). Its exit code is what the pool last read from
    the node's record (`pool`: the ClusterPool, whose refresh reads it)."""

    def __init__(self, pool, node: int, wid: int, pid: int | None = None,
                 code: int | None = None):
        self.pool, self.node, self.wid = pool, node, wid
        self.returncode = code
        self._pid: int | None = pid

    @property
    def returncode(self) -> int | None:
        return self._code

    @returncode.setter
    def returncode(self, code: int | None) -> None:
        self._code = code
        if code is not None:  # the pool's loop looks at these workers, not at every rank
            self.pool.exits.add(self.wid)

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
            self.pool.refresh(force=True)
            if self.returncode is not None:
                return self.returncode
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(f"worker {self.wid}", timeout)
            time.sleep(D.exit_poll_s)
