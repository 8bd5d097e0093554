"""The fork server's own process, started by the launcher's side (forkserver.py): it imports the
workers' module once, then forks one child per request and reports each child's pid and exit
code; the child turns into the worker, as `python -m MODULE ARGS` would have started it.

Its entry point is `main()` (the launcher runs `python -c` with it); what a fork keeps from the
server and a fresh process would not have is said in forkserver.py."""
from __future__ import annotations

import json
import os
import select
import signal
import sys

from ..protocol.keys import ENV_PRELOAD
from .spawn import die_with_parent


def preload_spec(env: dict) -> tuple[str, str] | None:
    """(module, function) of the preload the launcher asked for, None when it asked for none."""
    spec = env.get(ENV_PRELOAD, "")
    if spec in ("", "0") or ":" not in spec:
        return None
    module, function = spec.split(":", 1)
    return module, function


def serve(module: str, report_fd: int, args: list[str]):
    """Import MODULE and run its preload function on the first request's arguments, then fork one
    child per request; report pids and exit codes. Returns the request to run in the child that
    this process has become, or None once stdin closes."""
    import importlib
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's to handle (forkserver.py);
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the server ends when its stdin closes
    try:
        _, function = preload_spec(os.environ)
        getattr(importlib.import_module(module), function)(args)
    except Exception as e:  # noqa: BLE001 - each worker then imports, and fails, on its own
        print(f"[checkpointless] fork server: preloading {module} failed ({e!r})",
              file=sys.stderr)
    report = os.fdopen(report_fd, "w", buffering=1)
    report.write(json.dumps({"ready": True}) + "\n")
    requests = sys.stdin.buffer
    children: dict[int, int] = {}  # pidfd -> pid
    pending = b""
    while True:
        fds = [requests.fileno(), *children]
        ready, _, _ = select.select(fds, [], [])
        for fd in ready:
            if fd in children:
                pid = children.pop(fd)
                os.close(fd)
                _, status = os.waitpid(pid, 0)
                report.write(json.dumps({"pid": pid, "code": os.waitstatus_to_exitcode(status)})
                             + "\n")
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:  # the launcher closed stdin (or died): the workers stay its own
                for cfd, pid in children.items():
                    os.waitpid(pid, 0)
                return None
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    for cfd in children:
                        os.close(cfd)
                    report.close()
                    return request
                children[os.pidfd_open(pid)] = pid
                report.write(json.dumps({"pid": pid}) + "\n")


def become_worker(module: str, request: dict) -> None:
    """In the forked child: what `python -m MODULE ARGS` with the request's environment is."""
    import random
    import runpy
    os.setpgid(0, 0)
    die_with_parent()
    if request.get("name"):
        _set_name(request["name"])
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
    signal.signal(signal.SIGTERM, signal.SIG_IGN if request["ignore_term"] else signal.SIG_DFL)
    if request["nice"]:
        os.nice(request["nice"])
    devnull = os.open(os.devnull, os.O_RDONLY)  # not the server's request pipe
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = [module, *request["args"]]
    # run as __main__ as `python -m` does, where the preloaded copy is not in sys.modules
    sys.modules.pop(module, None)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _set_name(name: str) -> None:
    """The process's name (PR_SET_NAME): what ps, top and /proc/PID/comm show. A forked worker's
    /proc/PID/environ and cmdline are the server's (the kernel keeps those of the last exec), so
    this is how one tells the workers apart from outside."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def main() -> None:
    module, report_fd = sys.argv[1], int(sys.argv[2])
    request = serve(module, report_fd, sys.argv[3:])
    if request is None:
        return
    become_worker(module, request)  # an exception or SystemExit ends the child as `python -m`


if __name__ == "__main__":
    main()
