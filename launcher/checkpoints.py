"""Durable checkpoints of the recipe loop: the fallback for what peer redundancy cannot cover,
and what `checkpoint.resume=auto` continues from."""
from __future__ import annotations

from pathlib import Path

class DurableCheckpoints:
    """Every `checkpoint.interval` steps the full state goes to disk (rank 0 writes, async)."""

    def __init__(self, cfg, job, model, optimizer):
        from checkpointless.checkpoint import CheckpointWriter
        self.cfg, self.job, self.model, self.optimizer = cfg, job, model, optimizer
        self.writer = CheckpointWriter(cfg.checkpoint.dir, cfg.checkpoint.keep) \
            if job.rank == 0 else None

    def state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                              get_model_state_dict,
                                                              get_optimizer_state_dict)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {"model": get_model_state_dict(self.model, options=opts),
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=opts)}

    def save(self, step: int) -> None:
        state = self.state()  # a collective under fsdp: every rank takes part
        if self.writer:
            self.writer.save(step, state)

    def load(self, path) -> int:
        from checkpointless.checkpoint import load
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                              set_model_state_dict,
                                                              set_optimizer_state_dict)
        state = load(path)
        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, state["model"], options=opts)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=opts)
        return int(state["step"])

    def newest_step(self):
        from checkpointless.checkpoint import latest
        if self.writer:
            self.writer.wait()  # a write in flight finishes first: it may be the newest
        found = latest(self.cfg.checkpoint.dir)
        return found[0] if found else None

    def load_step(self, step: int) -> int:
        return self.load(Path(self.cfg.checkpoint.dir) / f"step-{step:08d}.pt")

    def close(self) -> None:
        if self.writer:
            self.writer.wait()


def durable_checkpoints(cfg, job, model, optimizer):
    """Set up checkpoints and, with checkpoint.resume=auto, continue from the newest one.

    The newest checkpoint is also the job's fallback when a lost slice has no copy in any
    peer's memory (a rank and all its replica holders lost together)."""
    c = cfg.checkpoint
    if c.interval <= 0 and c.resume == "never":
        return None
    ckpt = DurableCheckpoints(cfg, job, model, optimizer)
    if hasattr(job, "set_fallback"):
        job.set_fallback(ckpt.newest_step, ckpt.load_step)
    if c.resume == "auto" and not job.is_replacement:
        from checkpointless.checkpoint import latest
        found = latest(c.dir)
        if found:
            step = ckpt.load(found[1])
            job.resume_at(step)
            if job.rank == 0:
                print(f"[launcher] resumed from checkpoint {found[1]} at step {step}", flush=True)
    return ckpt if c.interval > 0 else None
