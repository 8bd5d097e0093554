"""The job's device mesh: which rank sits where along (pp, dp_replicate, dp_shard, tp), and the groups.

Ranks are laid out as torchtitan orders the dimensions: pipeline stages outermost, then
accelerate's ParallelismConfig order, tensor parallel innermost:
rank r = ((p * replica_groups + g) * dp_shard + s) * tp + t. A pipeline stage is `world / pp`
consecutive ranks (whole nodes whenever that is a multiple of the ranks per node, so stages span
nodes and tp stays inside one), a tensor-parallel group `tp` consecutive ranks, an FSDP shard
group the ranks of one replica group at one tp position, and a replica group `shard_size` =
dp_shard x tp consecutive ranks of one stage, each holding one whole copy of that stage.

Rank r holds slice (stage, r % shard_size) of the parameters and optimizer state. The ranks of
the same stage at the same slice in the other replica groups hold it too, bit for bit ("twins"):
FSDP2 reduce-scatters within a shard group and all-reduces across a slice's ranks, which all
receive the same sum; under ddp every rank of a stage is a replica group of its own. A lost rank's
slice is sent by a twin, and no host copy is needed (restore.py). Without replica groups (fsdp,
with or without tp) every slice exists once and peer copies keep it.

The subgroups are built in every generation, by every member, right after the default group and
in one fixed order (replicate groups, then shard groups, then tp groups, stage by stage; then the
pp groups that join the stages). torch names a new group by counting the groups made since the
last destroy_process_group(), so a generation's subgroups take the names the previous one's had:
the DeviceMesh that FSDP and the tensor-parallel DTensors were built on (which resolves its groups
by name) points at the new ones at once, in survivors and replacement alike, and only FSDP's
cached handles need replacing (group.Group.rebind). A pipeline's stages are rebuilt on the new pp
group by the loop (launcher/train/pipeline.py).
"""
from __future__ import annotations

import torch.distributed as dist

from ..protocol.layout import DIMS, Layout, has_replica_groups, slice_of  # noqa: F401  (worker's names)


def build(layout: Layout, rank: int, backend: str | None = None) -> dict:
    """{dimension: this rank's group} of the current generation: every member calls this with
    the same layout, after init_process_group, before anything else makes a group."""
    mine = {}
    for dim, ranks in layout.all_groups():
        g = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            mine[dim] = g
    return mine


def device_mesh(layout: Layout, groups: dict, device_type: str):
    """The DeviceMesh of `layout.dims()` over this generation's subgroups."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    dims = layout.dims()
    return DeviceMesh.from_group([groups[d] for d in dims], device_type,
                                 mesh=torch.tensor(layout.mesh(), dtype=torch.int),
                                 mesh_dim_names=dims)
