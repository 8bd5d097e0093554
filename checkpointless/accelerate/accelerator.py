"""A drop-in `accelerate.Accelerator` whose training loop survives a worker's failure.

    from checkpointless.accelerate import Accelerator      # was: from accelerate import ...
    accelerator = Accelerator(cpu=args.cpu)                  # a hot spare waits in here for a rank
    model, optimizer, train_dl, lr_scheduler = accelerator.prepare(...)
    for epoch in accelerator.epochs(num_epochs):             # was: for epoch in range(num_epochs):
        for step, batch in accelerator.enumerate(train_dl):   # was: enumerate(train_dl)
            ...the body, unchanged...
    accelerator.end_training()

A generator cannot see an exception raised in its caller's loop body, so a peer's failure is caught
where it happens: every collective reached through the accelerator is guarded, and after a failure
the rest of the body runs on as a void pass (stand-ins, no update) until the loop asks for its next
batch, which recovers and yields the same batch again. The loop's turns are the job's public step
boundary (checkpointless/worker/steploop.py). What is supported, refused and different from accelerate's
own: docs/accelerate.md.
"""
from __future__ import annotations

import atexit
import contextlib
import inspect
import os
import sys

import accelerate
import torch
import torch.distributed as dist
import torch._dynamo  # noqa: F401  imported before a spare waits: about 1 s off a recovery
import torch.distributed.tensor  # noqa: F401
from accelerate.data_loader import DataLoaderShard
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler

from .. import join as _join
from ..worker.data import END, Position
from ..worker.ddp import DistributedDataParallel
from ..worker.digest import state_sha256
from ..worker.failures import communicating
from .arguments import loader_config, refuse_unsupported
from .collectives import GuardedCollectives
from .wrappers import (ShardCursor, VoidAwareOptimizer, VoidAwareScheduler, check_loader,
                       rebrand, void_aware_loader)

__all__ = ["Accelerator"]


