"""The worker processes of one node: started, watched without polling, killed."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass

from . import protocol


def die_with_parent() -> None:
    """In a child, before exec: get SIGKILL when the parent (the launcher or agent) dies."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@dataclass
class Worker:
    """One started process: its id, its device slot, the rank it holds (or spare/lost)."""
    wid: int
    proc: subprocess.Popen
    slot: int  # local device slot; a replacement takes the slot of the worker it replaces
    started: float
    rank: int = -1  # -1 while a spare, -2 once lost
    took_over_gen: int | None = None  # generation in which a spare was handed a lost rank
    pidfd: int | None = None  # readable once the process has exited (Linux 5.3+)
    refilled: bool = False  # a refill has been started for it (when it was lost)
    gone_seen: bool = False  # its exit as a spare has been handled
    node: int = 0  # the node it runs on (nodes.py; always 0 on one machine)
    node_lost: bool = False  # it went down with its whole node
    lost_at: float = 0.0  # then, when its node was last heard from

    def alive(self) -> bool:
        return self.proc.poll() is None


class WorkerPool:
    """Owns the processes this supervisor started (active workers and spares) and their ids."""

    def __init__(self, cmd: list[str], env: dict, host: str, spares_from_slot: int,
                 refill_nice: int):
        self.cmd, self.env, self.host = cmd, env, host
        self.spares_from_slot = spares_from_slot  # slots at or past this start as spares
        self.refill_nice = refill_nice
        self.port = 0
        self.workers: dict[int, Worker] = {}
        self._next_wid = 0

    def spawn(self, slot: int, background: bool = False, spare: bool | None = None) -> Worker:
        """Start a worker. A background refill warms up at `refill_nice` and takes normal
        priority when given a rank. Every process but the first generation's ranks starts as a
        spare."""
        wid = self._next_wid
        self._next_wid += 1
        if spare is None:
            spare = background or slot >= self.spares_from_slot
        env = dict(self.env, **protocol.worker_env(self.host, self.port, wid, slot, spare))
        nice = self.refill_nice if background else 0

        def setup():  # its own process group: its children (DataLoader workers) die with it
            os.setpgid(0, 0)
            die_with_parent()  # and it dies with the launcher, even a SIGKILLed one
            if nice:
                os.nice(nice)

        proc = subprocess.Popen(self.cmd, env=env, preexec_fn=setup)
        w = Worker(wid=wid, proc=proc, slot=slot, started=time.time())
        try:
            w.pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # older kernel or Python: the loop polls instead
            w.pidfd = None
        self.workers[wid] = w
        return w

    def sleep(self, active: list[int], timeout_s: float) -> None:
        """Sleep until one of the `active` workers exits or `timeout_s` passes.

        Waiting on pidfds costs no CPU and sees an exit the moment it happens; polling every
        20 ms cost about 1% of a core, which on a small machine is taken from training."""
        for w in self.workers.values():  # reaped: its descriptor is of no more use
            if w.pidfd is not None and w.proc.returncode is not None:
                os.close(w.pidfd)
                w.pidfd = None
        fds = [self.workers[wid].pidfd for wid in active if self.workers[wid].alive()]
        if None in fds:
            time.sleep(min(timeout_s, 0.02))
            return
        if not fds:
            time.sleep(timeout_s)
            return
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        poller.poll(timeout_s * 1000)

    @staticmethod
    def kill(w: Worker) -> None:
        """Kill the worker and whatever it started: a child left behind (a DataLoader worker)
        would keep the dead worker's connections open and its peers blocked on them."""
        try:
            os.killpg(w.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if w.alive():
            try:
                w.proc.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
        w.proc.wait()

    def respawn(self, w: Worker) -> Worker | None:
        """A refill for a lost worker: a new spare in its device slot."""
        return self.spawn(w.slot, background=True)

    def choose_spares(self, store, failed: list[tuple[int, int]]) -> list[Worker] | None:
        """Ready spares for the failed (node, slot) pairs, in order; None when too few."""
        ready = self.spares(store, ready=True)
        return ready[:len(failed)] if len(ready) >= len(failed) else None

    def spares(self, store, ready: bool) -> list[Worker]:
        """Live spares; with ready=True only those that finished warming up."""
        return [w for w in self.workers.values() if w.rank == -1 and w.alive()
                and (not ready or store.check([protocol.ready_key(w.wid)]))]

    def stop_all(self) -> None:
        """End every process still running (spares, and workers of a run that stopped early)
        with its children, and wait for them."""
        for w in self.workers.values():
            if w.alive():
                try:
                    os.killpg(w.proc.pid, signal.SIGTERM)
                except (ProcessLookupError, PermissionError):
                    w.proc.terminate()
        for w in self.workers.values():
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill(w)
