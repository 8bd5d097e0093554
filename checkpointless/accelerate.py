"""A drop-in `accelerate.Accelerator` whose training loop survives a worker's failure.

A script written for Hugging Face accelerate changes its import and the heads of its two loops;
no line of a loop's body changes and nothing is re-indented:

    from checkpointless.accelerate import Accelerator      # was: from accelerate import ...

    accelerator = Accelerator(cpu=args.cpu)                  # a hot spare waits in here for a rank
    model, optimizer, train_dl, eval_dl, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dl, eval_dl, lr_scheduler)
    for epoch in accelerator.epochs(num_epochs):             # was: for epoch in range(num_epochs):
        model.train()
        for step, batch in accelerator.enumerate(train_dl):   # was: enumerate(train_dl)
            outputs = model(**batch)
            accelerator.backward(outputs.loss)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            if step % 10 == 0:                               # the same `step` on every rank
                accelerator.print(accelerator.reduce(outputs.loss.detach(), "mean"))
        model.eval()
        for step, batch in enumerate(eval_dl):
            ...
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
        accelerator.print(f"epoch {epoch}:", ...)
    accelerator.end_training()      # reports this rank's result, leaves (at exit if not called)

`step` is the batch's index in its epoch, the position the library keeps to resume the data: after
a recovery it is the same on every rank (the redone batch gets its index again, a replacement the
true one), so a collective may depend on it. Python's `enumerate(accelerator.batches(train_dl))`
must not decide a collective: it counts a redone batch twice on a survivor and restarts at 0 in a
replacement. Neither may any counter of the script's own; derive counters from `step`.

Run it with `python -m checkpointless --nproc N --spares S script.py`; under torchrun (or
`accelerate launch`) the same script runs without fault tolerance (`checkpointless.join()` returns
a PlainJob there).

How a failure is survived without a `with` block around the step. A generator cannot see an
exception raised in its caller's loop body, so the peer failure is caught where it happens
instead: every collective the script reaches through the accelerator is a guarded call
(`backward`, whose gradient all-reduce runs inside checkpointless.DistributedDataParallel;
`gather`, `gather_for_metrics`, `reduce`, `pad_across_processes`, `wait_for_everyone`). When one
of them fails because a peer was lost, it marks the step failed and returns a stand-in of the
right shape, and the rest of the body runs on as a void pass: further collectives return
stand-ins at once (never touching the broken group), `optimizer.step()` and `lr_scheduler.step()`
do nothing, `print` and `log` say nothing, and a loop over a prepared evaluation loader ends after
the batch in hand. When the loop asks for its next batch (or epoch), the generator recovers
(new group, state from a peer, the spare takes the lost rank) and yields the same batch again,
with the same per-step random seed, so the step is redone with the bits it would have had.

Where the loop stands is part of the protected state: the epoch and the step at which it began.
The move to the next epoch is only pending until that epoch's first step commits. After a
restore the members agree on it: it stands if every member that kept its own state had finished
the epoch's body; if a failure cut an evaluation short (between the last step of one epoch and
the first of the next), every member, the spare included, runs that epoch's body again: its
training batches are done, `batches()` yields none, and the evaluation follows. A member that
had already gone on to the next epoch voids the rest of that body and is taken back.

What prepare() does differently from accelerate's:
  * the model is placed (and given autocast) without torch's DDP wrapper, which keeps the
    process group it was built with and broadcasts from rank 0 when built; it is wrapped in
    checkpointless.DistributedDataParallel, whose fixed buckets follow every new group;
  * the model, the optimizer, the scheduler (and a GradScaler, and objects given to
    `register_for_checkpointing`) are protected: a replacement receives them from a peer;
  * dataloaders shard as accelerate shards them, but their order is a function of the epoch:
    a shuffled loader gets accelerate's seedable sampler (seed `data_seed`, default the job's
    seed) and no loader synchronizes random states with rank 0 when it starts an epoch, so a
    replacement makes no collective call before it has received the state. A replacement starts
    at the batch after the last committed one (accelerate's `skip_first_batches`: the skipped
    batches are never loaded).

Also different: the step's random seed is set per step (`job.seed_step`), and gradients are
summed in fixed buckets, so the bits differ from the same script on plain accelerate (they are
the same under the supervisor, with or without failures, and under torchrun).
`end_training(result=None)` reports `result` (by default `{"rank", "params_sha256"}` of the
prepared models) with `job.finish()` and leaves the job; a script that does not call it leaves at
the interpreter's exit once `epochs()` ended (not after an exception), and a second call does
nothing. `accelerator.recovering` is True during a void pass, for code with side effects of its
own (a file written, a counter that must not see the void pass).

Not supported (refused where it can be seen): gradient accumulation over several batches,
DeepSpeed, FSDP, Megatron and tensor-parallel configurations, `dispatch_batches`, iterable
datasets in `batches()`, a training loader whose order is not a function of the epoch. A
scheduler that is not passed to prepare() is neither protected nor held still in a void pass.
Collectives the script makes itself (torch.distributed calls, accelerate.utils functions) are
not guarded: a peer's failure there ends the worker; so does one after the loop (end_training).
`save_state` and trackers other than accelerate's defaults are not made failure-aware. A
replacement skips `main_process_first`'s and `wait_for_everyone`'s barriers before the loop (the
survivors are not there to meet it) and refuses any other collective there.
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
from accelerate.data_loader import (DataLoaderShard, SeedableRandomSampler, skip_first_batches)
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DataLoaderConfiguration, recursively_apply
from torch.utils.data import DistributedSampler, IterableDataset, SequentialSampler

from . import join as _join
from .data import END
from .ddp import DistributedDataParallel
from .digest import state_sha256
from .failures import communicating, report_error
from .faults import InjectedFault
from .plain import PlainJob
from .recovery import Phase

__all__ = ["Accelerator"]

ORDERED = (SeedableRandomSampler, SequentialSampler, DistributedSampler)


class Accelerator(accelerate.Accelerator):
    """accelerate's Accelerator on a checkpointless job: `join()` happens in the constructor,
    `prepare()` protects what it returns, and `epochs()` / `batches()` drive the loop."""

    def __init__(self, *args, **kwargs):
        if PartialState._shared_state or AcceleratorState._shared_state:
            raise RuntimeError("checkpointless.accelerate.Accelerator: build it before anything "
                               "else of accelerate's (PartialState, another Accelerator): the job "
                               "decides this process's rank when it joins")
        bound = inspect.signature(accelerate.Accelerator.__init__).bind(self, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        for plugin in ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin",
                       "megatron_lm_plugin", "torch_tp_plugin", "parallelism_config"):
            if a.get(plugin) is not None:
                raise NotImplementedError(f"checkpointless.accelerate: {plugin} is not supported; "
                                          "the model is replicated and protected whole")
        for env in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_MEGATRON_LM",
                    "ACCELERATE_USE_PARALLELISM_CONFIG"):
            if os.environ.get(env, "false").lower() == "true":
                raise NotImplementedError(f"checkpointless.accelerate: {env}=true (an accelerate "
                                          "config) is not supported; the model is replicated")
        steps = a["gradient_accumulation_steps"]
        plugin = a.get("gradient_accumulation_plugin")
        if plugin is not None:
            steps = plugin.num_steps
        if int(os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", steps)) != 1:
            raise NotImplementedError("checkpointless.accelerate: gradient accumulation over "
                                      "several batches is not supported (one batch per step)")
        self.job = _join()  # a hot spare waits here, warm, until it is handed a failed rank
        job = self.job
        os.environ.update(RANK=str(job.rank), WORLD_SIZE=str(job.world_size),
                          LOCAL_RANK=str(job.device_slot if torch.cuda.is_available() else
                                         os.environ.get("LOCAL_RANK", job.rank)))
        if isinstance(job, PlainJob):
            os.environ.setdefault("LOCAL_WORLD_SIZE", str(job.world_size))
        else:  # processes sharing this node's cores (spares too); the group is formed already,
            # so MASTER_ADDR only quiets accelerate's check for a multi-node launch
            os.environ["LOCAL_WORLD_SIZE"] = str(job.spec.workers_per_node)
            os.environ.setdefault("MASTER_ADDR", os.environ.get("CL_STORE_HOST", "127.0.0.1"))
        if not torch.cuda.is_available():  # accelerate only counts CPU processes with cpu=True
            a["cpu"] = True
        config = a["dataloader_config"] or DataLoaderConfiguration()
        if config.dispatch_batches:
            raise NotImplementedError("checkpointless.accelerate: dispatch_batches is not "
                                      "supported (rank 0 would broadcast every batch)")
        config.dispatch_batches = False
        config.use_seedable_sampler = True  # a shuffled order is a function of (seed, epoch)
        if config.data_seed is None:
            config.data_seed = getattr(job, "seed", 0)
        a["dataloader_config"] = config
        a["rng_types"] = []  # no random state broadcast from rank 0 when an epoch starts
        super().__init__(*bound.args[1:], **bound.kwargs)
        self._loop = _LoopPosition()
        self._driver = (_Plain(self) if isinstance(job, PlainJob) else _Supervised(self))
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
        d, loop = self._driver, self._loop
        d.start()  # a replacement receives the state here; the first generation agrees on it
        try:
            while True:
                d.turn()
                self._void = False
                epoch, _ = loop.current()
                if epoch >= num_epochs:
                    self._loop_ended()
                    return
                self._epoch = epoch
                self._to_user()
                yield epoch
                self._to_library()
                if self._void or d.failed():
                    continue  # the next turn recovers; the agreed position says where to go on
                loop.pending = (epoch + 1, d.completed())
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
        d, loop, epoch = self._driver, self._loop, self._epoch
        cursor = _Cursor(dataloader, epoch)
        self._to_library()
        try:
            while True:
                step = d.turn()
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
                if not d.ready(step):
                    continue  # a peer failed meanwhile: the next turn recovers
                d.open_step(step)
                self._to_user()
                yield index, batch
                self._to_library()
                if d.close_step():
                    loop.commit()
                    d.commit()
        finally:
            cursor.close()
            self._to_user()

    def _loop_ended(self) -> None:
        """The last epoch of `epochs()` is done on every rank. Many accelerate scripts never call
        `end_training()`; a clean exit of such a worker would look like a failure to the
        supervisor, so it is called at the interpreter's exit (after the script's own code past
        the loop: a save, a final gather) unless the script called it or died of an exception."""
        if self._finish_at_exit or isinstance(self.job, PlainJob):
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

    def _to_user(self) -> None:
        self._in_body = self._epoch is not None
        self._driver.to_user(self._in_body)

    def _to_library(self) -> None:
        self._in_body = False
        self._driver.to_library()

    # ---- guarded collectives -------------------------------------------------------------------
    def _guarded(self, fn, stand_in, what: str):
        """Run the collective `fn()`. A peer's failure inside the loop body voids the rest of the
        body and gives `stand_in()` instead; so does any call once the body is void."""
        if self._void:
            return stand_in()
        if not self._driver.may_communicate():
            raise RuntimeError(f"checkpointless.accelerate: {what} before the loop, in a worker "
                               "that took over a failed rank; the survivors are inside the loop "
                               "and would never meet this collective. Move it into the loop or "
                               "after it")
        try:
            return fn()
        except Exception as exc:
            if self._in_body and self._driver.absorb(exc, what):
                self._void = True
                return stand_in()
            self._driver.report(exc)
            raise

    def _stand_in_gathered(self, data, use_gather_object: bool = False):
        world = self.num_processes
        try:
            recursively_apply(lambda x: x, data, error_on_other_type=True)
            tensors = not use_gather_object
        except TypeError:
            tensors = False
        if not tensors:
            return list(data) * world if isinstance(data, list) else [data] * world
        return recursively_apply(
            lambda t: torch.cat([t.reshape(1) if t.dim() == 0 else t] * world), data)

    def backward(self, loss, **kwargs):
        fn = super().backward
        return self._guarded(lambda: fn(loss, **kwargs), lambda: None, "backward")

    def gather(self, tensor):
        fn = super().gather
        return self._guarded(lambda: fn(tensor), lambda: self._stand_in_gathered(tensor),
                             "gather")

    def gather_for_metrics(self, input_data, use_gather_object=False):
        fn = super().gather_for_metrics
        return self._guarded(lambda: fn(input_data, use_gather_object=use_gather_object),
                             lambda: self._stand_in_gathered(input_data, use_gather_object),
                             "gather_for_metrics")

    def reduce(self, tensor, reduction="sum", scale=1.0):
        fn = super().reduce
        return self._guarded(lambda: fn(tensor, reduction, scale), lambda: tensor, "reduce")

    def pad_across_processes(self, tensor, dim=0, pad_index=0, pad_first=False):
        fn = super().pad_across_processes
        return self._guarded(lambda: fn(tensor, dim=dim, pad_index=pad_index,
                                        pad_first=pad_first), lambda: tensor,
                             "pad_across_processes")

    def wait_for_everyone(self):
        if not self._driver.may_communicate():
            return  # a replacement before the loop: nobody waits for it there
        fn = super().wait_for_everyone
        return self._guarded(fn, lambda: None, "wait_for_everyone")

    @contextlib.contextmanager
    def main_process_first(self):
        if not self._driver.may_communicate():
            yield  # a replacement before the loop: the data is prepared already
            return
        with super().main_process_first():
            yield

    @contextlib.contextmanager
    def local_main_process_first(self):
        if not self._driver.may_communicate():
            yield
            return
        with super().local_main_process_first():
            yield

    @property
    def is_local_main_process(self):
        """The lowest rank of each node. accelerate asks LOCAL_RANK, which on a GPU is the device
        slot: a spare that took over a node's first rank sits in another slot, and without this
        no process of that node would print after the recovery."""
        if isinstance(self.job, PlainJob):
            return super().is_local_main_process
        return self.job.rank % max(1, self.job.spec.ranks_per_node) == 0

    def print(self, *args, sep=" ", end="\n", file=None, flush=False):
        """Print on each node's lowest rank, as one write: the builtin writes each argument and
        the newline separately, and another process writing to the same pipe at that moment
        (a peer's last line, the supervisor's) could land between them and split the line."""
        if self._void or not self.is_local_main_process:  # a void pass's figures are stand-ins
            return
        out = file if file is not None else sys.stdout
        out.write(sep.join(str(a) for a in args) + end)
        if flush:
            out.flush()

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None):
        if not self._void:
            return super().log(values, step=step, log_kwargs=log_kwargs)

    # ---- prepare: the same objects, protected --------------------------------------------------
    def _protect(self, base: str, obj) -> None:
        if self._driver.started:
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
            opt.__class__ = _Optimizer
            opt._checkpointless = self
            self._protect("optimizer", opt.optimizer)  # its step hook marks an applied update
            if self.scaler is not None and not hasattr(self.scaler, "_checkpointless"):
                self.scaler._checkpointless = True
                self._protect("grad_scaler", self.scaler)
        return opt

    def prepare_scheduler(self, scheduler):
        sched = super().prepare_scheduler(scheduler)
        if type(sched) is AcceleratedScheduler:
            sched.__class__ = _Scheduler
            sched._checkpointless = self
            self._protect("scheduler", sched.scheduler)
        return sched

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        dl = super().prepare_data_loader(data_loader, device_placement=device_placement,
                                         slice_fn_for_dispatch=slice_fn_for_dispatch)
        if type(dl) is not DataLoaderShard:
            return dl
        loader = _Loader.__new__(_Loader)  # the same loader; its evaluation loops end when void
        loader.__dict__.update(dl.__dict__)
        loader._checkpointless = self
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


class _LoopPosition:
    """Where the loop stands, protected with the model: the epoch and the committed step at which
    it began. The next epoch waits in `pending` until its first step commits (see the module
    docstring: an evaluation cut short is run again)."""

    def __init__(self):
        self.epoch = 0
        self.epoch_start = 0
        self.pending: tuple[int, int] | None = None

    def current(self) -> tuple[int, int]:
        return self.pending or (self.epoch, self.epoch_start)

    def commit(self) -> None:
        if self.pending is not None:
            (self.epoch, self.epoch_start), self.pending = self.pending, None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "epoch_start": self.epoch_start}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.epoch_start = int(state["epoch"]), int(state["epoch_start"])
        self.pending = None


def check_loader(loader, what: str = "batches") -> None:
    """Refuse, in `batches()`, a loader whose batches a replacement could not find again."""
    if not isinstance(loader, DataLoaderShard):
        raise TypeError(f"accelerator.{what}(): got {type(loader).__name__}; pass a DataLoader "
                        "returned by accelerator.prepare()")
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError(f"accelerator.{what}(): the loader reads an IterableDataset, which has "
                        "no index a replacement could resume at; use a map-style dataset")
    sampler = loader.batch_sampler
    while hasattr(sampler, "batch_sampler"):
        sampler = sampler.batch_sampler
    sampler = getattr(sampler, "sampler", None)
    if not isinstance(sampler, ORDERED):
        raise TypeError(f"accelerator.{what}(): the loader's order comes from a "
                        f"{type(sampler).__name__}, which a replacement cannot draw again; use "
                        "shuffle=True / False, or a DistributedSampler")


class _Cursor:
    """One epoch's batches of a prepared loader, asked for by index: the next, the same again (a
    redone step), or further on (a replacement, a survivor brought forward by its peers)."""

    def __init__(self, loader: DataLoaderShard, epoch: int):
        self.loader, self.epoch = loader, epoch
        self.it = self.owner = None
        self.taken = 0
        self.last = END

    def batch(self, index: int):
        if index == self.taken - 1 and self.last is not END:
            return self.last
        if self.it is None or not 0 <= index - self.taken <= 2:
            self.close()
            self._open(index)
        while self.taken < index:
            next(self.it, None)
            self.taken += 1
        self.last = next(self.it, END)
        self.taken += 1
        return self.last

    def _open(self, skip: int) -> None:
        self.loader.set_epoch(self.epoch)  # the sampler's epoch, shared with a skipping copy
        self.owner = self.loader if skip == 0 else skip_first_batches(self.loader, skip)
        self.owner.iteration = self.epoch
        self.it, self.taken = DataLoaderShard.__iter__(self.owner), skip

    def close(self) -> None:
        if self.it is not None:
            self.it.close()
            self.owner.end()  # off accelerate's stack of active loaders (a no-op when it ended)
        self.it = self.owner = None


class _Loader(DataLoaderShard):
    """A prepared loader whose plain iteration (an evaluation loop) ends after the batch in hand
    once the body is void, instead of running every remaining batch for nothing."""

    _checkpointless: Accelerator

    def __iter__(self):
        it = DataLoaderShard.__iter__(self)
        finished = False
        try:
            for batch in it:
                yield batch
                if self._checkpointless._void:
                    return
            finished = True
        finally:
            if not finished:
                it.close()
                self.end()

    def __reduce__(self):
        return DataLoaderShard.__reduce__(self)


class _Optimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper; no update in a void pass (its gradients were not summed)."""

    _checkpointless: Accelerator

    def step(self, closure=None):
        if self._checkpointless._void:
            return None
        return super().step(closure)


