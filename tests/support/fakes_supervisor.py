"""What the in-process supervisor tests share (test_supervisor.py, test_shrink_supervisor.py):
stand-in processes that are never started, a one-machine pool that
"starts" them, a real TCPStore, and a Supervisor at generation 0 built through its constructor
(the pool given to it) and its own first moves (Supervisor.first_generation)."""
import json
from datetime import timedelta

import torch.distributed as dist

from checkpointless import protocol
from checkpointless.control.processes import Worker, WorkerPool
from checkpointless.control.supervisor import Supervisor


class FakeProc:
    """A worker's process as far as the supervisor and an agent look at one: its pid is past the
    kernel's largest (/proc has no such process), and a kill (kill_tree) only sets its code."""

    def __init__(self, wid: int):
        self.pid, self.returncode = 2 ** 22 + wid, None

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        return self.returncode

    def signal_tree(self, sig):
        if self.returncode is None:
            self.returncode = -int(sig)


class StandInPool(WorkerPool):
    """One machine's pool for `cfg` whose workers are stand-ins (FakeProc, started at t=0):
    ranks 0..nproc-1 in the slots of their numbers, spares after them, as WorkerPool.start
    lays them out; no process, no fork server."""

    def __init__(self, cfg):
        super().__init__(["true"], {}, cfg.host, spares_from_slot=cfg.nproc,
                         refill_nice=cfg.refill_nice, spares_per_node=cfg.spares,
                         refill=cfg.refill, local=False)

    def forks_ready(self) -> None:
        pass

    def spawn(self, slot: int, background: bool = False, spare: bool | None = None) -> Worker:
        w = Worker(wid=self.next_wid, proc=FakeProc(self.next_wid), slot=slot, started=0.0)
        self.workers[w.wid] = w
        self.next_wid += 1
        return w


def new_store():
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


def beat(store, wid: int, step: int, t: float) -> None:
    store.set(protocol.heartbeat_key(wid), json.dumps(
        {"t": t, "step": step, "gen": 0, "phase": "step"}))


def at_generation_zero(cfg, ready_spares=(), facts=None):
    """A supervisor on one machine for `cfg`, in generation 0: ranks 0..nproc-1 held by workers
    of the same ids, spares after them (only `ready_spares` warmed up). What it logs is in
    `sup.said`."""
    said, store = [], new_store()
    sup = Supervisor(["true"], cfg, log=said.append, facts=facts, pool=StandInPool(cfg))
    sup.said = said
    for wid in [*range(cfg.nproc), *ready_spares]:
        store.set(protocol.ready_key(wid), "1")
    sup.store = store
    sup.first_generation()
    return sup, store
