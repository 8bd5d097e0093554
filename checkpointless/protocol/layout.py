"""Where each rank sits in the job's mesh, as arithmetic: the degrees of parallelism
(pipeline stages, replica groups, shard groups, tensor-parallel groups), each rank's coordinates,
its data-parallel share, its twins and every subgroup's ranks. Pure: the launcher's plan and
report, the supervisor and the workers all compute the mesh from this one class;
checkpointless/worker/mesh.py builds the process groups and the DeviceMesh from it."""
from __future__ import annotations

from dataclasses import dataclass

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")  # pp outermost, then accelerate's order


@dataclass(frozen=True)
class Layout:
    world: int
    shard_size: int  # ranks per replica group of one stage: dp_shard x tp
    tp: int = 1
    pp: int = 1  # pipeline stages

    def __post_init__(self):
        if self.pp < 1 or self.world % self.pp:
            raise ValueError(f"pp_size={self.pp} must divide the world size {self.world}")
        if self.shard_size < 1 or self.stage_world % self.shard_size:
            raise ValueError(f"shard_size={self.shard_size} must divide the ranks of a stage "
                             f"{self.stage_world}")
        if self.tp < 1 or self.shard_size % self.tp:
            raise ValueError(f"tp_size={self.tp} must divide the ranks per replica group "
                             f"{self.shard_size}")

    @property
    def stage_world(self) -> int:
        """Ranks per pipeline stage (the world itself without pp)."""
        return self.world // self.pp

    @property
    def groups(self) -> int:
        """Replica groups per stage (dp_replicate)."""
        return self.stage_world // self.shard_size

    @property
    def dp_shard(self) -> int:
        return self.shard_size // self.tp

    @property
    def sizes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp_replicate": self.groups, "dp_shard": self.dp_shard,
                "tp": self.tp}

    def dims(self) -> tuple[str, ...]:
        """The mesh's dimensions: dp_shard always, dp_replicate with replica groups, tp when
        tensor parallel, pp when pipelined."""
        return tuple(d for d in DIMS if d == "dp_shard" or self.sizes[d] > 1)

    def stage(self, rank: int) -> int:
        return rank // self.stage_world

    def position(self, rank: int) -> int:
        """Which slice of the state `rank` holds (unique across stages)."""
        return self.stage(rank) * self.shard_size + rank % self.shard_size

    def group_of(self, rank: int) -> int:
        return (rank % self.stage_world) // self.shard_size

    def coords(self, rank: int) -> dict[str, int]:
        """{"dp_replicate": g, "dp_shard": s, "tp": t} of `rank`, with "pp": p when pipelined."""
        return {**({"pp": self.stage(rank)} if self.pp > 1 else {}),
                "dp_replicate": self.group_of(rank),
                "dp_shard": (rank % self.shard_size) // self.tp, "tp": rank % self.tp}

    def data_rank(self, rank: int) -> int:
        """Which data-parallel share of the batch `rank` trains on: a tp group shares one, and
        so do the stages of one pipeline."""
        return (rank % self.stage_world) // self.tp

    def twins(self, rank: int) -> list[int]:
        """The other ranks holding the same slice as `rank` (one per other replica group of its
        stage)."""
        return [r for r in self.replicate_ranks(self.position(rank)) if r != rank]

    def shard_ranks(self, group: int, t: int = 0, stage: int = 0) -> list[int]:
        """The FSDP shard group of replica group `group` of `stage` at tp position `t`."""
        base = stage * self.stage_world + group * self.shard_size + t
        return list(range(base, base + self.shard_size, self.tp))

    def replicate_ranks(self, position: int) -> list[int]:
        """The ranks holding slice `position` (see position())."""
        stage, p = divmod(position, self.shard_size)
        base = stage * self.stage_world + p
        return list(range(base, base + self.stage_world, self.shard_size))

    def tp_ranks(self, first: int) -> list[int]:
        """The tp group that starts at rank `first`."""
        return list(range(first, first + self.tp))

    def stage_ranks(self, stage: int) -> list[int]:
        return list(range(stage * self.stage_world, (stage + 1) * self.stage_world))

    def pp_ranks(self, index: int) -> list[int]:
        """The pipeline of the ranks at `index` inside their stage: one rank per stage."""
        return [index + p * self.stage_world for p in range(self.pp)]

    def all_groups(self) -> list[tuple[str, list[int]]]:
        """Every subgroup of the mesh as (dimension, ranks), in the order they are built."""
        out = []
        slices = range(self.pp * self.shard_size)
        if self.groups > 1:
            out += [("dp_replicate", self.replicate_ranks(p)) for p in slices]
        out += [("dp_shard", self.shard_ranks(g, t, s)) for s in range(self.pp)
                for g in range(self.groups) for t in range(self.tp)]
        if self.tp > 1:
            out += [("tp", self.tp_ranks(f)) for f in range(0, self.world, self.tp)]
        if self.pp > 1:
            out += [("pp", self.pp_ranks(i)) for i in range(self.stage_world)]
        return out

    def mesh(self) -> list:
        """Rank ids as nested lists, shaped as the mesh of `dims()`."""
        import torch
        return torch.arange(self.world).reshape([self.sizes[d] for d in self.dims()]).tolist()

    def lost_with_a_node(self, ranks_per_node: int) -> list[int]:
        """Slices whose every copy sits on one node (losing that node loses the slice); empty
        when any one node's loss leaves each slice somewhere."""
        return [p for p in range(self.pp * self.shard_size)
                if len({r // ranks_per_node for r in self.replicate_ranks(p)}) < 2]


def has_replica_groups(world: int, shard_size: int) -> bool:
    """HSDP's replica groups exist in a generation of `world` processes (per stage): its shard
    groups divide them, two or more. A shrunk generation they do not divide runs 1-D."""
    return bool(shard_size) and shard_size < world and world % shard_size == 0


def slice_of(world: int, rank: int, shard_size: int) -> tuple[int, int, int]:
    """(ways, index, groups): into how many chunks the sharded state of `rank` is cut in a
    generation of `world` processes, which one it holds, and over how many replica groups
    (reshard.py): a shard group's chunks under HSDP's replica groups, else one chunk per
    process. The groups count too: a model sharded over a shard group names that group, which
    another number of groups builds under another name, so the model is built anew."""
    if has_replica_groups(world, shard_size):
        return shard_size, rank % shard_size, world // shard_size
    return world, rank, 1
