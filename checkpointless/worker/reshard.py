"""A shrink or a grow under fsdp: the slices cut anew for a new number of processes.

FSDP2 cuts each parameter (and its optimizer state) along its first dimension into one chunk
per process (per position of a shard group under HSDP, whose twins hold the same chunk). A shrink from W processes to P (or a grow back) changes every chunk's bounds, so
the state cannot stay where it is: the members agree on the newest step to which every old
slice can be brought, as a replacement's restore does (a survivor from its own snapshot, a lost
rank's slice from a peer's copy: agreement.py), then each old slice is broadcast by one member
that has it, every member (a spare joining in a grow too) concatenates the slices into each
tensor and keeps its own new chunk. A member whose model was sharded for the old number of
processes first builds a new one for the new number (the loop's `rebuild`, given to
`Job.protect`).

Each member holds every old slice for a moment: the whole state once in host memory, freed
before training resumes (docs/shrink.md). The peers' copies of the old slices are of no use in
the new layout; every member computes its holders' copies of the new slices from what it
received, so a failure right after the reshard finds them.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from . import scrub, transfer
from .agreement import pick_senders, restorable_step
from .failures import communicating
from .tensors import is_dtensor, local_tensor

_NONE = {"completed": -1, "own": [], "held": {}}


def needed(infos: list[dict], world: int, layout_for) -> bool:
    """Some member holds a slice cut another way than this generation's (`layout_for(world,
    rank)`: (ways, index, groups)), or another slice than its rank's (a shrink renumbered it, and a
    grow came before it restored)."""
    return any(i.get("layout") and tuple(i["layout"]) != tuple(layout_for(world, r))
               for r, i in enumerate(infos))


def restore_resharded(state, me, infos: list[dict], loaded, hook=lambda rank, step: None,
                      send_hook=lambda rank, step: None) -> tuple[int, dict] | None:
    """Bring every member to one step in the layout of `me.world_size` processes; returns
    (the step, what happened for the report), or None when peer memory cannot: some old slice
    has no copy left, or the members hold slices of two layouts (a failure inside an earlier
    reshard). The caller then loads a durable checkpoint, which DCP cuts for any number of
    processes. `hook(rank, step)`: before this member receives the first slice;
    `send_hook(rank, step)`: before it broadcasts one (faults)."""
    t0 = time.time()
    worlds = {i["layout"][0] for i in infos if i.get("layout") and i["completed"] >= 0}
    if len(worlds) != 1:
        return None
    (old_world,) = worlds  # the old chunks: one per process, or per shard group's position
    member_of = {}  # old chunk -> the member to read it from (under HSDP, of its twins the
    for r, i in enumerate(infos):  # one that completed most, the lowest rank among equals)
        if i.get("layout") and i["completed"] >= 0:
            s = i["layout"][1]
            if s not in member_of or i["completed"] > infos[member_of[s]]["completed"]:
                member_of[s] = r
    old = [infos[member_of[s]] if s in member_of else _NONE for s in range(old_world)]
    step = restorable_step(old)
    if step is None:
        return None
    senders = pick_senders(old, step)
    slices, moved = [], 0
    for s in range(old_world):
        h, how = senders.get(s, (s, "own"))
        src = member_of[h]
        (send_hook if me.rank == src else hook)(me.rank, step)
        payload = _slice_at(state, s, step, how) if me.rank == src else None
        got, n = transfer.broadcast_state(payload, src, me.rank)
        slices.append(_local(payload) if me.rank == src else got)
        moved += n
        hook = lambda rank, step: None  # noqa: E731  (once, before the first receive)
    with communicating("agreeing that every member has every slice"):
        dist.all_reduce(torch.ones(1))  # nobody cuts anew unless everyone can
    rebuild_for(state, me)
    ways, index, groups = state.layout_for(me.world_size, me.rank)
    state.load(cut(slices, state.objects, ways, index))
    state.layout = (ways, index, groups)
    loaded(step)
    _copies_for_holders(state, slices, step, me)
    info = {"steps_by_rank": [i["completed"] for i in infos], "pairs": {},
            "source": None, "bytes_sent": 0, "bytes_received": moved,
            "restored_from": "peer_memory", "resharded": [old_world, ways],
            "sent_from": {s: how for s, (_, how) in senders.items()},
            "transfer_s": time.time() - t0}
    return step, info


def rebuild_for(state, me) -> None:
    """A model, optimizer and checkpoints sharded for this generation (the loop's `rebuild`,
    given to Job.protect), unless this member's already are."""
    if tuple(state.layout or ()) == tuple(state.layout_for(me.world_size, me.rank)):
        return
    if state.rebuild is None:
        raise RuntimeError("a shrink under fsdp needs a model sharded anew: give "
                           "Job.protect(rebuild=...) a function that builds one")
    state.rebuild()  # protects the new objects: state.layout is this generation's now


def _slice_at(state, s: int, step: int, how: str):
    """Old slice `s` at `step`, on the member that sends it: a held copy, its own snapshot, or
    its live state (it completed exactly `step`)."""
    rep = state.replicas
    if how == "held":
        skel, flat = rep.held[s][step]
        return transfer.unflatten_state(skel, flat, copy=False)
    if step in rep.own:
        skel, flat = rep.own[step]
        return transfer.unflatten_state(skel, flat, copy=False)
    return state.state()


def _local(obj):
    """`obj` with every DTensor replaced by its local part."""
    if isinstance(obj, dict):
        return {k: _local(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_local(v) for v in obj)
    return local_tensor(obj).detach() if isinstance(obj, torch.Tensor) else obj


def _chunk(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """FSDP2's chunk of `full` for `rank` of `world` (torch.chunk on dim 0, empty past the end)."""
    chunks = torch.chunk(full, world, dim=0)
    if rank < len(chunks):
        return chunks[rank].clone()
    return full.new_empty((0, *full.shape[1:]))


def cut(slices: list[dict], objects: dict, world: int, rank: int) -> dict:
    """This member's state in the new layout: each sharded tensor is the old slices' parts
    concatenated, then chunked for `world`; anything else is the same in every slice."""
    out = {}
    for name, obj in objects.items():
        parts = [sl[name] for sl in slices]
        if isinstance(obj, torch.nn.Module):
            live = obj.state_dict()
            out[name] = {k: _chunk(torch.cat([p[k] for p in parts]), world, rank)
                         if is_dtensor(live.get(k)) else parts[0][k] for k in parts[0]}
        elif isinstance(obj, torch.optim.Optimizer):
            state = {}
            for idx, st in parts[0]["state"].items():
                state[idx] = {k: _chunk(torch.cat([p["state"][idx][k] for p in parts]), world,
                                        rank) if isinstance(v, torch.Tensor) and v.dim() > 0
                              else v for k, v in st.items()}
            out[name] = {"state": state, "param_groups": parts[0]["param_groups"]}
        else:
            out[name] = parts[0]
    return out


def _copies_for_holders(state, slices: list[dict], step: int, me) -> None:
    """The old layout's copies dropped; this member's own snapshot and the copies it holds of
    its sources' new slices, at `step`, made from the slices every member received."""
    rep = state.replicas
    with rep._lock:
        rep.own.clear()
        rep.held.clear()
    if rep.factor <= 1:
        return
    rep.snapshot(step, state.state())
    for src in rep.sources_for(me.rank, me.world_size):
        skel, flat = transfer.flatten_state(cut(slices, state.objects,
                                                *state.layout_for(me.world_size, src)[:2]))
        with rep._lock:
            rep.held.setdefault(src, {})[step] = (skel, flat)
            rep.sums.note((src, step), scrub.of(flat))
