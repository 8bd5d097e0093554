"""Which logical ranks each process hosts (checkpointless.shrink): pure data, read by the
supervisor, which decides a shrink or a grow, and by every worker, which runs its hosted ranks
and reduces them in logical order (worker/logical.py, worker/hosting.py).

A job of L processes (`distributed.num_processes`) has L logical ranks. Normally process i hosts
logical rank i. When a process is lost and no spare is ready, its logical ranks move to the
survivors; when a spare is ready again, it takes a hosted rank back.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Sequence


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

