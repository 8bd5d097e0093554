"""One micro-batch, forward and backward: the routine every step strategy runs (step.py,
logical_step.py), and the audit replay and a spare's warm-up too.

A micro-batch is (step, data share, micro index): its random streams are seeded from those, its
rows are the sampler's for them (a pure function of the step), its forward runs under the
recipe's autocast and its loss, scaled for gradient accumulation, goes backward. What differs
between the loop and a replay on a spare (which has no Accelerator yet) is only where the
seeding, the autocast and the backward come from; both are built below, side by side.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from checkpointless import step_seed
from checkpointless.worker import seed_all

from launcher.data.sampler import to_device


@dataclass(frozen=True)
class MicroBatch:
    sampler: object
    device: torch.device
    seed: Callable[[int, int, int], object]  # (step, micro, share): every generator seeded
    autocast: Callable[[], object]  # a fresh autocast context for the forward
    backward: Callable[[torch.Tensor], None]  # the loss / grad_accum_steps, backward

    @classmethod
    def of_loop(cls, job, accelerator, sampler) -> "MicroBatch":
        """The loop's: the job's seeds, accelerate's autocast and its backward (which divides
        by the accumulation steps and, under fp16, scales through the GradScaler)."""
        return cls(sampler, accelerator.device,
                   lambda step, micro, share: job.seed_step(step, micro, share=share),
                   accelerator.autocast, accelerator.backward)

    @classmethod
    def of_recipe(cls, cfg, sampler, device, seed=None) -> "MicroBatch":
        """Before a rank is held (a spare's audit replay or warm-up): the same seeds as the
        job's (`seed`: another rule, for the warm-up), autocast as accelerate sets it for
        trainer.precision, and the accumulation's scaling as accelerate's backward does it."""
        run_seed, accum = int(cfg.run.seed), cfg.trainer.grad_accum_steps
        bf16 = cfg.trainer.precision == "bf16"
        return cls(sampler, device,
                   seed or (lambda step, micro, share:
                            seed_all(step_seed(run_seed, step, share, micro))),
                   lambda: torch.autocast(device.type, dtype=torch.bfloat16) if bf16
                   else nullcontext(),
                   lambda loss: (loss / accum).backward())

    def batch(self, step: int, share: int, world: int, micro: int) -> dict:
        """The rows of data share `share` of `world` for (step, micro), on the device."""
        return to_device(self.sampler.batch(step, share, world, micro), self.device)

    def __call__(self, model, step: int, share: int, world: int, micro: int,
                 loss_sum: torch.Tensor, before_backward=None) -> None:
        """Seed, forward, add the loss to `loss_sum`, backward. `before_backward(loss_sum)`
        runs between the two (the buckets of checkpointless DDP take the sum with their last
        gradients)."""
        self.seed(step, micro, share)
        batch = self.batch(step, share, world, micro)
        with self.autocast():
            loss = model(**batch).loss
        loss_sum += loss.detach().float()
        if before_backward is not None:
            before_backward(loss_sum)
        self.backward(loss)
