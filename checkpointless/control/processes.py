"""The worker processes of one node: started, watched without polling, killed.

The supervisor's WorkerPool (node 0) and a node's agent (agent.py) start, watch and end their
processes with the same functions, below.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass

from . import forkserver
from .spawn import die_with_parent, kill_tree, open_pidfd, step_wide_sigterm
from .. import protocol


_SERVERS = forkserver.ForkServers(per_worker_prefix=protocol.ENV_PREFIX)


SERVER_WAIT_S = 120.0  # past this, the first workers start as fresh processes


def warm_server(cmd: list[str], env: dict, wait_s: float) -> bool:
    """Start the fork server for `cmd` (if the launcher asked for one) and wait up to `wait_s`
    for its preload; True when workers will be forked. Call it from a thread that lives as long
    as the workers: the server dies with the thread that started it (PR_SET_PDEATHSIG)."""
    if not forkserver.forkable(cmd, env):
        return False
    return _SERVERS.server(cmd, env).ready.wait(wait_s)


def start_process(cmd: list[str], env: dict, nice: int = 0) -> subprocess.Popen:
    """A worker process in its own process group (its children, such as DataLoader workers, die
    with it), which dies with its parent, even a SIGKILLed one. The command the launcher names in
    CHECKPOINTLESS_FORKSERVER is forked from a server that has imported its libraries already
    (forkserver.py).

    Under Slurm it ignores SIGTERM (the disposition survives exec): a preemption is its
    launcher's to handle, which stops the job at a step boundary with a checkpoint; a worker
    dying of the same signal would turn that into a failure. It still dies with its launcher,
    and is ended with SIGKILL (stop_all)."""
    ignore_term = step_wide_sigterm(env)
    if forkserver.forkable(cmd, env):
        wid = env.get(protocol.ENV_WORKER_ID)
        forked = _SERVERS.start(cmd, env, nice, ignore_term,
                                name=f"cl-worker-{wid}" if wid is not None else "")
        if forked is not None:
            return forked

    def setup():
        os.setpgid(0, 0)
        die_with_parent()
        if ignore_term:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if nice:
            os.nice(nice)

    return subprocess.Popen(cmd, env=env, preexec_fn=setup)


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
    node: int = 0  # the node it runs on (cluster.py; always 0 on one machine)
    node_lost: bool = False  # it went down with its whole node
    lost_at: float = 0.0  # then, when its node was last heard from

    def alive(self) -> bool:
        return self.proc.poll() is None


def wait_for_exit(workers: list[Worker], timeout_s: float, extra_fds=()) -> None:
    """Sleep until one of `workers` exits, one of `extra_fds` is readable, or `timeout_s`
    passes.

    Waiting on pidfds costs no CPU and sees an exit the moment it happens; polling every 20 ms
    cost about 1% of a core, which on a small machine is taken from training."""
    fds = [w.pidfd for w in workers if w.alive()]
    if None in fds:
        time.sleep(min(timeout_s, protocol.DEFAULTS.exit_poll_s))
        return
    fds += list(extra_fds)
    if not fds:
        time.sleep(timeout_s)
        return
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    poller.poll(timeout_s * 1000)


def close_reaped(workers) -> None:
    """Close the descriptors of reaped processes: they are of no more use."""
    for w in workers:
        if w.pidfd is not None and w.proc.returncode is not None:
            os.close(w.pidfd)
            w.pidfd = None


def stop_all(workers, grace_s: float = 10.0) -> None:
    """End every process still running with its children (SIGTERM, then SIGKILL after
    `grace_s`; SIGKILL at once where they ignore SIGTERM: start_process), and wait for them."""
    sig = signal.SIGKILL if step_wide_sigterm(os.environ) else signal.SIGTERM
    for w in workers:
        if w.alive():
            kill_tree(w.proc, sig)
    deadline = time.time() + grace_s
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            kill_tree(w.proc)
            w.proc.wait()


class WorkerPool:
    """Owns the processes this supervisor started (active workers and spares) and their ids."""

    def __init__(self, cmd: list[str], env: dict, host: str, spares_from_slot: int,
                 refill_nice: int, spares_per_node: int = 0, refill: bool = True,
                 local: bool = True):
        self.cmd, self.env, self.host = cmd, env, host
        self.spares_from_slot = spares_from_slot  # slots at or past this start as spares
        self.spares_per_node = spares_per_node  # spares started beside the first ranks
        self.refill_nice = refill_nice
        self.refills = refill  # a lost worker's slot gets a new spare (refill())
        self.port = 0
        self.store = None  # the supervisor's, set in start()
        self.workers: dict[int, Worker] = {}
        self.next_wid = 0
        self._refills: list[tuple[float, Worker]] = []  # (when, lost worker) of delayed refills
        if local:  # workers start on this machine: the fork server preloads from now on
            warm_server(cmd, env, 0)

    def forks_ready(self) -> None:
        """Before the first generation is started: wait for the fork server's preload (its
        imports take the time the workers' own would; see forkserver.py)."""
        warm_server(self.cmd, self.env, SERVER_WAIT_S)

    def start(self, store) -> list[Worker]:
        """The first generation: ranks 0..R-1 in slots of the same number (R: spares_from_slot),
        spares after them. Returns the active workers, their ranks set."""
        self.store, self.port = store, store.port
        self.forks_ready()
        out = []
        for slot in range(self.spares_from_slot + self.spares_per_node):
            w = self.spawn(slot)
            if slot < self.spares_from_slot:
                w.rank = slot
                out.append(w)
        return out

    def spawn(self, slot: int, background: bool = False, spare: bool | None = None) -> Worker:
        """Start a worker. A background refill warms up at `refill_nice` and takes normal
        priority when given a rank. Every process but the first generation's ranks starts as a
        spare."""
        wid = self.next_wid
        self.next_wid += 1
        if spare is None:
            spare = background or slot >= self.spares_from_slot
        env = dict(self.env, **protocol.worker_env(self.host, self.port, wid, slot, spare))
        proc = start_process(self.cmd, env, self.refill_nice if background else 0)
        w = Worker(wid=wid, proc=proc, slot=slot, started=time.time(), pidfd=open_pidfd(proc.pid))
        self.workers[wid] = w
        return w

    def maybe_exited(self, wids) -> list[int]:
        """Those of `wids` that may have exited: each is a local process, polled (cluster.py
        narrows it to the exits its nodes' records brought)."""
        return list(wids)

    def sleep(self, active: list[int], timeout_s: float) -> None:
        """Sleep until one of the `active` workers exits or `timeout_s` passes."""
        close_reaped(self.workers.values())
        wait_for_exit([self.workers[wid] for wid in active], timeout_s)

    def refresh(self, force: bool = False) -> None:
        """Learn of exits the processes' own status does not show (other nodes': cluster.py)."""

    def fence_silent_nodes(self) -> list[int]:
        """Nodes declared lost (and fenced) since the last call: none on one machine."""
        return []

    def beats(self, wids) -> dict:
        """wid -> its last heartbeat (None: none yet), from the store its node's workers beat
        into: on one machine, the supervisor's own."""
        from .detection import read_beats
        return read_beats(self.store, list(wids))

    @staticmethod
    def unheard(node: int) -> bool:
        """This machine's workers are always heard from (ClusterPool: other nodes')."""
        return False

    def stopped(self, w: Worker) -> bool:
        """The worker's process is stopped (SIGSTOP, a debugger, a frozen container)."""
        from .detection import process_stopped
        return process_stopped(w.proc.pid)

    @staticmethod
    def kill(w: Worker) -> None:
        """Kill the worker and whatever it started, and reap it."""
        kill_tree(w.proc)
        w.proc.wait()

    def respawn(self, w: Worker) -> Worker | None:
        """A refill for a lost worker: a new spare in its device slot."""
        return self.spawn(w.slot, background=True)

    def refill(self, w: Worker, later: bool) -> None:
        """A new spare for lost worker `w` (once, if refills are on): now, or after
        refill_delay_s when the spares suffice for now (its imports would otherwise compete with
        the recovery for CPU)."""
        if w.refilled or not self.refills:
            return
        w.refilled = True
        if later:
            self._refills.append((time.time() + protocol.DEFAULTS.refill_delay_s, w))
        else:
            self.respawn(w)

    def refill_due(self) -> None:
        """Start the delayed refills whose time has come."""
        for r in [r for r in self._refills if r[0] <= time.time()]:
            self._refills.remove(r)
            self.respawn(r[1])

    def replace_dead_spares(self, shutting_down: bool, log) -> None:
        """A spare that died while waiting is replaced too (unless the job is ending, or its
        node was lost)."""
        for w in self.dead_spares():
            if shutting_down or w.node_lost:
                continue
            log(f"[checkpointless] spare worker {w.wid} exited (code {w.proc.returncode})" +
                ("; starting another" if self.refills else ""))
            if self.refills:
                self.respawn(w)

    def dead_spares(self) -> list[Worker]:
        """Spares that exited while waiting for a rank, each returned once."""
        out = [w for w in self.workers.values()
               if w.rank == -1 and not w.alive() and not w.gone_seen]
        for w in out:
            w.gone_seen = True
        return out

    def spares(self, store, ready: bool) -> list[Worker]:
        """Live spares; with ready=True only those that finished warming up."""
        return [w for w in self.workers.values() if w.rank == -1 and w.alive()
                and (not ready or store.check([protocol.ready_key(w.wid)]))]

    def lost_node_ids(self) -> set[int]:
        """Nodes declared lost so far (their spares are gone, their ranks move together)."""
        return set()

    def spare_node_ids(self) -> set[int]:
        """Nodes of spares only, which take a lost node's ranks together."""
        return set()

    def stop_all(self) -> None:
        """End every process still running (spares, and workers of a run that stopped early)
        with its children, and wait for them."""
        stop_all(list(self.workers.values()))
