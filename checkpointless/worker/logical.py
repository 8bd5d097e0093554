"""Logical ranks: the job's numerics belong to a fixed logical world, not to its processes.

A job of L processes (`distributed.num_processes`) has L logical ranks. Normally process i hosts
logical rank i. When a process is lost and no spare is ready, its logical ranks move to the
survivors, which then run every hosted rank's micro-batch and keep each one's gradient apart; when
a spare is ready again, it takes a hosted rank back. `Placement` says who hosts what; it is pure
data (no torch.distributed), so the supervisor can decide a shrink and every process can apply it.

`logical_all_reduce` sums the L logical contributions in one fixed order, 0, 1, ..., L-1, with
one float add after the other. The bits of the sum then depend on the logical contributions only:
a job on 3 processes ends a step with the same gradients as on 4, whoever hosts which rank. A
plain all-reduce cannot promise that: its order follows the processes (ring or tree) and changes
when their number does.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from .failures import communicating


@dataclass(frozen=True)
class Placement:
    """Which logical ranks each process hosts: `hosts[p]` is process p's list, sorted.

    Processes are numbered 0..P-1 as in the process group of the moment: after a shrink the
    survivors keep their relative order and are numbered anew, as the next generation's group
    numbers them."""
    logical_world: int
    hosts: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        hosts = tuple(tuple(h) for h in self.hosts)
        object.__setattr__(self, "hosts", hosts)
        flat = sorted(r for h in hosts for r in h)
        if flat != list(range(self.logical_world)):
            raise ValueError(f"a placement must host each of the {self.logical_world} logical "
                             f"ranks exactly once, got {[list(h) for h in hosts]}")
        if any(not h for h in hosts):
            # a process with nothing to run would only slow every collective down
            raise ValueError(f"every process must host a logical rank: {[list(h) for h in hosts]}")
        if any(list(h) != sorted(h) for h in hosts):
            raise ValueError(f"each process's logical ranks must be sorted: "
                             f"{[list(h) for h in hosts]}")

    @classmethod
    def identity(cls, logical_world: int) -> "Placement":
        """The failure-free job: process i hosts logical rank i."""
        if logical_world < 1:
            raise ValueError(f"the logical world must be at least 1, got {logical_world}")
        return cls(logical_world, tuple((r,) for r in range(logical_world)))

    @property
    def processes(self) -> int:
        return len(self.hosts)

    def hosted(self, process: int) -> tuple[int, ...]:
        return self.hosts[process]

    def process_of(self, logical: int) -> int:
        for p, h in enumerate(self.hosts):
            if logical in h:
                return p
        raise ValueError(f"logical rank {logical} is not in a world of {self.logical_world}")

    def loads(self) -> list[int]:
        return [len(h) for h in self.hosts]

    def shrink(self, lost_process: int | Iterable[int],
               capacity: int | Sequence[int] | None = None) -> "Placement":
        """The placement once `lost_process` (one index or several, numbered in this placement)
        is gone: each of its logical ranks, lowest first, moves to the surviving process that
        hosts the fewest at that moment (ties: the lowest process index), so the extra work is
        spread and the choice is the same on every process that computes it.

        `capacity` (one number for all, or one per process of this placement) is the most
        logical ranks a process may host, e.g. what its memory allows; a rank no survivor can
        take is refused with a ValueError."""
        lost = {lost_process} if isinstance(lost_process, int) else set(lost_process)
        if not lost or not lost <= set(range(self.processes)):
            raise ValueError(f"lost processes {sorted(lost)} are not among the "
                             f"{self.processes} processes of {self.to_json()}")
        caps = self._capacities(capacity)
        survivors = [p for p in range(self.processes) if p not in lost]
        if not survivors:
            raise ValueError(f"no process survives the loss of {sorted(lost)}")
        new = [list(self.hosts[p]) for p in survivors]
        new_caps = [caps[p] for p in survivors]
        for p, h in enumerate(new):
            if len(h) > new_caps[p]:
                raise ValueError(f"process {survivors[p]} already hosts {len(h)} logical ranks, "
                                 f"over its capacity {new_caps[p]}")
        for logical in sorted(r for p in lost for r in self.hosts[p]):
            free = [p for p, h in enumerate(new) if len(h) < new_caps[p]]
            if not free:
                raise ValueError(
                    f"cannot place logical rank {logical} of lost process(es) {sorted(lost)}: "
                    f"every surviving process {survivors} already hosts its capacity "
                    f"{[new_caps[p] for p in range(len(new))]} (loads {[len(h) for h in new]})")
            target = min(free, key=lambda p: (len(new[p]), p))
            new[target].append(logical)
        return Placement(self.logical_world, tuple(tuple(sorted(h)) for h in new))

    def _capacities(self, capacity) -> list[float]:
        if capacity is None:
            return [float("inf")] * self.processes
        if isinstance(capacity, int):
            return [capacity] * self.processes
        caps = list(capacity)
        if len(caps) != self.processes:
            raise ValueError(f"capacity lists {len(caps)} processes, the placement has "
                             f"{self.processes}")
        return caps

    def grow(self, new_process_count: int = 1) -> "Placement":
        """The placement once `new_process_count` processes have joined (numbered after the
        existing ones): each new process, in turn, takes the highest logical rank of the process
        that hosts the most (ties: the lowest process index). Taking from the most loaded first
        shortens the slowest step; growing back after a shrink returns to one rank a process."""
        if new_process_count < 0:
            raise ValueError(f"cannot grow by {new_process_count} processes")
        new = [list(h) for h in self.hosts]
        for _ in range(new_process_count):
            donor = min(range(len(new)), key=lambda p: (-len(new[p]), p))
            if len(new[donor]) < 2:
                raise ValueError(f"cannot grow past {len(new)} processes: each already hosts a "
                                 f"single logical rank of {self.logical_world}")
            new.append([new[donor].pop()])
        return Placement(self.logical_world, tuple(tuple(h) for h in new))

    def to_json(self) -> str:
        return json.dumps({"logical_world": self.logical_world,
                           "hosts": [list(h) for h in self.hosts]})

    @classmethod
    def from_json(cls, text: str) -> "Placement":
        d = json.loads(text)
        return cls(int(d["logical_world"]), tuple(tuple(int(r) for r in h) for h in d["hosts"]))


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
    if n == chunk * size:
        mine = flats[0].view(1, -1) if len(flats) == 1 else torch.stack(flats)
    else:
        mine = flats[0].new_zeros(len(flats), chunk * size)
        for i, f in enumerate(flats):
            mine[i, :n] = f
    # to process q: each hosted rank's chunk q, hosted ranks in sorted order (with one hosted
    # rank, the usual case, this is the contribution itself: no copy)
    send = mine.view(len(flats), size, chunk).transpose(0, 1).contiguous().view(-1)
    loads = placement.loads()
    recv = torch.empty(sum(loads) * chunk, dtype=send.dtype, device=send.device)
    with communicating("logical reduce-scatter"):
        dist.all_to_all_single(recv, send, output_split_sizes=[k * chunk for k in loads],
                               input_split_sizes=[len(flats) * chunk] * size, group=group)
    rows = recv.view(-1, chunk)  # rows from process 0's hosted ranks first, then process 1's...
    row_of = {r: i for i, r in enumerate(r for h in placement.hosts for r in h)}
    part = _sum_in_order([rows[row_of[r]] for r in range(placement.logical_world)])
    out = torch.empty(size * chunk, dtype=part.dtype, device=part.device)
    with communicating("logical all-gather"):
        dist.all_gather_single(out, part, group=group)
    return out[:n].reshape(shape)


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
