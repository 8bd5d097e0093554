"""Logical ranks: the job's numerics belong to a fixed logical world, not to its processes.

A job of L processes (`distributed.num_processes`) has L logical ranks. Normally process i hosts
logical rank i. When a process is lost and no spare is ready, its logical ranks move to the
survivors, which then run every hosted rank's micro-batch and keep each one's gradient apart; when
a spare is ready again, it takes a hosted rank back. `Placement` (protocol/placement.py) says who
hosts what: pure data, so the supervisor decides a shrink and every process applies it.

`logical_all_reduce` sums the L logical contributions in one fixed order, 0, 1, ..., L-1, with
one float add after the other. The bits of the sum then depend on the logical contributions only:
a job on 3 processes ends a step with the same gradients as on 4, whoever hosts which rank. A
plain all-reduce cannot promise that: its order follows the processes (ring or tree) and changes
when their number does.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..protocol.placement import Placement
from .failures import communicating

__all__ = ["Placement", "logical_all_reduce", "logical_all_reduce_grads", "logical_reduce_scatter",
           "logical_reduce_scatter_replicated"]


def _group_shape(placement: Placement, group) -> tuple[int, int]:
    """(this process's index, P), checked against the placement: a process group of another
    size would pair the wrong parts of the buffers."""
    if placement.processes == 1 and not (dist.is_available() and dist.is_initialized()):
        return 0, 1  # a job on one process needs no process group
    me, size = dist.get_rank(group), dist.get_world_size(group)
    if size != placement.processes:
        raise ValueError(f"the process group has {size} processes, the placement "
                         f"{placement.to_json()} has {placement.processes}")
    return me, size


def _flat_contributions(contribs: dict, hosted: tuple[int, ...]) -> list[torch.Tensor]:
    if sorted(contribs) != list(hosted):
        raise ValueError(f"this process hosts logical ranks {list(hosted)}, "
                         f"got contributions of {sorted(contribs)}")
    first = contribs[hosted[0]]
    for r in hosted:
        t = contribs[r]
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(f"logical rank {r}'s contribution is {t.dtype} {tuple(t.shape)} on "
                             f"{t.device}, logical rank {hosted[0]}'s {first.dtype} "
                             f"{tuple(first.shape)} on {first.device}")
    return [contribs[r].reshape(-1) for r in hosted]


def logical_all_reduce(contribs: dict[int, torch.Tensor], placement: Placement,
                       group=None) -> torch.Tensor:
    """The sum over all L logical ranks, ((c0 + c1) + c2) + ... + c(L-1), on every process.

    `contribs` holds this process's hosted logical ranks' contributions (same shape, dtype and
    device everywhere); the result has their shape. Every element is summed in logical order
    with one rounding per add, so the bits depend on the logical contributions only, never on
    how many processes host them or which hosts which.

    How: a reduce-scatter by element chunks, then an all-gather. Process p owns chunk p of the
    elements (ceil(n / P) each, the last padded); one all_to_all_single sends every hosted
    rank's part of chunk q to process q; p sums its chunk over the L logical ranks in logical
    order; one all-gather gives everyone every chunk. A process hosting k ranks sends about
    (k + 1) * n (P - 1) / P elements and receives about (L / P + 1) * n: with one rank a process
    that is a ring all-reduce's 2 n (P - 1) / P, whereas gathering every contribution whole
    (padded to the largest k) would bring (P - 1) * max(k) * n to each process. Both collectives
    work on gloo CPU tensors (all_to_all_single with uneven splits included) and on NCCL.
    """
    me, size = _group_shape(placement, group)
    flats = _flat_contributions(contribs, placement.hosted(me))
    shape, n = contribs[placement.hosted(me)[0]].shape, flats[0].numel()
    if size == 1:  # one process hosts every rank, in sorted order
        return _sum_in_order(flats).reshape(shape)
    chunk = -(-n // size)  # ceil: every process owns the same number of (possibly pad) elements
    if n != chunk * size:
        flats = [torch.cat([f, f.new_zeros(chunk * size - n)]) for f in flats]
    part = _scatter_in_order(flats, placement, me, size, group)
    out = torch.empty(size * chunk, dtype=part.dtype, device=part.device)
    with communicating("logical all-gather"):
        dist.all_gather_single(out, part, group=group)
    return out[:n].reshape(shape)


def logical_reduce_scatter(contribs: dict[int, torch.Tensor], placement: Placement,
                           group=None) -> torch.Tensor:
    """This process's chunk of the sum over all L logical ranks, summed in logical order.

    Each hosted rank's contribution is P equal chunks laid end to end, chunk q for process q
    (FSDP2's reduce-scatter input: fsdp_logical.py); the result is chunk `me` of
    ((c0 + c1) + c2) + ... + c(L-1), with the same bits whatever P is and whoever hosts whom."""
    me, size = _group_shape(placement, group)
    flats = _flat_contributions(contribs, placement.hosted(me))
    if flats[0].numel() % size:
        raise ValueError(f"a contribution of {flats[0].numel()} elements is not {size} equal "
                         "chunks")
    if size == 1:
        return _sum_in_order(flats)
    return _scatter_in_order(flats, placement, me, size, group)


def logical_reduce_scatter_replicated(contribs: dict[int, torch.Tensor], placement: Placement,
                                      replicate_group) -> torch.Tensor:
    """HSDP's `logical_reduce_scatter`: the contributions are S equal chunks, one per position
    of a shard group, and every replica group holds each chunk ("twins"). The result is chunk
    s (this process's position) of the sum over all L logical ranks in logical order, the same
    bits in every twin and the same as `logical_reduce_scatter` over a 1-D cut of the world.

    The processes are G replica groups of S, rank g * S + s. Chunk s is cut once more into G
    parts: twin g sums part g over the L logical ranks (one all_to_all_single over the world,
    each process sending about one contribution's worth), then the twins all-gather their parts
    (n / S elements): about what HSDP's own reduce-scatter and replica all-reduce move, where
    sending each chunk whole to every twin would move G times as much."""
    me, size = _group_shape(placement, None)
    groups = dist.get_world_size(replicate_group)
    ways = size // groups
    if ways * groups != size:
        raise ValueError(f"{groups} replica groups do not divide {size} processes")
    flats = _flat_contributions(contribs, placement.hosted(me))
    n = flats[0].numel()
    if n % ways:
        raise ValueError(f"a contribution of {n} elements is not {ways} equal chunks")
    chunk = n // ways
    part = -(-chunk // groups)  # each twin's part of a chunk, the last one padded
    mine = torch.stack(flats).view(len(flats), ways, chunk)
    if part * groups != chunk:
        mine = torch.cat([mine, mine.new_zeros(len(flats), ways, part * groups - chunk)], 2)
    # to process g * S + s: each hosted rank's part g of chunk s
    send = mine.view(len(flats), ways, groups, part).permute(2, 1, 0, 3).contiguous().view(-1)
    summed = _sum_received(send, len(flats), part, placement, size, None)
    out = torch.empty(groups * part, dtype=summed.dtype, device=summed.device)
    with communicating("logical all-gather among twins"):
        dist.all_gather_into_tensor(out, summed, group=replicate_group)
    return out[:chunk]


def _scatter_in_order(flats: list[torch.Tensor], placement: Placement, me: int, size: int,
                      group) -> torch.Tensor:
    """One all_to_all_single sends each hosted rank's chunk q to process q; this process sums
    its chunk over the L logical ranks in logical order."""
    chunk = flats[0].numel() // size
    mine = flats[0].view(1, -1) if len(flats) == 1 else torch.stack(flats)
    # to process q: each hosted rank's chunk q, hosted ranks in sorted order (with one hosted
    # rank, the usual case, this is the contribution itself: no copy)
    send = mine.view(len(flats), size, chunk).transpose(0, 1).contiguous().view(-1)
    return _sum_received(send, len(flats), chunk, placement, size, group)


def _sum_received(send: torch.Tensor, hosted: int, chunk: int, placement: Placement, size: int,
                  group) -> torch.Tensor:
    """`send` holds, for each process in turn, this process's `hosted` rows of `chunk`
    elements for it; after one all_to_all_single, the rows received are summed over the L
    logical ranks in logical order."""
    loads = placement.loads()
    recv = torch.empty(sum(loads) * chunk, dtype=send.dtype, device=send.device)
    with communicating("logical reduce-scatter"):
        dist.all_to_all_single(recv, send, output_split_sizes=[k * chunk for k in loads],
                               input_split_sizes=[hosted * chunk] * size, group=group)
    rows = recv.view(-1, chunk)  # rows from process 0's hosted ranks first, then process 1's...
    row_of = {r: i for i, r in enumerate(r for h in placement.hosts for r in h)}
    return _sum_in_order([rows[row_of[r]] for r in range(placement.logical_world)])


def _sum_in_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """((p0 + p1) + p2) + ...: elementwise adds in the given order, one rounding each."""
    acc = parts[0].clone()
    for p in parts[1:]:
        acc.add_(p)
    return acc


def logical_all_reduce_grads(grads_by_logical: dict[int, list[torch.Tensor]],
                             placement: Placement, group=None,
                             out: dict[int, list[torch.Tensor]] | list[torch.Tensor] | None
                             = None) -> torch.Tensor:
    """The gradients averaged over the L logical ranks, as one flat buffer in parameter order.

    `grads_by_logical[r]` is hosted logical rank r's gradients, the same parameters in the same
    order for every rank (one dtype). Each rank's list is flattened into one buffer and summed
    in logical order (`logical_all_reduce`), then divided by L: the numbers a failure-free job
    of L processes would average to, whatever hosts them. A value to average with them (e.g.
    the micro-batch's loss) can ride as one more 1-element tensor at the end of each list.

    `out`: tensors to write the average into, in the same order (one list, e.g. one set of
    `.grad`s shared by the hosted ranks, or a list per hosted rank); they are written only once
    the collectives succeeded, so a failed step leaves every rank's own gradients as they were.
    """
    if not grads_by_logical:
        raise ValueError("no hosted logical rank's gradients were given")
    flats = {}
    for r, grads in grads_by_logical.items():
        dtypes = sorted({str(g.dtype) for g in grads})
        if len(dtypes) != 1:
            raise ValueError(f"logical rank {r}'s gradients need one dtype, got {dtypes}")
        flats[r] = torch.cat([g.reshape(-1) for g in grads])  # a copy: the gradients stay put
    targets = list(out.values()) if isinstance(out, dict) else [] if out is None else [out]
    n = next(iter(flats.values())).numel()
    for tensors in targets:  # checked first: a wrong `out` fails before any peer is waited on
        if sum(t.numel() for t in tensors) != n:
            raise ValueError(f"`out` holds {sum(t.numel() for t in tensors)} elements, "
                             f"the gradients {n}")
    avg = logical_all_reduce(flats, placement, group)
    avg.div_(placement.logical_world)
    for tensors in targets:
        offset = 0
        for t in tensors:
            t.copy_(avg[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
    return avg
