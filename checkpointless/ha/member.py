"""One member of an embedded etcd cluster, started and stopped by the launcher that owns it.

The binary is the `etcd` of Debian's `etcd-server` package (etcd 3.4), found on PATH or named by
`CHECKPOINTLESS_ETCD`: a maintained build from the distribution the project's CI already uses. The
PyPI packages that carry an etcd binary are repackagings by individuals, without releases that
follow etcd's own.

A member listens for clients on `client_port` and for its peers on `peer_port` (etcd's registered
ports are 2379 and 2380), keeps its data under `data_dir` (the run's output folder, so that nothing
is left elsewhere), and dies with the process that started it (PR_SET_PDEATHSIG), as the workers
do: a launcher killed with SIGKILL leaves no member behind.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass

from ..protocol import keys
from .etcd import Etcd
from ..control.spawn import die_with_parent

CLIENT_PORT, PEER_PORT = 2379, 2380


def binary() -> str | None:
    """The etcd binary to run, or None when there is none."""
    return os.environ.get(keys.ENV_ETCD) or shutil.which("etcd")


@dataclass
class MemberSpec:
    name: str
    host: str
    client_port: int = CLIENT_PORT
    peer_port: int = PEER_PORT

    @property
    def listen_host(self) -> str:
        """etcd listens on addresses only: a host name is looked up here."""
        import socket
        return socket.gethostbyname(self.host)

    @property
    def client_url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"


def initial_cluster(members: list[MemberSpec]) -> str:
    return ",".join(f"{m.name}={m.peer_url}" for m in members)


def command(me: MemberSpec, members: list[MemberSpec], data_dir: str, token: str) -> list[str]:
    """etcd's command line for member `me` of a new cluster of `members`. Timing: a heartbeat
    every 100 ms and an election after 1 s of silence (etcd's defaults), so a lost etcd leader
    is replaced well within a role's lease."""
    exe = binary()
    if exe is None:
        raise FileNotFoundError("no etcd binary: install Debian's etcd-server package "
                                "(apt-get install etcd-server) or set CHECKPOINTLESS_ETCD")
    ip = me.listen_host
    return [exe, "--name", me.name, "--data-dir", data_dir,
            "--listen-client-urls", f"http://{ip}:{me.client_port}",
            "--advertise-client-urls", me.client_url,
            "--listen-peer-urls", f"http://{ip}:{me.peer_port}",
            "--initial-advertise-peer-urls", me.peer_url,
            "--initial-cluster", initial_cluster(members), "--initial-cluster-state", "new",
            "--initial-cluster-token", token, "--heartbeat-interval", "100",
            "--election-timeout", "1000", "--logger", "zap", "--log-level", "error",
            # the coordinator rewrites the run's record (control/ledger.py) up to once a
            # second: old revisions are dropped, or etcd's history would grow all run long
            "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "10m"]


def start(me: MemberSpec, members: list[MemberSpec], data_dir: str, token: str,
          log_path: str | None = None) -> subprocess.Popen:
    """Start member `me`; it dies with the calling process."""
    os.makedirs(data_dir, exist_ok=True)
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        return subprocess.Popen(command(me, members, data_dir, token), stdout=out,
                                stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    finally:
        if log_path:
            out.close()


def wait_healthy(endpoints: list[str], timeout_s: float = 30.0) -> None:
    """Until a quorum answers a read, or TimeoutError."""
    client = Etcd(endpoints, timeout_s=1.0)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if client.healthy():
            return
        time.sleep(keys.DEFAULTS.join_poll_s)
    raise TimeoutError(f"etcd at {', '.join(endpoints)} had no quorum after {timeout_s:g} s")


class Kept:
    """A member started again on its own data whenever it stops while its launcher runs.

    Under Slurm a preemption's SIGTERM reaches every process of the job step, the members
    too, and etcd stops on it whatever disposition it was started with (it installs its own
    handler). All three at once would take the quorum away just as the job stops in order at
    a step boundary, which needs etcd for the coordinator's lease and its last writes. A member
    started again on its data rejoins the same cluster within a second or two, inside the
    role's lease. Answers poll/kill/wait as the Popen of the member it runs now."""

    def __init__(self, start, log=print, tries: int = 5):
        self._start, self.log, self.tries = start, log, tries
        self._lock, self._stopping = threading.Lock(), threading.Event()
        self.proc = start()
        self.restarts = 0
        threading.Thread(target=self._keep, daemon=True, name="etcd-member").start()

    def _keep(self) -> None:
        while not self._stopping.wait(keys.DEFAULTS.join_poll_s):
            with self._lock:
                code = self.proc.poll()
                if code is None or self._stopping.is_set() or self.restarts >= self.tries:
                    continue
                self.restarts += 1
                self.log(f"[etcd] the member stopped (exit {code}); starting it again on its "
                         f"data ({self.restarts} of {self.tries})")
                self.proc = self._start()

    def poll(self):
        return self.proc.poll()

    def kill(self) -> None:
        self._stopping.set()
        with self._lock:
            self.proc.kill()

    def wait(self, timeout=None):
        return self.proc.wait(timeout)
