"""Serve the prepared data by step, in the worker.

The position is a pure function: the rows a rank trains on at global step S follow from
(seed, S, rank, world size, micro-batch) alone, so a run resumed or recovered at any step sees
exactly the batches of an uninterrupted run, none lost, none repeated.
"""
from __future__ import annotations

import torch


def eval_rows(ds, max_batches: int, micro_batch_size: int) -> list[int]:
    """The validation rows: the first min(len(ds), max_batches * micro_batch_size), the same set
    at any world size (ranks split it, see launcher/train/evaluate.py)."""
    return list(range(min(len(ds), max_batches * micro_batch_size)))


class StepSampler:
    """Maps (step, rank, world, micro) to rows of the packed dataset, epoch after epoch.

    Global step S consumes positions [S*G, (S+1)*G) of an endless stream, G being the global batch
    in sequences; position p is row perm_e[p mod n] of epoch e = p // n, perm_e a permutation
    seeded by (seed, e).
    """

    def __init__(self, dataset, seed: int, micro_batch_size: int, grad_accum_steps: int):
        self.ds = dataset
        self.n = len(dataset)
        self.seed = seed
        self.mbs = micro_batch_size
        self.accum = grad_accum_steps
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(self.n, generator=g)}
        return self._perms[epoch]

    def positions(self, step: int, rank: int, world: int, micro: int) -> list[int]:
        global_batch = world * self.accum * self.mbs
        start = step * global_batch + (micro * world + rank) * self.mbs
        return list(range(start, start + self.mbs))

    def batch(self, step: int, rank: int, world: int, micro: int = 0) -> dict:
        """The model inputs of (step, rank, micro): see `batch_of`."""
        rows = [int(self._perm(p // self.n)[p % self.n]) for p in
                self.positions(step, rank, world, micro)]
        return batch_of(self.ds, rows)


def batch_of(ds, rows: list[int]) -> dict:
    """Keyword arguments of the model's forward for these rows: input_ids and labels (-100
    where a token carries no loss; the input ids themselves for raw text), plus position_ids
    (packed examples: positions restart at each one, which also keeps attention inside it) or
    attention_mask (padded examples) when the rows have them. The cache is off: training."""
    got = ds[rows]
    ids = got["input_ids"].long()  # raw-text rows are stored as int32; models index with int64
    out = {"input_ids": ids, "use_cache": False}
    out["labels"] = got["labels"] if "labels" in got else ids
    for key in ("position_ids", "attention_mask"):
        if key in got:
            out[key] = got[key]
    return out


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
