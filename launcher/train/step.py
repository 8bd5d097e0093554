"""The step strategies of a job whose every process is its own data-parallel rank: ddp
(`DataParallel`) and FSDP2 (`Sharded`); strategy.py chooses among these and the others."""
from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from checkpointless.worker import full_tensor

from launcher.train.model_setup import cpu_threads
from launcher.train.tensor_parallel import clip_grad_norm_ as tp_clip_grad_norm_


def catch_up_threads(run) -> int | None:
    """A replacement the survivors wait on (they redo the step from kept gradients) may use
    their idle CPU cores; None: the thread count stays."""
    job = run.job
    return run.catch_up_threads // job.catching_up if job.catching_up else None


class DataParallel:
    """Every rank a whole replica (ddp)."""

    def gradients_and_norm(self, run, step: int, max_norm: float):
        loss = self.gradients(run, step)
        return loss, self.clip(run, max_norm)

    def forward_backward(self, run, step: int) -> torch.Tensor:
        """This rank's micro-batches; their summed loss. Earlier micro-batches accumulate
        locally and the last backward reduces them all (accelerate's no_sync: the buckets' own
        switch under ddp; FSDP2 has none and reduce-scatters each). The last micro-batch is
        known by its index, not by accelerate's counter: a redone step or a replacement's first
        step would find that count mid-step. A survivor redoing a step cut short by a peer's
        failure still holds its gradients and computes nothing (`grads_kept`)."""
        job, accelerator, wrapped = run.job, run.accelerator, run.wrapped
        accum = run.cfg.trainer.grad_accum_steps
        loss_sum = torch.zeros(1, device=accelerator.device)
        # summed with the last gradient bucket when the buckets reduce during backward
        hook = wrapped.reduce_with if run.overlapped else None
        with cpu_threads(catch_up_threads(run)):
            for micro in range(0 if job.grads_kept else accum):
                last = micro == accum - 1
                with nullcontext() if last else accelerator.no_sync(wrapped):
                    run.micro(wrapped, step, job.data_rank, job.data_world, micro, loss_sum,
                              before_backward=hook if last else None)
        return loss_sum

    def gradients(self, run, step: int) -> torch.Tensor:
        """Averaged in one fixed order (the buckets', or one flat all-reduce): the loss too."""
        loss_sum = self.forward_backward(run, step)
        return run.job.all_reduce_grads(run.model.parameters(), extra=loss_sum)

    def clip(self, run, max_norm: float):
        """torch's clip_grad_norm_ through accelerate (unscaled first under fp16)."""
        return full_tensor(run.accelerator.clip_grad_norm_(run.model.parameters(), max_norm))


class Sharded(DataParallel):
    """FSDP2 over the job's mesh (fsdp, hsdp; tensor parallel inside it)."""

    def gradients(self, run, step: int) -> torch.Tensor:
        """FSDP2 averaged the gradients; the loss needs its own collective."""
        loss_total = self.forward_backward(run, step)  # a fresh tensor: summed in place
        dist.all_reduce(loss_total)
        return loss_total

    def clip(self, run, max_norm: float):
        """Under tensor parallel over gradients on two meshes (tensor_parallel.py)."""
        if run.cfg.distributed.tp_size > 1:
            return full_tensor(tp_clip_grad_norm_(run.model.parameters(), max_norm))
        return super().clip(run, max_norm)

