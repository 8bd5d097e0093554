"""Logical ranks under FSDP2 (checkpointless.shrink=exact with distributed.strategy=fsdp).

FSDP2 reduce-scatters each unit's gradients over the processes, in an order that follows them,
so a job on 3 processes would not sum what the same job summed on 4. Under `exact` each unit's
reduce-scatter is this module's (FSDP2's own hook for a custom one, `set_custom_reduce_scatter`):
every process sends each hosted logical rank's chunk q to process q, and q sums its chunk over
the L logical ranks in logical order (logical.py), then FSDP divides by L. The bits of every
sharded gradient then depend on the logical ranks' contributions only, however many processes
hold the shards.

Each micro-batch is reduced as FSDP reduces it (into the sharded gradients, which accumulate the
micro-batches): a micro-batch's sum over the L logical ranks in logical order, then the next's
added. A process hosting several logical ranks after a shrink runs micro-batch m of each in
turn; the hook keeps the earlier ones' inputs (their output is zeros, adding nothing) and
communicates once, on the last hosted rank's call, so every process calls the collective once
per unit and micro-batch. While shrunk, a process keeps the gathered parameters for the whole
step (no reshard between its hosted ranks' passes): each process then all-gathers each unit
once per step, as its peers do, whatever it hosts.

Under hsdp the model is sharded over its shard group alone (a 1-D mesh), not over FSDP2's
(replicate, shard) mesh, whose replica all-reduce no hook replaces: the hook sums each chunk over
the whole world in logical order and hands the same bits to every twin holding it
(logical.logical_reduce_scatter_replicated). The bits are then those of the same job under fsdp,
and of a shrunk one on any number of processes.

Clipping: the gradient norm of sharded gradients is summed over the shards, whose number
changes with a shrink; here each gradient is gathered whole, one at a time, and its norm taken
on the whole tensor, as ddp's ranks take it.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from .logical import Placement, logical_reduce_scatter, logical_reduce_scatter_replicated
from .tensors import full_tensor, is_dtensor, local_tensor


class HostedPass:
    """What the hooks need to know about the pass in flight, set by the loop (`LogicalFSDP`)."""

    def __init__(self):
        self.placement: Placement | None = None
        self.share = 0  # the logical rank whose backward runs
        self.last = True  # it is this process's last hosted logical rank of the step
        self.kept: dict[tuple[int, int], torch.Tensor] = {}  # (unit, share) -> its input
        # hsdp: this process's replica group dimension (its twins), whose members hold the
        # same chunks; None when every chunk is held once
        self.replicate = None


class _LogicalReduceScatter(ReduceScatter):
    """One FSDP unit's reduce-scatter, in logical order (see above)."""

    def __init__(self, hosted: HostedPass, unit: int):
        self.hosted, self.unit = hosted, unit

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        h = self.hosted
        if not h.last:  # an earlier hosted rank: kept until the last one's call
            h.kept[(self.unit, h.share)] = input_tensor.clone()
            # FSDP adds the output to the sharded gradient: zeros add nothing (an exact zero
            # of either sign may come out +0, which changes no later value of the step)
            output_tensor.zero_()
            return None
        # the placement numbers processes in the world: under hsdp, not in the shard group
        me = dist.get_rank() if h.replicate is not None else dist.get_rank(group)
        contribs = {s: h.kept.pop((self.unit, s))
                    for s in h.placement.hosted(me) if s != h.share}
        contribs[h.share] = input_tensor
        if h.replicate is not None:  # the sum over the whole world, each chunk to its twins
            output_tensor.copy_(logical_reduce_scatter_replicated(contribs, h.placement,
                                                                  h.replicate))
        else:
            output_tensor.copy_(logical_reduce_scatter(contribs, h.placement, group))
        return None