class _Scheduler(AcceleratedScheduler):
    """accelerate's scheduler wrapper; it moves only with an update that was applied."""

    _checkpointless: Accelerator

    def step(self, *args, **kwargs):
        accel = self._checkpointless
        if accel._void and not accel._driver.update_applied():
            return None
        return super().step(*args, **kwargs)


class _Supervised:
    """The loop's turns on a supervised Job: recovery, commits, faults, the step's phase."""

    def __init__(self, accel: Accelerator):
        self.accel, self.job = accel, accel.job
        self.rec = self.job._rec
        self.started = False
        self.fresh = self.job.is_replacement  # knows nothing of the loop until it is restored
        # a recovery outside the loop (in end_training's checks) agrees on the loop's position
        # as the replacement does when it starts, so both meet the same collectives
        self.job.on_recovered = self._agree

    def start(self) -> None:
        self.job._start()
        self.started = True
        if self.rec.gen > 0 and self.rec.phase is Phase.TRAINING:
            self._agree(self.rec.completed)  # as the survivors do after their restore

    def may_communicate(self) -> bool:
        return self.started or not self.job.is_replacement

    def completed(self) -> int:
        return self.rec.completed

    def failed(self) -> bool:
        return self.rec.phase is Phase.FAILED

    def turn(self) -> int:
        """Recover if a peer failed; after a recovery the agreed state decides where the loop
        stands (see `_agree`)."""
        while True:
            gen, before = self.rec.gen, self.rec.completed
            step = self.job._turn()
            if self.rec.gen == gen:
                return step
            self.accel._void = False
            if self._agree(before):
                return self.rec.completed

    def _agree(self, before: int) -> bool:
        """After a restore: the move to the next epoch that waits for its first commit stands if
        every member that kept its own state (not a spare, not a survivor brought forward) had
        finished the epoch's body; otherwise that body (its evaluation) runs again everywhere.
        False when a peer failed meanwhile (recover again)."""
        loop, rec = self.accel._loop, self.rec
        if self.fresh or rec.completed != before:
            mine = -1  # its position came from a peer: no say
        else:
            mine = int(loop.pending == (loop.epoch + 1, rec.completed))
        got = [torch.zeros(1, dtype=torch.int64) for _ in range(rec.world_size)]
        try:
            with communicating("agreeing on the loop's epoch"):
                dist.all_gather(got, torch.tensor([mine], dtype=torch.int64))
        except Exception as exc:
            if not rec.is_peer_failure(exc):
                self.report(exc)
                raise
            rec.fail()
            return False
        said = [int(g) for g in got if int(g) >= 0]
        done = bool(said) and all(said)
        loop.pending = (loop.epoch + 1, rec.completed) if done else None
        self.fresh = False
        return True

    def ready(self, step: int) -> bool:
        return self.job._ready(step)  # heartbeat, due kill/hang faults, replicas, consistency

    def open_step(self, step: int) -> None:
        job = self.job
        job._state.update_applied = False
        job.seed_step(step)  # a redone step draws the same random numbers (dropout)
        try:
            job._injector.raise_due(self.rec.rank, step)
        except InjectedFault as exc:
            report_error(job.store, job.worker_id, exc)
            raise

    def close_step(self) -> bool:
        """Whether the step just run commits: it ended without a failure, or its update landed
        before the failure (then it stands, and the recovery follows at the next turn)."""
        return not self.failed() or self.job._state.update_applied

    def commit(self) -> None:
        self.rec.commit(self.job._step_t0)

    def update_applied(self) -> bool:
        return self.job._state.update_applied

    def to_user(self, in_body: bool) -> None:
        if in_body and self.rec.phase is Phase.TRAINING:
            self.rec.phase = Phase.IN_STEP  # the watch thread may abort a collective stuck here

    def to_library(self) -> None:
        if self.rec.phase is Phase.IN_STEP:
            self.rec.phase = Phase.TRAINING

    def absorb(self, exc: BaseException, what: str) -> bool:
        if self.rec.phase is not Phase.IN_STEP and not self.failed():
            return False
        if self.rec.is_peer_failure(exc):
            self.rec.fail()
            print(f"[checkpointless] rank {self.rec.rank}: a peer was lost during {what}; the "
                  "rest of this pass is void and it is run again after the recovery",
                  file=sys.stderr, flush=True)
            return True
        return False

    def report(self, exc: BaseException) -> None:
        report_error(self.job.store, self.job.worker_id, exc)


class _Plain:
    """The same turns under torchrun: no recovery, a failure ends the job."""

    def __init__(self, accel: Accelerator):
        self.accel, self.job = accel, accel.job
        self.steps = 0
        self.started = False

    def start(self) -> None:
        self.started = True

    def may_communicate(self) -> bool:
        return True

    def completed(self) -> int:
        return self.steps

    def failed(self) -> bool:
        return False

    def turn(self) -> int:
        return self.steps

    def ready(self, step: int) -> bool:
        return True

    def open_step(self, step: int) -> None:
        self.job.seed_step(step)

    def close_step(self) -> bool:
        return True

    def commit(self) -> None:
        self.steps += 1

    def update_applied(self) -> bool:
        return False

    def to_user(self, in_body: bool) -> None:
        pass

    def to_library(self) -> None:
        pass

    def absorb(self, exc: BaseException, what: str) -> bool:
        return False

    def report(self, exc: BaseException) -> None:
        pass
