"""Workers forked from a process that has already imported what they need.

A worker of the training loop spends most of its start importing torch, accelerate and the
model's transformers classes (about 6 s of one core each here). Started side by side on a small
machine, four workers and a spare queue for the cores for 15 s before any of them builds a model;
a refill started during a recovery takes cores from it for as long.

So where the launcher sets CHECKPOINTLESS_FORKSERVER=MODULE:FUNCTION, the workers' command
`python -m MODULE ARGS` is not exec'd: a node starts one server (`fork_serving.main`) with the
workers' environment, which imports MODULE and calls FUNCTION(ARGS) once, then waits for
requests on its stdin. The launcher starts it early (`processes.warm_server`) and waits for it
where waiting costs nothing; a worker asked for while it still preloads starts as a fresh
process instead, so no caller blocks on it. For each, it forks: the child sets the worker's
environment, its process group and death signal, and runs MODULE as `python -m MODULE ARGS`
would. The server is the child's parent: it reaps it and reports its exit code on a pipe,
which `Forked` (a stand-in for Popen) reads. This file is the launcher's side; the server's own process, and the child's turn into the
worker, are fork_serving.py's.

What a fork keeps from the server and a fresh process would not have:
- /proc/PID/cmdline and environ show the server's (the kernel keeps those of the last exec):
  each worker is named `cl-worker-<id>` instead (ps, /proc/PID/comm);
- the server's environment, read by the imports: a request whose environment differs from the
  server's in anything but the per-worker keys gets a server of its own (`ForkServers.start`);
- Python's `random` and numpy's global state: reseeded from the OS in the child, as at a start;
- the server's threads do not come along (a fork keeps only the calling thread), and it runs no
  torch operation, so no thread pool needs rebuilding.
CHECKPOINTLESS_FORKSERVER=0 starts every worker as a fresh process instead.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from ..protocol.keys import ENV_PRELOAD, with_worker_defaults  # noqa: F401  (read as before)
# the server's side, importable from here as before
from .fork_serving import preload_spec
from .spawn import die_with_parent


def forkable(cmd: list[str], env: dict) -> bool:
    """`python -m MODULE ...` of this interpreter where MODULE is the one the launcher named:
    anything else is started as it is. Opt-in only: a server imports MODULE, and a script
    without a main guard would run there."""
    spec = preload_spec(env)
    return (spec is not None and len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] == "-m"
            and cmd[2] == spec[0] and not gpu_host())


def gpu_host() -> bool:
    """An NVIDIA or AMD GPU's device files exist here. No fork server there, for now: CUDA
    cannot be used in a child forked after it was initialized, and a library that asks
    torch.cuda.is_available() while imported initializes it (the default check calls the
    runtime). Not yet checked on a GPU host (none was lent to this project's sessions)."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")


# ---- the launcher's side ----------------------------------------------------------------------
class Forked:
    """A worker forked by a server; answers like the subprocess.Popen the supervisor expects."""

    def __init__(self, pid: int, server: "_Server"):
        self.pid, self._server = pid, server
        self.returncode: int | None = None
        self._gone_since: float | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.codes.get(self.pid)
        if self.returncode is None and self._unreported_exit():
            self.returncode = -signal.SIGKILL
        return self.returncode

    def _unreported_exit(self) -> bool:
        """The process has exited (a zombie, or reaped) and the server has not said so within
        REPORT_GRACE_S. Its report comes a moment after the exit; one that never comes (a
        server stopped, a report lost) must not leave a dead worker counted alive: its peers
        would wait on it for ever. Its code is unknown then: counted as a SIGKILL."""
        if not _exited(self.pid):
            self._gone_since = None
            return False
        now = time.monotonic()
        self._gone_since = self._gone_since or now
        if now - self._gone_since < REPORT_GRACE_S:
            return False
        print(f"[checkpointless] worker {self.pid} exited and its fork server did not report it "
              f"in {REPORT_GRACE_S:.0f} s; counted as killed", file=sys.stderr, flush=True)
        return True

    def wait(self, timeout: float | None = None) -> int:
        with self._server.changed:
            if not self._server.changed.wait_for(lambda: self.poll() is not None, timeout):
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


REPORT_GRACE_S = 3.0


def _exited(pid: int) -> bool:
    """`pid` is a zombie or no longer exists."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    except OSError:
        return False


_SERVER_MAIN = "from checkpointless.control.fork_serving import main; main()"


class _Server:
    """One server process and the thread that reads its reports."""

    def __init__(self, module: str, env: dict, args: list[str]):
        r, w = os.pipe()
        # -c, not -m: the package's import already imports this module (runpy would warn)
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER_MAIN, module, str(w), *args],
                                     env=env, stdin=subprocess.PIPE, pass_fds=(w,),
                                     preexec_fn=_own_group_dying_with_parent)
        os.close(w)
        self.reports = os.fdopen(r, "r")
        self.codes: dict[int, int] = {}
        self.ready = threading.Event()  # its preload is done: a fork now takes milliseconds
        self.changed = threading.Condition()
        self._pids: list[int] = []  # forked, not yet handed out
        self._forked: set[int] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True, name="forkserver-reports").start()

    def fork(self, args: list[str], env: dict, nice: int, ignore_term: bool,
             name: str = "") -> Forked:
        with self._lock:
            request = {"args": args, "env": env, "nice": nice, "ignore_term": ignore_term,
                       "name": name}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            with self.changed:
                if not self.changed.wait_for(lambda: self._pids or self.proc.poll() is not None,
                                             60):
                    raise RuntimeError("the fork server did not answer in 60 s")
                if not self._pids:
                    raise RuntimeError(f"the fork server exited (code {self.proc.poll()})")
                return Forked(self._pids.pop(0), self)

    def _read(self) -> None:
        for line in self.reports:
            try:
                msg = json.loads(line)
            except ValueError:  # never expected: said, and the reports go on being read
                print(f"[checkpointless] fork server: unreadable report {line!r}",
                      file=sys.stderr, flush=True)
                continue
            if "ready" in msg:
                self.ready.set()
                continue
            with self.changed:
                if "code" in msg:
                    self.codes[msg["pid"]] = msg["code"]
                else:
                    self._pids.append(msg["pid"])
                    self._forked.add(msg["pid"])
                self.changed.notify_all()
        with self.changed:  # the server is gone, and with it (death signal) its children
            for pid in self._forked - set(self.codes):
                self.codes[pid] = -signal.SIGKILL
            self.changed.notify_all()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass


class ForkServers:
    """The servers of one launcher or agent, one per module and base environment (the
    environment less the per-worker keys, those starting with `per_worker_prefix`, which are
    read after the fork)."""

    def __init__(self, per_worker_prefix: str):
        self.per_worker_prefix = per_worker_prefix
        self._servers: dict[tuple, _Server] = {}
        self._lock = threading.Lock()

    def server(self, cmd: list[str], env: dict) -> _Server:
        """The server for `cmd` in `env`, started now if there is none (it preloads then)."""
        module, args = cmd[2], cmd[3:]
        base = with_worker_defaults({k: v for k, v in env.items()
                                     if not k.startswith(self.per_worker_prefix)})
        key = (module, tuple(sorted(base.items())))
        with self._lock:
            server = self._servers.get(key)
            if server is None or server.proc.poll() is not None:
                server = self._servers[key] = _Server(module, base, args)
            return server

    def start(self, cmd: list[str], env: dict, nice: int, ignore_term: bool,
              name: str = "") -> Forked | None:
        """The worker forked, or None while its server is still preloading: the caller starts
        it as a fresh process then rather than wait (a node agent's loop must keep reporting).
        `name`: the process's name in ps and /proc/PID/comm (15 bytes at most). A server that
        fails to fork gives None too: a worker is never lost to it."""
        server = self.server(cmd, env)
        if not server.ready.is_set():
            return None
        try:
            return server.fork(cmd[3:], env, nice, ignore_term, name)
        except (RuntimeError, OSError) as e:  # the server died or hung: start it fresh, say so
            print(f"[checkpointless] fork server failed ({e}); starting the worker as a fresh "
                  "process", file=sys.stderr, flush=True)
            return None

    def close(self) -> None:
        with self._lock:
            for s in self._servers.values():
                s.close()
            self._servers.clear()


def _own_group_dying_with_parent() -> None:
    # a Ctrl-C or a TERM to the launcher's group is the launcher's to handle, as for the workers
    os.setpgid(0, 0)
    die_with_parent()

