"""The operating system's side of a process the control plane starts: it dies with its parent,
its whole tree is signalled, its exit is waited for on a descriptor. Used by the pools
(processes.py), the fork server (forkserver.py) and the etcd member (ha/member.py)."""
from __future__ import annotations

import os
import signal
import subprocess


def die_with_parent() -> None:
    """In a child, before exec: get SIGKILL when the parent (the launcher or agent) dies."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def step_wide_sigterm(env) -> bool:
    """Under Slurm a preemption's SIGTERM (scancel --signal=TERM, the end of a time limit) goes to
    every process of the job step, the workers too, not only to their launcher."""
    return "SLURM_JOB_ID" in env


def open_pidfd(pid: int) -> int | None:
    """A descriptor readable once the process exits; None on an older kernel or Python (the
    waits then poll)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def kill_tree(proc: subprocess.Popen, sig=signal.SIGKILL) -> None:
    """Signal the process and whatever it started: a child left behind (a DataLoader worker)
    would keep a dead worker's connections open and its peers blocked on them. A stand-in for a
    process (the scale harness's simulated ranks) is asked to end itself."""
    if hasattr(proc, "signal_tree"):
        return proc.signal_tree(sig)
    try:
        os.killpg(proc.pid, sig)  # its own group (start_process), the process included
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass
