"""Tensor parallelism in the recipe loop (`distributed.tp_size`).

The split is the model's own: transformers' `base_model_tp_plan` (Llama, Qwen2, Mistral: q, k, v,
gate and up column-wise, o and down row-wise), applied with torch's DTensor styles
(`parallelize_module`) over the job's tp mesh dimension, before FSDP2 shards every parameter over
the data-parallel dimensions. Embeddings, norms and the output head stay whole on each tp rank
(replicated), so each rank of a tp group computes them alike from the same batch and seed.

The mesh is the job's (checkpointless/worker/mesh.py: its groups are rebuilt every generation with
the old names), so a replacement takes the lost rank's (dp_replicate, dp_shard, tp) coordinates
simply by taking its rank, and its slice comes from a twin or a peer copy like any FSDP slice.
"""
from __future__ import annotations

import fnmatch
import logging

import torch

from checkpointless.worker import full_tensor, is_dtensor, local_tensor



def apply(model: torch.nn.Module, tp_mesh) -> int:
    """Split the linear layers the model's plan names over `tp_mesh`; returns how many."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    base = getattr(model, getattr(model, "base_model_prefix", ""), None) or model
    plan = model.config.base_model_tp_plan
    styles = {}
    for name, _ in base.named_modules():
        for pattern, style in plan.items():
            if fnmatch.fnmatchcase(name, pattern):
                styles[name] = ColwiseParallel() if style == "colwise" else RowwiseParallel()
    parallelize_module(base, tp_mesh, styles)
    # DTensor warns on every norm of a 2-D mesh that it reduces one dimension after the other:
    # a fixed order, so every rank gets the same bits (clip_grad_norm_ below)
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return len(styles)


def clip_grad_norm_(parameters, max_norm: float) -> torch.Tensor:
    """Scale the gradients so that their global 2-norm is at most `max_norm`; the norm before.

    Under tensor parallel the gradients are DTensors on two meshes (split layers over dp x tp,
    replicated ones over dp alone) with several placements, which torch's clip cannot stack.
    Each set of one mesh and placements is normed by DTensor (its reductions on its own mesh),
    the squares are summed in parameter order, and every rank scales by the same factor: the
    replicated parameters' copies on a tp group stay equal."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = squared_norm(grads).sqrt()
    scale_by_clip(grads, total, max_norm)
    return total


def squared_norm(grads) -> torch.Tensor:
    """The square of the gradients' global 2-norm (fp32, on the CPU): each set of one mesh and
    placements normed by DTensor on its own mesh, the squares summed in parameter order."""
    sets: dict = {}
    for g in grads:
        sets.setdefault((g.device_mesh, tuple(g.placements)) if is_dtensor(g) else None,
                        []).append(g)
    squares = torch.zeros((), dtype=torch.float32)
    for same in sets.values():
        norm = full_tensor(torch.nn.utils.get_total_norm(same, 2.0))
        squares = squares + norm.detach().to("cpu", torch.float32) ** 2
    return squares


def scale_by_clip(grads, total: torch.Tensor, max_norm: float) -> None:
    """Scale every gradient (its local part) by the clip factor of norm `total`."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        local = local_tensor(g)
        local.mul_(coef.to(local.device, local.dtype))
