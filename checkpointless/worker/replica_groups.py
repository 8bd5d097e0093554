"""HSDP's layout: ranks in replica groups of `shard_size`, each group holding one whole copy.

Rank r sits in replica group r // S at shard position r % S (S = shard_size), so a shard group is
S consecutive ranks (one node's processes by default) and the ranks at one position, one per
group, hold the same slice of parameters and optimizer state, bit for bit: FSDP2 reduce-scatters
within a shard group and all-reduces across the position's ranks, which all receive the same sum.
Those ranks are each other's copies ("twins"), so a lost rank's slice is sent by a twin and no
host copy is needed (restore.py).

The subgroups are built in every generation, by every member, right after the default group and
in one fixed order (replicate groups, then shard groups). torch names a new group by counting the
groups made since the last destroy_process_group(), so a generation's subgroups take the names the
previous one's had: the DeviceMesh FSDP was built on (which resolves its groups by name) points at
the new ones at once, in survivors and replacement alike, and only FSDP's cached handles need
replacing (group.Group.rebind_sharded_modules).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

MESH_DIMS = ("replicate", "shard")


@dataclass(frozen=True)
class Layout:
    world: int
    shard_size: int

    def __post_init__(self):
        if self.shard_size < 1 or self.world % self.shard_size:
            raise ValueError(f"shard_size={self.shard_size} must divide the world size "
                             f"{self.world}")

    @property
    def groups(self) -> int:
        return self.world // self.shard_size

    def position(self, rank: int) -> int:
        return rank % self.shard_size

    def group_of(self, rank: int) -> int:
        return rank // self.shard_size

    def twins(self, rank: int) -> list[int]:
        """The other ranks holding the same slice as `rank` (one per other replica group)."""
        p = self.position(rank)
        return [p + g * self.shard_size for g in range(self.groups)
                if p + g * self.shard_size != rank]

    def shard_ranks(self, group: int) -> list[int]:
        return list(range(group * self.shard_size, (group + 1) * self.shard_size))

    def replicate_ranks(self, position: int) -> list[int]:
        return list(range(position, self.world, self.shard_size))

    def mesh(self) -> list[list[int]]:
        """Rank ids as the 2-D mesh (replica group x shard position)."""
        return [self.shard_ranks(g) for g in range(self.groups)]

    def lost_with_a_node(self, ranks_per_node: int) -> list[int]:
        """Shard positions whose every copy sits on one node (losing that node loses the slice);
        empty when any one node's loss leaves each slice somewhere."""
        if self.groups < 2:
            return list(range(self.shard_size))
        return [p for p in range(self.shard_size)
                if len({r // ranks_per_node for r in self.replicate_ranks(p)}) < 2]


def build(layout: Layout, rank: int, backend: str | None = None):
    """(replicate group, shard group) of `rank` in the current generation: every member calls
    this with the same layout, after init_process_group, before anything else makes a group."""
    mine_r = mine_s = None
    for p in range(layout.shard_size):
        ranks = layout.replicate_ranks(p)
        g = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            mine_r = g
    for grp in range(layout.groups):
        ranks = layout.shard_ranks(grp)
        g = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            mine_s = g
    return mine_r, mine_s


def device_mesh(layout: Layout, groups, device_type: str):
    """The 2-D DeviceMesh (replicate, shard) over this generation's subgroups."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh.from_group(list(groups), device_type,
                                 mesh=torch.tensor(layout.mesh(), dtype=torch.int),
                                 mesh_dim_names=MESH_DIMS)
