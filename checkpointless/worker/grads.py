"""Gradient averaging in one fixed layout.

DDP regroups its buckets after the first iteration, so a DDP wrapped anew after a recovery sums in
a different order and the result differs in the last bit. One flat buffer in parameter order,
all-reduced once, reduces the same way in every generation: a recovered run keeps the failure-free
bits. It is also one collective per step, the cheapest shape for gloo.

The gradients are written back only once every collective has succeeded: when a peer dies in the
middle, each `.grad` still holds this rank's own local gradient, which a survivor can reuse when
the step is redone (see `Job.grads_kept`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .audit import checksum
from .failures import communicating


def all_reduce_grads(params, world_size: int, extra: torch.Tensor | None = None, group=None):
    """Average the gradients of `params` across ranks in place.

    `extra` (a small float tensor, e.g. the summed loss) rides along in the same collective and is
    returned summed, so no other collective is needed in the step.
    """
    params = [p for p in params if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    rides = extra is not None and torch.float32 in by_dtype
    reduced = []
    for dtype, gs in by_dtype.items():
        pieces = [g.reshape(-1) for g in gs]
        if rides and dtype == torch.float32:
            pieces.append(extra.reshape(-1).to(dtype))
        flat = torch.cat(pieces)  # a copy: the .grad tensors are untouched until the end
        with communicating("gradient all-reduce"):
            dist.all_reduce(flat, group=group)
        reduced.append((dtype, gs, flat))
    summed_extra = None
    if extra is not None and not rides:
        summed_extra = extra.detach().clone().float()
        with communicating("all-reduce of the step's extra values"):
            dist.all_reduce(summed_extra, group=group)
    for dtype, gs, flat in reduced:
        if rides and dtype == torch.float32:
            summed_extra = flat[-extra.numel():].clone()
            flat = flat[:-extra.numel()]
        flat.div_(world_size)
        offset = 0
        for g in gs:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n
    return summed_extra


class KeptGrads:
    """This rank's own gradients of the step in flight, kept until its all-reduce succeeds.

    When a peer dies in the middle of the all-reduce, a survivor redoing the same step (same
    state, rank and world size) can reuse them instead of recomputing forward and backward. They
    are kept by reference, not copied: the all-reduce sums in a copy and writes back only once
    every collective succeeded.
    """

    def __init__(self):
        self._kept: dict | None = None
        # checkpointless.shrink=exact: each hosted logical rank's contribution (hosting.py), by
        # logical rank, of the step in `_logical_step`; valid while the state is that step's
        self._logical: dict = {}
        self._logical_step = -1
        # the redo check (rehearsal.py): told (step, what) when a step this rank recomputes
        # after a recovery differs from what it had computed of it before the failure
        self.on_redo_mismatch = None

    def reusable(self, step: int, rank: int, world: int) -> bool:
        """This rank redoes `step` from what it kept: its gradients, or (shrink=exact) the
        contributions of its logical ranks. Said in the recovery's record and counted by the
        restore (a replacement the others wait on may take their idle cores)."""
        return self.usable(step, rank, world) or (step == self._logical_step
                                                  and bool(self._logical))

    def contribution(self, step: int, logical: int):
        """The kept contribution of `logical` to `step`, or None."""
        return self._logical.get(logical) if step == self._logical_step else None

    def keep_contribution(self, step: int, logical: int, flat) -> None:
        if step != self._logical_step:
            self._logical, self._logical_step = {}, step
        self._logical[logical] = flat

    def usable(self, step: int, rank: int, world: int) -> bool:
        k = self._kept
        return k is not None and (k["step"], k["rank"], k["world"]) == (step, rank, world)

    def drop(self) -> None:
        self._kept = None
        self._logical, self._logical_step = {}, -1

    def remember(self, step: int, rank: int, world: int, grads, extra=None) -> None:
        """Keep references to this rank's own gradients of `step` and its `extra` (the bucketed
        all-reduce of checkpointless.DistributedDataParallel calls this before it sums)."""
        self._check_redo(step, rank, world, list(grads))
        self._kept = {"step": step, "rank": rank, "world": world, "grads": list(grads),
                      "extra": extra}

    def _check_redo(self, step: int, rank: int, world: int, grads) -> None:
        """A step recomputed although this rank kept its gradients of it (a survivor whose loop
        recomputes after a recovery): the same state, step and batch must give the same bits. A
        difference means the step cannot be replayed (a batch drawn outside it, ...): said, for
        the report; nothing else changes. Free on a step that is not redone."""
        if not self.usable(step, rank, world) or self.on_redo_mismatch is None:
            return
        before = [(id(p), checksum(g)) for p, g in self._kept["grads"]]
        now = [(id(p), checksum(g)) for p, g in grads if g is not None]
        if sorted(before) != sorted(now):
            self.on_redo_mismatch(step, "gradients")

    def restore(self):
        """Put the kept gradients back on their parameters; returns the kept `extra`."""
        for p, g in self._kept["grads"]:
            p.grad = g
        return self._kept["extra"]

    def all_reduce(self, params, step: int, rank: int, world: int,
                   extra: torch.Tensor | None = None):
        """`all_reduce_grads`, reusing the kept gradients when the loop skipped the compute."""
        params = list(params)
        if self.usable(step, rank, world) and all(p.grad is None for p in params):
            extra = self.restore()
        else:
            self._check_redo(step, rank, world, [(p, p.grad) for p in params])
            self._kept = {"step": step, "rank": rank, "world": world,
                          "grads": [(p, p.grad) for p in params if p.grad is not None],
                          "extra": None if extra is None else extra.detach().clone()}
        out = all_reduce_grads(params, world, extra)
        self._kept = None
        return out


def all_reduce_extra(extra: torch.Tensor | None):
    """`extra` summed over the ranks, in its own small collective (None stays None)."""
    if extra is None:
        return None
    summed = extra.detach().clone().float()
    with communicating("all-reduce of the step's extra values"):
        dist.all_reduce(summed)
    return summed


def summed_extra(ddp, extra: torch.Tensor | None):
    """The step's `extra` summed over the ranks: the sum a checkpointless.DistributedDataParallel
    made with its gradient reduction (`reduce_with`), taken once, or else a sum made now."""
    if ddp is not None and ddp.extra_sum is not None:
        summed, ddp.extra_sum = ddp.extra_sum, None
        return summed
    return all_reduce_extra(extra)


def stage_all_reduce(params, group, extra: torch.Tensor | None = None):
    """Pipeline parallel: average over the stage's data-parallel ranks (`group`; None when the
    stage has one) and return `extra` summed over them. Nothing is kept for a redo: a pipeline's
    step is redone whole by every stage, whose activations the replacement needs."""
    if group is None:
        return None if extra is None else extra.detach().clone().float()
    return all_reduce_grads(params, dist.get_world_size(group), extra, group=group)