class Accelerator(GuardedCollectives, accelerate.Accelerator):
    """accelerate's Accelerator on a checkpointless job: `join()` happens in the constructor,
    `prepare()` protects what it returns, and `epochs()` / `batches()` drive the loop."""

    def __init__(self, *args, **kwargs):
        bound = inspect.signature(accelerate.Accelerator.__init__).bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        refuse_unsupported(a)
        self.job = _join()  # a hot spare waits here, warm, until it is handed a failed rank
        job = self.job
        os.environ.update(job.process_env())  # the one rule, shared with the recipe loop
        if torch.cuda.is_available():  # a spare holds the failed worker's device slot
            os.environ.setdefault("ACCELERATE_TORCH_DEVICE", f"cuda:{job.device_slot}")
        else:  # accelerate only counts CPU processes with cpu=True
            a["cpu"] = True
        a["dataloader_config"] = loader_config(a["dataloader_config"], job.seed)
        a["rng_types"] = []  # no random state broadcast from rank 0 when an epoch starts
        super().__init__(*bound.args[1:], **bound.kwargs)
        self._loop = Position()  # where the loop stands, protected with the model
        self.steploop = job.steploop
        # a replacement knows nothing of the loop until it is restored; the first generation does
        self._fresh = job.is_replacement
        # a recovery outside the loop (in end_training's checks) agrees on the loop's position
        # as the replacement does when it starts, so both meet the same collectives
        job.on_recovered = self._agree
        job.protect(checkpointless_loop=self._loop)
        self._names: dict[str, int] = {}
        self._trained: list[DistributedDataParallel] = []  # the protected models, for the digest
        self._void = False  # the rest of this body is discarded (a failure, or the loop moved)
        self._in_body = False  # control is in the script's loop body
        self._epoch: int | None = None  # the epoch whose body runs now
        self._ended = False  # end_training() ran: the job is left
        self._finish_at_exit = False  # the loop ended: finish at exit if the script does not

    # ---- the loop ------------------------------------------------------------------------------
    def epochs(self, num_epochs: int):
        """Yield epoch numbers, from the agreed one after a recovery, until `num_epochs`.

        An epoch's body is run again when a failure cut it short after its last step (during an
        evaluation): its training batches are done, so `batches()` yields none."""
        loop = self._loop
        self._start()
        try:
            while True:
                self._turn()
                self._void = False
                epoch, _ = loop.current()
                if epoch >= num_epochs:
                    self._loop_ended()
                    return
                self._epoch = epoch
                self._to_user()
                yield epoch
                self._to_library()
                if self._void or self.steploop.failed:
                    continue  # the next turn recovers; the agreed position says where to go on
                loop.pending = (epoch + 1, self.steploop.completed)
        finally:
            self._epoch = None
            self._to_library()

    def batches(self, dataloader):
        """Yield this epoch's batches of a prepared `dataloader`, one per step, from the agreed
        step: a step redone after a recovery gets the same batch again; a replacement starts at
        the batch after the last committed one. Do not count them with Python's `enumerate`
        where the count decides a collective: use `accelerator.enumerate(dataloader)`."""
        with contextlib.closing(self._indexed(dataloader, "batches")) as indexed:
            for _, batch in indexed:
                yield batch

    def enumerate(self, dataloader):
        """Yield `(index, batch)` for this epoch's batches of a prepared `dataloader`, as
        `batches()` yields them; `index` is the batch's position in the epoch (0 for its first
        batch), the same on every rank after any recovery: a redone step gets its index again, a
        replacement starting mid-epoch gets the true index. Python's `enumerate` over `batches()`
        does not (it counts a redone batch twice and restarts at 0 in a replacement), so a
        collective decided by its count (`if step % 10 == 0: accelerator.reduce(loss)`) would
        meet a different one on another rank."""
        return self._indexed(dataloader, "enumerate")

    def _indexed(self, dataloader, what: str):
        if self._epoch is None:
            raise RuntimeError(f"accelerator.{what}(): call it inside `for epoch in "
                               "accelerator.epochs(n):`, which says which epoch's batches to give")
        check_loader(dataloader, what)
        return self._batches(dataloader)

    def _batches(self, dataloader):
        steps, loop, epoch = self.steploop, self._loop, self._epoch
        cursor = ShardCursor(dataloader, epoch)
        self._to_library()
        try:
            while True:
                step = self._turn()
                at, start = loop.current()
                if at != epoch:  # a recovery moved the loop to another epoch: void the rest
                    self._void = True
                    return
                if self._void:
                    return
                index = step - start  # the batch's position in the epoch, agreed by all
                batch = cursor.batch(index)
                if batch is END:
                    return
                if not steps.ready(step):  # heartbeat, due faults, replicas, consistency
                    continue  # a peer failed meanwhile: the next turn recovers
                steps.open(step)
                self._to_user()
                yield index, batch
                self._to_library()
                if steps.close():  # committed (an update that landed before a failure stands)
                    loop.commit()
        finally:
            cursor.close()
            self._to_user()

    def _loop_ended(self) -> None:
        """The last epoch of `epochs()` is done on every rank. Many accelerate scripts never call
        `end_training()`; a clean exit of such a worker would look like a failure to the
        supervisor, so it is called at the interpreter's exit (after the script's own code past
        the loop: a save, a final gather) unless the script called it or died of an exception."""
        if self._finish_at_exit or not self.steploop.fault_tolerant:
            return
        self._finish_at_exit = True
        atexit.register(self._end_at_exit)

    def _end_at_exit(self) -> None:
        if self._ended or getattr(sys, "last_value", None) is not None:
            return  # finished already, or the script raised: the supervisor sees the failure
        self._end_training()

    @property
    def recovering(self) -> bool:
        """True from a peer's failure until the loop is back at the redone step: the body runs on
        as a void pass (collectives, the optimizer and scheduler steps, print and log do
        nothing). A script that writes files in the loop body can skip them while this holds."""
        return self._void

    @property
    def rehearsing(self) -> bool:
        """True in the replay rehearsal's first attempt of a step (early in the run the step is
        run twice from the same state and compared: checkpointless/worker/rehearsal.py): print
        and log do nothing then; a script that writes files in the loop body can skip them."""
        return self.steploop.rehearsing

    def _to_user(self) -> None:
        self._in_body = self._epoch is not None
        if self._in_body:
            self.steploop.body(True)  # the watch thread may abort a collective stuck here

    def _to_library(self) -> None:
        self._in_body = False
        self.steploop.body(False)

    # ---- the turns, on the job's step boundary -------------------------------------------------
    def _start(self) -> None:
        """A replacement receives the state here; the first generation agrees on it."""
        steps = self.steploop
        steps.start()
        if steps.generation > 0 and not steps.failed:
            self._agree(steps.completed)  # as the survivors do after their restore

    def _turn(self) -> int:
        """Recover if a peer failed; after a recovery the agreed state decides where the loop
        stands (see `_agree`)."""
        steps = self.steploop
        while True:
            gen, before = steps.generation, steps.completed
            step = steps.next()
            if steps.generation == gen:
                return step
            self._void = False
            if self._agree(before):
                return steps.completed

    def _agree(self, before: int) -> bool:
        """After a restore: the move to the next epoch that waits for its first commit stands if
        every member that kept its own state (not a spare, not a survivor brought forward) had
        finished the epoch's body; otherwise that body (its evaluation) runs again everywhere.
        False when a peer failed meanwhile (recover again)."""
        loop, steps = self._loop, self.steploop
        if self._fresh or steps.completed != before:
            mine = -1  # its position came from a peer: no say
        else:
            mine = int(loop.pending == (loop.epoch + 1, steps.completed))
        got = [torch.zeros(1, dtype=torch.int64) for _ in range(self.job.world_size)]
        try:
            with communicating("agreeing on the loop's epoch"):
                dist.all_gather(got, torch.tensor([mine], dtype=torch.int64))
        except Exception as exc:
            steps.fail_or_raise(exc)
            return False
        said = [int(g) for g in got if int(g) >= 0]
        done = bool(said) and all(said)
        loop.pending = (loop.epoch + 1, steps.completed) if done else None
        self._fresh = False
        return True

    # ---- prepare: the same objects, protected --------------------------------------------------
    def _protect(self, base: str, obj) -> None:
        if self.steploop.started:
            raise RuntimeError("checkpointless.accelerate: prepare() everything before the loop "
                               "starts; a replacement receives only what was protected then")
        n = self._names.get(base, 0)
        self._names[base] = n + 1
        self.job.protect(**{base if n == 0 else f"{base}_{n}": obj})

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        # placement, autocast, compile as accelerate does them, without torch's DDP wrapper
        model = super().prepare_model(model, device_placement=device_placement,
                                      evaluation_mode=True)
        if evaluation_mode or not any(p.requires_grad for p in model.parameters()):
            return model
        handler = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
        ddp = DistributedDataParallel(
            model, **{k: v for k, v in handler.items() if k == "bucket_cap_mb"})
        self._models = [ddp if m is model else m for m in self._models]
        self._protect("model", ddp)
        self._trained.append(ddp)
        return ddp

    def prepare_optimizer(self, optimizer, device_placement=None):
        opt = super().prepare_optimizer(optimizer, device_placement=device_placement)
        if type(opt) is AcceleratedOptimizer:
            rebrand(opt, VoidAwareOptimizer, self)
            self._protect("optimizer", opt.optimizer)  # its step hook marks an applied update
            if self.scaler is not None and not hasattr(self.scaler, "_checkpointless"):
                self.scaler._checkpointless = True
                self._protect("grad_scaler", self.scaler)
        return opt

    def prepare_scheduler(self, scheduler):
        sched = super().prepare_scheduler(scheduler)
        if type(sched) is AcceleratedScheduler:
            rebrand(sched, VoidAwareScheduler, self)
            self._protect("scheduler", sched.scheduler)
        return sched

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        dl = super().prepare_data_loader(data_loader, device_placement=device_placement,
                                         slice_fn_for_dispatch=slice_fn_for_dispatch)
        if type(dl) is not DataLoaderShard:
            return dl
        loader = void_aware_loader(dl, self)  # the same loader; its evaluation loops end when void
        self._dataloaders = [loader if d is dl else d for d in self._dataloaders]
        return loader

    def register_for_checkpointing(self, *objects):
        super().register_for_checkpointing(*objects)
        for obj in objects:
            self._protect("custom", obj)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        if isinstance(model, DistributedDataParallel):
            model = model.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def end_training(self, result: dict | None = None):
        """Finish the trackers, report this rank's `result` (default: the digest of the prepared
        models' parameters, `params_sha256`) and leave the job. A script that does not call it
        leaves at its exit, once `epochs()` ended; calling it again does nothing."""
        self._end_training(result)

    def _end_training(self, result: dict | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        for tracker in self.trackers:
            tracker.finish()
        if result is None:
            state = {f"{i}.{k}": v for i, m in enumerate(self._trained)
                     for k, v in m.module.state_dict().items()}
            result = {"rank": self.process_index, "params_sha256": state_sha256(state)}
        self.job.finish(result)


