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
from .tensors import local_part

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Diverged(RuntimeError):
    """This rank's parameters differ from the majority's: it must not train on."""


class NoMajority(RuntimeError):
    """The replicas disagree and no state is held by a majority of ranks."""


def whole_on_tp(p) -> bool:
    """A parameter that tensor parallel leaves whole (norms, embeddings, the head, a row-wise
    layer's bias): its mesh has no tp dimension, or it is replicated along it, so every rank of a
    tp group holds the same part of it."""
    names = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ()
    return "tp" not in names or p.placements[names.index("tp")].is_replicate()


def params_checksum(modules, only=None) -> int:
    """Sum of every parameter's bits (those `only(p)` keeps) read as integers (wrapping at 64
    bits)."""
    total = 0
    for m in modules:
        for p in m.parameters():
            if only is not None and not only(p):
                continue
            t = local_part(p).detach()  # under HSDP: the slice twins must agree on
            if t.numel() == 0:
                continue
            ints = t.reshape(-1).view(_INT_OF_SIZE[t.element_size()])
            total = (total + int(ints.sum(dtype=torch.int64))) & ((1 << 64) - 1)
    return total - (1 << 64) if total >= 1 << 63 else total


def gather(modules, world: int, only=None) -> list[int]:
    """Every rank's parameter checksum, by rank (one small all-gather)."""
    mine = torch.tensor([params_checksum(modules, only)], dtype=torch.int64)
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


def compared(world: int, twins: list[list[int]] | None) -> list[list[int]]:
    """The sets of ranks that must hold the same parameters: every rank (ddp), or under HSDP
    each shard position's ranks (a rank and its twins)."""
    if not twins:
        return [list(range(world))]
    return sorted({tuple(sorted([r, *t])) for r, t in enumerate(twins)})


def apart(sums: list[int], groups: list[list[int]]) -> list[list[int]]:
    """The groups whose ranks' checksums are not all equal."""
    return [list(g) for g in groups if len({sums[r] for r in g}) > 1]


def check_at_end(modules, groups: list[list[int]], between_steps, only=None,
                 what: str = "the replicas") -> None:
    """The run's last check, every rank together (`between_steps` recovers a peer lost in it):
    replicas that disagree are an error on every rank, never a quiet success. `only`: the
    parameters compared (all by default)."""
    world = sum(len(g) for g in groups)
    sums = between_steps(lambda: gather(modules, world, only))
    if far := apart(sums, groups):
        raise NoMajority(f"{what} disagree at the end of the run (parameter checksums by "
                         f"rank: {sums}; ranks that should agree: {far}); the run is not a "
                         "success")


def judge_groups(sums: list[int], groups: list[list[int]], rank: int, step: int) -> list[int]:
    """Each group's ranks judged as a replicated job's are (judge); the odd ranks of all."""
    odd = []
    for g in groups:
        g = list(g)
        odd += judge([sums[x] for x in g], g.index(rank) if rank in g else -1, step, g)
    return sorted(odd)


def judge(sums: list[int], rank: int, step: int, ranks: list[int] | None = None) -> list[int]:
    """The ranks that differ from the majority; raises Diverged on such a rank, NoMajority on
    every rank when no state is held by more than half of them. `ranks`: the rank each sum is
    of (all, in order, by default); `rank` indexes `sums` (-1: not among them)."""
    ranks = ranks if ranks is not None else list(range(len(sums)))
    sums_by = dict(zip(ranks, sums))
    counts = {s: sums.count(s) for s in set(sums)}
    if len(counts) == 1:
        return []
    majority = max(counts, key=counts.get)
    if counts[majority] * 2 <= len(sums):
        raise NoMajority(f"at step {step} the replicas disagree with no majority (parameter "
                         f"checksums by rank: {sums_by}); no state can be trusted over another. "
                         f"Every rank started from rank 0's state, so they parted since: "
                         f"{LIKELY_CAUSES}")
    odd = [ranks[i] for i, s in enumerate(sums) if s != majority]
    if rank >= 0 and ranks[rank] in odd:
        raise Diverged(f"rank {ranks[rank]}'s parameters differ from the majority's at step "
                       f"{step} (checksum {sums[rank]} vs {majority} on ranks "
                       f"{[ranks[i] for i, s in enumerate(sums) if s == majority]}); it leaves "
                       f"and a spare takes the majority's state. {LIKELY_CAUSES[0].upper()}"
                       f"{LIKELY_CAUSES[1:]}")
    return odd


def flip_a_bit(modules) -> None:
    """Silent data corruption, rehearsed: the top mantissa bit of one parameter element flips
    (its value moves by up to a half, enough that later updates cannot round it away)."""
    import math
    for m in modules:
        for p in m.parameters():
            if local_part(p).numel():  # under HSDP: this rank's slice, not its twins'
                t = local_part(p).detach().reshape(-1)[:1]
                bit = round(-math.log2(torch.finfo(t.dtype).eps)) - 1 \
                    if t.dtype.is_floating_point else 0
                ints = t.view(_INT_OF_SIZE[t.element_size()])
                ints ^= 1 << bit
                return
