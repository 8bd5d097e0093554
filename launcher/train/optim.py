"""The optimizer and its learning-rate schedule: pure functions of the recipe and the step, the
same in every process and after every recovery."""
from __future__ import annotations

import math

import torch


def lr_at(step: int, cfg) -> float:
    """Linear warm-up then cosine decay to lr * min_lr_ratio: a pure function of the step."""
    o, total = cfg.optim, cfg.trainer.max_steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_optimizer(model, cfg):
    """AdamW, with weight decay on matrices only (not on norms, biases)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    o = cfg.optim
    return torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
