"""Replica consistency: every rank of a replicated job must hold the same bits, and it is checked.

Replicas can drift apart silently: a bug that runs one rank's update differently, a kernel whose
result depends on something other than its inputs, or silent data corruption in a device or its
memory. Every `consistency_every` steps each rank sums the raw bits of its parameters as integers
(exact and order-free, so any flipped bit changes it and thread counts do not) and the ranks
compare sums in one small all-gather. A rank that disagrees with the majority is named and leaves;
the supervisor replaces it like any failed worker and the replacement receives the majority's state.
Without a majority there is no telling which state is right, and the run stops.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .failures import communicating

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Diverged(RuntimeError):
    """This rank's parameters differ from the majority's: it must not train on."""


class NoMajority(RuntimeError):
    """The replicas disagree and no state is held by a majority of ranks."""


def params_checksum(modules) -> int:
    """Sum of every parameter's bits read as integers (wrapping at 64 bits)."""
    total = 0
    for m in modules:
        for p in m.parameters():
            t = p.detach()
            if t.numel() == 0:
                continue
            ints = t.reshape(-1).view(_INT_OF_SIZE[t.element_size()])
            total = (total + int(ints.sum(dtype=torch.int64))) & ((1 << 64) - 1)
    return total - (1 << 64) if total >= 1 << 63 else total


def gather(modules, world: int) -> list[int]:
    """Every rank's parameter checksum, by rank (one small all-gather)."""
    mine = torch.tensor([params_checksum(modules)], dtype=torch.int64)
    got = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    with communicating("comparing parameter checksums"):
        dist.all_gather(got, mine)
    return [int(g) for g in got]


# What makes replicas part after the start's broadcast, most likely first (said with a finding)
LIKELY_CAUSES = (
    "likely causes: something in the step that differs by rank (a branch on the rank, a random "
    "draw made outside the job's steps, which are seeded per step and rank, or a batch that is "
    "not each rank's own share), parameters changed outside the protected optimizer, a kernel "
    "whose result is not a function of its inputs alone, or silent corruption in a device or its "
    "memory")


def judge(sums: list[int], rank: int, step: int) -> list[int]:
    """The ranks that differ from the majority; raises Diverged on such a rank, NoMajority on
    every rank when no state is held by more than half of them."""
    counts = {s: sums.count(s) for s in set(sums)}
    if len(counts) == 1:
        return []
    majority = max(counts, key=counts.get)
    if counts[majority] * 2 <= len(sums):
        raise NoMajority(f"at step {step} the replicas disagree with no majority (parameter "
                         f"checksums by rank: {sums}); no state can be trusted over another. Every "
                         f"rank started from rank 0's state, so they parted since: "
                         f"{LIKELY_CAUSES}")
    odd = [r for r, s in enumerate(sums) if s != majority]
    if rank in odd:
        raise Diverged(f"rank {rank}'s parameters differ from the majority's at step {step} "
                       f"(checksum {sums[rank]} vs {majority} on ranks "
                       f"{[r for r, s in enumerate(sums) if s == majority]}); it leaves and a "
                       f"spare takes the majority's state. {LIKELY_CAUSES[0].upper()}"
                       f"{LIKELY_CAUSES[1:]}")
    return odd


def flip_a_bit(modules) -> None:
    """Silent data corruption, rehearsed: the top mantissa bit of one parameter element flips
    (its value moves by up to a half, enough that later updates cannot round it away)."""
    import math
    for m in modules:
        for p in m.parameters():
            if p.numel():
                t = p.detach().reshape(-1)[:1]
                bit = round(-math.log2(torch.finfo(t.dtype).eps)) - 1 \
                    if t.dtype.is_floating_point else 0
                ints = t.view(_INT_OF_SIZE[t.element_size()])
                ints ^= 1 << bit
                return
