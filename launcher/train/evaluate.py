"""Validation loss and perplexity over a fixed set of rows, the same figure at any world size.

The set is the validation data's first `eval.max_batches x trainer.micro_batch_size` rows.
Rank r takes rows r, r + W, r + 2W, ...; for each row it sums the token losses (in float64) and
counts the tokens that carry a label. Every row's pair lands in its own slot of one tensor, zero
elsewhere, and one all-reduce fills every slot on every rank (adding zeros is exact); the totals
are then summed over the slots in row order. So the result depends on the world size only through
the float rounding of each row's forward pass (rows batched with other rows), not through the order
of any sum.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from launcher.data.sampler import batch_of, to_device


@torch.no_grad()
def evaluate(model, ds, rows: list[int], rank: int, world: int, batch_size: int, device,
             autocast, adds: bool = True) -> dict:
    """{"eval_loss", "eval_ppl", "eval_tokens"} over `rows` of `ds`; a collective. `rank` and
    `world` are data-parallel; a rank that `adds` nothing (a tp group's other ranks, which
    compute the same rows) runs the same passes and adds zeros."""
    slots = torch.zeros(len(rows), 2, dtype=torch.float64)
    mine = list(range(rank, len(rows), world))
    was_training = model.training
    model.eval()
    # every rank runs the same number of forward passes (a sharded model gathers its
    # parameters in each): a rank out of rows runs one on row 0 and keeps nothing from it
    passes = math.ceil(math.ceil(len(rows) / world) / batch_size)
    try:
        for i in range(passes):
            chunk = mine[i * batch_size:(i + 1) * batch_size]
            batch = to_device(batch_of(ds, [rows[j] for j in chunk or [0]]), device)
            labels = batch.pop("labels")
            with autocast:
                logits = model(**batch).logits
            if not chunk:
                continue
            # token t predicts token t + 1, as the training loss counts it
            logits, labels = logits[:, :-1].double(), labels[:, 1:]
            loss = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100,
                                   reduction="none")
            counted = labels != -100
            slots[chunk, 0] = (loss * counted).sum(dim=1).cpu()
            slots[chunk, 1] = counted.sum(dim=1).double().cpu()
    finally:
        model.train(was_training)
    if not adds:
        slots.zero_()
    if dist.is_initialized() and dist.get_world_size() > 1:
        on_device = slots.to(device)
        dist.all_reduce(on_device)
        slots = on_device.cpu()
    total, tokens = float(slots[:, 0].sum()), float(slots[:, 1].sum())
    loss = total / tokens if tokens else float("nan")
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), "eval_tokens": int(tokens)}
