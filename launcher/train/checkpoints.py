"""Durable checkpoints of the recipe loop: the fallback for what peer redundancy cannot cover,
and what `checkpoint.resume=auto` continues from.

Sharded (checkpointless/worker/durable.py): each rank writes its own part of the model and optimizer
state in the background; `step-<n>/` appears only once every part is on disk. The state is
saved with its sharding (DTensors under fsdp, plain tensors under ddp, written once) and loaded
into whatever sharding the loading job has, so a job stopped at 4 workers resumes at 2 or 8.
"""
from __future__ import annotations

from pathlib import Path

from checkpointless.worker import durable


class CheckpointMismatch(RuntimeError):
    """The checkpoint directory holds something this run cannot continue from."""


class DurableCheckpoints:
    """Every `checkpoint.interval` steps the state goes to disk (every rank its part, async)."""

    def __init__(self, cfg, job, model, optimizer, scaler=None):
        self.cfg, self.job, self.model, self.optimizer = cfg, job, model, optimizer
        # under fp16 the GradScaler's scale and growth tracker are training state: a resume
        # that restarted them would scale (and skip) differently from the run that never stopped
        self.scaler = scaler
        self.writer = durable.ShardedCheckpoints(cfg.checkpoint.dir, cfg.checkpoint.keep)

    def state(self, step: int) -> dict:
        """Model and optimizer state as this rank holds it (no gather: shards under fsdp)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model, optim = get_state_dict(self.model, self.optimizer)
        state = {"model": model, "optimizer": optim, "step": step}
        if self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()  # plain numbers, the same on all ranks
        return state

    def save(self, step: int) -> None:
        """A collective (planning; every rank, the same step); the write goes on in a thread.
        Before the first update (audits' step-0 checkpoint) the optimizer has no state yet and
        none is written: DCP would make one with a step of its own, which the training that
        follows would then count (Adam's bias correction), leaving the failure-free bits."""
        if not self.optimizer.state:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict
            state = {"model": get_model_state_dict(self.model), "step": step}
        else:
            state = self.state(step)
        self.writer.save(step, state, gen=self.job.gen)

    def load(self, path) -> int:
        """Load checkpoint `path` at this job's world size and strategy (a collective)."""
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                             set_model_state_dict, set_state_dict)
        if not any(k.startswith("optimizer.") for k in durable.saved_shapes(path)):
            # written before the first update: the optimizer starts empty, as it did then
            state = {"model": get_model_state_dict(self.model), "step": -1}
            refuse_another_model(path, state["model"])
            durable.load(path, state)
            set_model_state_dict(self.model, state["model"])
            self.optimizer.state.clear()
            return int(state["step"])
        state = self.state(-1)
        saved = refuse_another_model(path, state["model"])
        if "grad_scaler" in state and "grad_scaler.scale" not in saved:
            state.pop("grad_scaler")  # written by a run without fp16: the scaler starts fresh
            if self.job.rank == 0:
                print(f"[launcher] {path} holds no GradScaler state (written without fp16): "
                      "the loss scale starts from its initial value", flush=True)
        durable.load(path, state)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        if "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])
        return int(state["step"])

    def newest_step(self, at_most: int | None = None):
        self.writer.wait()  # a write in flight finishes first: it may be the newest
        found = [s for s, _ in durable.list_checkpoints(self.cfg.checkpoint.dir)
                 if at_most is None or s <= at_most]
        return found[-1] if found else None

    def drop_after(self, step: int) -> None:
        """A rewind to `step` (audit.py): the checkpoints after it hold a state found wrong."""
        if self.job.rank == 0:
            gone = durable.remove_after(self.cfg.checkpoint.dir, step)
            if gone:
                print(f"[launcher] removed the checkpoints of steps {gone}, written after the "
                      "state went wrong", flush=True)

    def load_step(self, step: int) -> int:
        return self.load(Path(self.cfg.checkpoint.dir) / f"step-{step:08d}")

    def close(self) -> None:
        self.writer.wait()


def refuse_another_model(path, model_state: dict) -> dict:
    """Refuse a checkpoint of another model before any tensor is read, saying why and the fix.
    Returns the checkpoint's flattened keys and shapes."""
    saved = durable.saved_shapes(path)
    here = {f"model.{k}": tuple(v.shape) for k, v in model_state.items()}
    missing = [k for k in here if k not in saved]
    differ = [k for k in here if k in saved and saved[k] != here[k]]
    if not missing and not differ:
        return saved
    why = []
    if missing:
        why.append(f"{len(missing)} of this model's {len(here)} tensors are not in it "
                   f"(first: '{missing[0][6:]}')")
    if differ:
        k = differ[0]
        why.append(f"{len(differ)} have another shape (first: '{k[6:]}', {list(saved[k])} "
                   f"there, {list(here[k])} here)")
    raise CheckpointMismatch(
        f"checkpoint.resume=auto: {path} is a checkpoint of a different model: "
        f"{'; '.join(why)}. Fix: point checkpoint.dir at this recipe's own checkpoints, or "
        "start from scratch with checkpoint.resume=never (or an empty checkpoint.dir)")


def old_format_error(directory) -> str | None:
    """The message for a directory holding single-file checkpoints of earlier versions."""
    old = durable.old_format_files(directory)
    if not old:
        return None
    return (f"checkpoint.dir={directory} holds {old[-1].name}, a single-file checkpoint written "
            "before checkpoints were sharded (now step-<n>/ directories, one set of files per "
            "rank); checkpoint.resume=auto cannot continue from it. Fix: finish that run with the "
            "version that wrote it, or move those files away (or set checkpoint.resume=never) to "
            "start from scratch")


def durable_checkpoints(cfg, job, model, optimizer, scaler=None):
    """Set up checkpoints and, with checkpoint.resume=auto, continue from the newest one.

    The newest checkpoint is also the job's fallback when a lost slice has no copy in any
    peer's memory (a rank and all its replica holders lost together)."""
    c = cfg.checkpoint
    if c.interval <= 0 and c.resume == "never":
        return None
    ckpt = DurableCheckpoints(cfg, job, model, optimizer, scaler)
    job.set_fallback(ckpt.newest_step, ckpt.load_step, ckpt.drop_after)
    if not job.is_replacement and job.rank == 0:
        # a launch: no write of this job is in flight yet (the first save comes after a step,
        # which rank 0 joins after this), so every temporary directory is a dead write's
        durable.remove_partial(c.dir)
    if c.resume == "auto" and not job.is_replacement:
        if (msg := old_format_error(c.dir)) is not None:
            raise CheckpointMismatch(msg)
        found = durable.latest(c.dir)
        if found:
            step = ckpt.load(found[1])
            job.resume_at(step)
            if job.rank == 0:
                print(f"[launcher] resumed from checkpoint {found[1]} at step {step} "
                      f"({job.world_size} workers)", flush=True)
    return ckpt if c.interval > 0 else None
