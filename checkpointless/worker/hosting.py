"""A process's logical ranks (checkpointless.shrink; the placement is logical.py's).

A job keeps the logical world it was launched with, L = its number of ranks. With no spare ready
for a lost rank, the supervisor shrinks the job: a survivor hosts the lost logical rank as well,
runs its micro-batches with its data share and its random streams, and keeps its gradient apart
from its own until the reduction. This is what a loop reads for that (mixed into `Job`), and the
reduction of the hosted contributions:

    for r in job.logical_ranks:                         # (r,) = (job.rank,) until a shrink
        job.seed_step(step, micro, share=r)
        ...forward and backward on batch(step, r, job.logical_world, micro)...
        contributions[r] = job.flat_grads(params, extra=loss_sum)   # the grads are cleared
    loss_total = job.reduce_logical(params, contributions)         # averaged into the .grads

or, in one call that also reuses what a redone step kept, `job.reduce_by_logical_rank(params,
step, compute)` with `compute(r)` running logical rank r's micro-batches and returning its loss.

`shrink=exact`: every process sums the L contributions in logical order (logical.py), the
failure-free run included, so a shrunk run ends with its bits. `shrink=fast`: a process sums its
hosted ranks in logical order, then one plain all-reduce over the processes; the batch is the
same, the summation order is not, and the bits may differ from the failure-free run's.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .failures import communicating
from .logical import Placement, logical_all_reduce


class LogicalRanks:
    """Mixed into `Job` (and torchrun's `PlainJob`, which never shrinks): reads the generation's
    seat (`_seat()`), and keeps each contribution until the step commits (`_kept`)."""

    def _seat(self):
        rec = getattr(self, "_rec", None)
        return rec.plan if rec is not None else None

    @property
    def logical_ranks(self) -> tuple[int, ...]:
        """The logical ranks this process runs this generation, lowest first."""
        seat = self._seat()
        return seat.logical_ranks if seat is not None else (self.rank,)

    @property
    def logical_world(self) -> int:
        """The job's logical world: the ranks it was launched with, whoever runs them now."""
        seat = self._seat()
        return seat.logical_size if seat is not None else self.world_size

    @property
    def placement(self) -> Placement:
        seat = self._seat()
        if seat is None or not seat.placement:
            return Placement.identity(self.world_size)
        return Placement(self.logical_world, seat.placement)

    @property
    def shrunk(self) -> bool:
        """Fewer processes than logical ranks run this generation."""
        return self.world_size < self.logical_world

    def kept_contribution(self, step: int, logical: int) -> torch.Tensor | None:
        """`logical`'s contribution to `step` computed before a peer's failure cut the step
        short, while the state is still that step's: a redo computes only the ranks it lacks
        (a replacement's, or those a shrink moved here)."""
        kept = getattr(self, "_kept", None)
        return kept.contribution(step, logical) if kept is not None else None

    def flat_grads(self, params, extra: torch.Tensor | None = None,
                   keep: tuple[int, int] | None = None) -> torch.Tensor:
        """One hosted rank's contribution: its gradients in parameter order (zeros for a
        parameter it left without one) and `extra` after them, as one float32 buffer; the
        `.grad`s are cleared for the next hosted rank's backward. `keep`: (step, logical rank)
        to keep it under until the step commits (kept_contribution)."""
        params = [p for p in params if p.requires_grad]
        parts = [p.grad.reshape(-1).float() if p.grad is not None else
                 torch.zeros(p.numel(), device=p.device) for p in params]
        if extra is not None:
            parts.append(extra.detach().reshape(-1).float())
        flat = torch.cat(parts)
        for p in params:
            p.grad = None
        kept = getattr(self, "_kept", None)
        if keep is not None and kept is not None:
            kept.keep_contribution(*keep, flat)
        return flat

    def reduce_by_logical_rank(self, params, step: int, compute, exact: bool = True):
        """A step's gradients by logical rank, in one call: for each hosted logical rank `r`
        this process has not computed yet for `step` (a redo keeps what was computed before a
        peer's failure cut the step short), `compute(r)` runs its forward and backward and
        returns its summed loss; its gradients are kept apart, then averaged over the logical
        world into the `.grad`s. Returns the loss summed over every logical rank."""
        params = [p for p in params if p.requires_grad]
        contributions = {}
        for r in self.logical_ranks:
            kept = self.kept_contribution(step, r)
            if kept is not None:
                contributions[r] = kept
                continue
            for p in params:  # a redone step (or the last hosted rank) leaves nothing behind
                p.grad = None
            contributions[r] = self.flat_grads(params, extra=compute(r), keep=(step, r))
        return self.reduce_logical(params, contributions, exact=exact)

    def reduce_logical(self, params, contributions: dict[int, torch.Tensor], exact: bool = True,
                       extra_numel: int = 1) -> torch.Tensor:
        """Sum the hosted ranks' `contributions` over the whole logical world (exact: in
        logical order; else: hosted ones in logical order, then over the processes), write the
        gradients' average into the `.grad`s, and return the summed extra (the last
        `extra_numel` values). The `.grad`s are written only once the collective succeeded, and
        the contributions are left as they were (kept for a redo)."""
        params = [p for p in params if p.requires_grad]
        total = (logical_all_reduce(contributions, self.placement) if exact
                 else self._fast_sum(contributions))
        extra = total[total.numel() - extra_numel:].clone()
        grads = total[:total.numel() - extra_numel].div_(self.logical_world)
        offset = 0
        for p in params:  # views of the one sum, as the ddp buckets' (a copy where the dtype
            n = p.numel()  # differs)
            p.grad = grads[offset:offset + n].view_as(p).to(p.dtype)
            offset += n
        return extra

    def _fast_sum(self, contributions: dict[int, torch.Tensor]) -> torch.Tensor:
        ranks = sorted(contributions)
        total = contributions[ranks[0]].clone()
        for r in ranks[1:]:
            total.add_(contributions[r])
        if self.world_size > 1:
            with communicating("gradient all-reduce"):
                dist.all_reduce(total)
        return total