def fsdp_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP2 units of `model`, in module order (the same on every process)."""
    return [m for m in model.modules() if hasattr(m, "_get_fsdp_state")]


class LogicalFSDP:
    """The logical-order reduction installed on every FSDP2 unit of a model."""

    def __init__(self, model: torch.nn.Module, logical_world: int):
        self.model, self.hosted = model, HostedPass()
        self.units = fsdp_units(model)
        if not self.units:
            raise ValueError("shrink=exact under fsdp needs a model sharded with fully_shard")
        for i, unit in enumerate(self.units):
            unit.set_custom_reduce_scatter(_LogicalReduceScatter(self.hosted, i))
            # a plain sum in the hook, then one division by L after it: the same ops whatever P
            unit.set_force_sum_reduction_for_comms(True)
            unit.set_gradient_divide_factor(float(logical_world))

    def begin_step(self, placement: Placement, shrunk: bool, replicate=None) -> None:
        """Before a step's first pass. Shrunk, the gathered parameters stay for the step; else
        FSDP's defaults (the root keeps its parameters gathered after forward, as fully_shard
        sets it). `replicate`: under hsdp, this process's group of twins (the model sharded
        over its shard group alone, see the module's docstring)."""
        self.hosted.placement, self.hosted.kept = placement, {}
        self.hosted.replicate = replicate
        for unit in self.units:
            unit.set_reshard_after_forward(not shrunk and unit is not self.model, recurse=False)
            unit.set_reshard_after_backward(not shrunk, recurse=False)

    def begin_pass(self, share: int, last_share: bool) -> None:
        """Before logical rank `share`'s backward of a micro-batch; `last_share`: no hosted
        rank after it for this micro-batch."""
        self.hosted.share, self.hosted.last = share, last_share

    def end_step(self) -> None:
        """After the step's last backward: the parameters back to their shards."""
        self.hosted.kept = {}
        for unit in self.units:
            unit.reshard()


def exact_clip_grad_norm_(params, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ on sharded gradients, with the norm taken on each gradient
    gathered whole: the same bits however many shards there are. Every process calls it for
    the same parameters."""
    grads = [p.grad for p in params if p.grad is not None]
    norms = [torch.linalg.vector_norm(g.float(), 2) for g in _whole(grads)]
    total = torch.linalg.vector_norm(torch.stack(norms), 2) if norms else torch.zeros(())
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # as torch's clip_grad_norm_
    for g in grads:
        local_tensor(g).mul_(coef.to(local_tensor(g).dtype))
    return total


BUCKET_NUMEL = 1 << 25  # whole gradients gathered at a time: 128 MB in fp32, or the largest one


def _rows(dim0: int, world: int, rank: int) -> int:
    """Rows of FSDP2's chunk `rank` of a first dimension `dim0` cut for `world` processes."""
    per = -(-dim0 // world)
    return max(0, min(per, dim0 - rank * per))


def _whole(grads: list):
    """The sharded gradients, each gathered whole, in order: a bucket of them per all-gather
    (one all-gather per gradient cost a tiny-llama step +31% here; all of them at once would
    hold the whole model's gradients on every process). Each process's part is padded to the
    longest."""
    if not grads or not all(is_dtensor(g) and g.dim() for g in grads) or \
            len({g.dtype for g in grads}) != 1:
        yield from (full_tensor(g) for g in grads)
        return
    bucket = []
    for g in grads:
        if bucket and sum(b.numel() for b in bucket) + g.numel() > BUCKET_NUMEL:
            yield from _gathered(bucket)
            bucket = []
        bucket.append(g)
    yield from _gathered(bucket)


def _gathered(grads: list) -> list[torch.Tensor]:
    """`grads` (DTensors cut on dim 0 by FSDP2) gathered whole in one all-gather."""
    group = grads[0].device_mesh.get_group()
    world, me = dist.get_world_size(group), dist.get_rank(group)
    row = [math.prod(g.shape[1:]) for g in grads]  # elements per row of the first dimension
    sizes = [[_rows(g.shape[0], world, q) * r for g, r in zip(grads, row)] for q in range(world)]
    mine = [local_tensor(g).reshape(-1) for g in grads]
    if [t.numel() for t in mine] != sizes[me]:  # not FSDP2's dim-0 chunks: one by one
        return [full_tensor(g) for g in grads]
    width = max(sum(s) for s in sizes)
    send = torch.zeros(width, dtype=mine[0].dtype, device=mine[0].device)
    torch.cat(mine, out=send[:sum(sizes[me])])
    got = torch.empty(world * width, dtype=send.dtype, device=send.device)
    dist.all_gather_into_tensor(got, send, group=group)
    parts, offset = got.view(world, width), [0] * world
    out = []
    for i, g in enumerate(grads):
        pieces = []
        for q in range(world):
            pieces.append(parts[q, offset[q]:offset[q] + sizes[q][i]])
            offset[q] += sizes[q][i]
        out.append(torch.cat(pieces).view(g.shape))
    return out
