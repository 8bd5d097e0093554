"""The same loop API with no fault tolerance, for a script started by torchrun.

It lets one training script run both ways: under the supervisor (recovering in-process) or under
torchrun (a failure kills the job; torchrun restarts it and the script resumes from its last disk
checkpoint), which is the baseline the benchmark measures against.
"""
from __future__ import annotations

import contextlib
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from .data import check_loader
from .. import protocol
from .ddp import DistributedDataParallel
from .grads import all_reduce_grads, summed_extra
from .hosting import LogicalRanks
from .seeding import seed_all, step_seed


class PlainStepLoop:
    """The same boundary under torchrun: nothing is recovered, a failure ends the job."""

    fault_tolerant = False
    rehearsing = False  # nothing is redone under torchrun, so nothing is rehearsed
    generation = 0
    failed = False
    update_applied = False
    may_communicate = True
    builds_own_state = True  # torchrun restarts the whole job: every worker builds its state

    def __init__(self, rank: int, seed: int):
        self.rank, self.seed = rank, seed
        self.completed = 0
        self.started = False
        self.step_started_at = 0.0

    def start(self) -> None:
        self.started = True

    def next(self) -> int:
        return self.completed

    def ready(self, step: int) -> bool:
        self.step_started_at = time.time()
        return True

    def open(self, step: int) -> None:
        seed_all(step_seed(self.seed, step, self.rank, 0))

    def body(self, inside: bool) -> None:
        pass

    def absorb(self, exc: BaseException) -> bool:
        return False

    def close(self) -> bool:
        self.completed += 1
        return True

    def fail_or_raise(self, exc: Exception) -> None:
        raise exc

    def report(self, exc: BaseException) -> None:
        pass

    def say_void(self, what: str) -> None:
        pass

    def secure(self) -> bool:
        return True


class PlainJob(LogicalRanks):
    """Owns a torchrun worker's process group and step count; recovers nothing (and never
    shrinks: its one logical rank a process reduces as `Job` does, hosting.py)."""

    grads_kept = False  # a failure ends the job: no step is ever redone in-process
    rehearsing = False  # so no step is rehearsed either (rehearsal.py)
    replay = None
    preempted = False  # torchrun handles its own signals
    catching_up = 0
    is_replacement = False

    def __init__(self, backend: str, seed: int, spec: protocol.Spec | None = None):
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        # torchrun keeps one rendezvous store across restarts; keys left by the previous round
        # (old gloo addresses) make a plain env:// init connect to dead peers and fail again
        # (pytorch#135712). A prefix per restart round keeps each round's keys apart.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=timedelta(seconds=300))
        prefix = protocol.plain_prefix(os.environ.get('TORCHELASTIC_RESTART_COUNT', '0'))
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank,
                                world_size=world)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.worker_id, self.gen, self.seed = self.rank, 0, seed
        self.backend = backend
        # the job's settings, as a supervised Job reads them from the store (join's argument)
        self.spec = spec if spec is not None else protocol.Spec(backend=backend, seed=seed)
        self.device_slot = int(os.environ.get("LOCAL_RANK", "0"))
        self.steploop = PlainStepLoop(self.rank, seed)
        self._scoped = False
        self._ddp = None

    # ---- the same surface as Job, with nothing to recover ------------------------------------
    last_recovery = None

    @property
    def completed_steps(self) -> int:
        return self.steploop.completed

    @property
    def step_started_at(self) -> float:
        return self.steploop.step_started_at

    @property
    def data_rank(self) -> int:  # no tensor parallel under torchrun: every rank its own share
        return self.rank

    @property
    def data_world(self) -> int:
        return self.world_size

    def resume_at(self, step: int) -> None:
        self.steploop.completed = step

    def process_env(self) -> dict[str, str]:
        """torchrun has set RANK, WORLD_SIZE and LOCAL_RANK; only a missing LOCAL_WORLD_SIZE is
        filled in (one node)."""
        if "LOCAL_WORLD_SIZE" in os.environ:
            return {}
        return {"LOCAL_WORLD_SIZE": str(self.world_size)}

    def replica_host_bytes(self, part: str = "held") -> int | None:
        return None  # no copies or snapshots: a failure ends the job

    def replica_timing(self) -> dict | None:
        return None

    def set_fallback(self, newest_step, load_step, drop_after=None) -> None:
        pass  # torchrun restarts the job, which loads the newest checkpoint itself

    def seed_step(self, step: int, micro: int = 0, share: int | None = None) -> int:
        return seed_all(step_seed(self.seed, step, self.rank if share is None else share, micro))

    def all_reduce_grads(self, params, extra: torch.Tensor | None = None):
        if self._ddp:  # the wrapper averaged the gradients (and extra) during backward
            return summed_extra(self._ddp, extra)
        return all_reduce_grads(params, self.world_size, extra)

    def protect(self, send_frozen: bool = True, rebuild=None, **objects) -> None:
        # nothing to protect (a failure ends the job); note a gradient-averaging wrapper, and
        # refuse a loader the supervised run would refuse
        found = [o for o in objects.values() if isinstance(o, DistributedDataParallel)]
        self._ddp = found[0] if found else None
        for obj in objects.values():
            if isinstance(obj, DataLoader):
                check_loader(obj)

    def epochs(self, num_epochs: int, max_steps: int | None = None, loader=None):
        for epoch in range(num_epochs):
            if max_steps is not None and self.completed_steps >= max_steps:
                return
            yield epoch

    def batches(self, loader, max_steps: int | None = None):
        loop = self.steploop
        for batch in loader:
            if max_steps is not None and loop.completed >= max_steps:
                return
            loop.ready(loop.completed)
            self._scoped = False
            yield batch
            if not self._scoped:
                loop.close()

    def steps(self, max_steps: int):
        loop = self.steploop
        while loop.completed < max_steps:
            loop.ready(loop.completed)
            self._scoped = False
            yield loop.completed
            if not self._scoped:
                loop.close()

    @contextlib.contextmanager
    def step(self):
        self._scoped = True
        self.steploop.open(self.steploop.completed)
        yield self
        self.steploop.close()

    def between_steps(self, fn):
        return fn()

    def finish(self, result: dict | None = None) -> None:
        dist.barrier()
        dist.destroy_process_group()
