"""Gradient averaging in one fixed layout.

DDP regroups its buckets after the first iteration, so a DDP wrapped anew after a recovery sums in
a different order and the result differs in the last bit. One flat buffer in parameter order,
all-reduced once, reduces the same way in every generation: a recovered run keeps the failure-free
bits. It is also one collective per step, the cheapest shape for gloo.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_grads(params, world_size: int, extra: torch.Tensor | None = None, group=None):
    """Average the gradients of `params` across ranks in place.

    `extra` (a small float tensor, e.g. the summed loss) rides along in the same collective and is
    returned summed, so no other collective is needed in the step.
    """
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    summed_extra = None
    for dtype, gs in by_dtype.items():
        pieces = [g.reshape(-1) for g in gs]
        if extra is not None and summed_extra is None and dtype == torch.float32:
            pieces.append(extra.reshape(-1).to(dtype))
        flat = torch.cat(pieces)
        dist.all_reduce(flat, group=group)
        if extra is not None and summed_extra is None and dtype == torch.float32:
            summed_extra = flat[-extra.numel():].clone()
            flat = flat[:-extra.numel()]
        flat.div_(world_size)
        offset = 0
        for g in gs:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n
    if extra is not None and summed_extra is None:
        summed_extra = extra.clone().float()
        dist.all_reduce(summed_extra, group=group)
    return summed_extra
