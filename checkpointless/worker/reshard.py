"""A shrink or a grow under fsdp or hsdp: the slices cut anew for a new number of processes.

FSDP2 cuts each parameter (and its optimizer state) along its first dimension into one chunk
per process (per position of a shard group under HSDP, whose twins hold the same chunk). A
shrink from W processes to P (or a grow back) changes every chunk's bounds, so the state cannot
stay where it is: the members agree on the newest step to which every old slice can be brought,
as a replacement's restore does (a survivor from its own snapshot, a lost rank's slice from a
peer's copy: agreement.py); one member that has each old slice sends, tensor by tensor, the
rows each member's new chunks need (reshard_stream.py: a member holds a slice and its new
chunks, never the whole model); every member (a spare joining in a grow too) then builds a
model for the new layout (the loop's `rebuild`, given to `Job.protect`) and loads its chunk.
The peers' copies of the old slices are of no use in the new layout: each member receives its
sources' new chunks in the same exchange and keeps them, so a failure right after the reshard
finds them.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from . import reshard_stream, scrub, transfer
from .agreement import pick_senders, restorable_step
from .failures import communicating
from .tensors import local_tensor

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
    src_of = [member_of[senders.get(s, (s, "own"))[0]] for s in range(old_world)]
    payloads = {s: _local(_slice_at(state, s, step, senders.get(s, (s, "own"))[1]))
                for s in range(old_world) if src_of[s] == me.rank}
    if payloads:
        send_hook(me.rank, step)
    hook(me.rank, step)
    wants = [_wanted(state, me.world_size, m) for m in range(me.world_size)]
    chunks, moved = reshard_stream.stream(state, me, old_world, src_of, payloads, wants)
    del payloads
    with communicating("agreeing that every member has its new chunks"):
        dist.all_reduce(torch.ones(1))  # nobody cuts anew unless everyone can
    rebuild_for(state, me)
    ways, index, groups = state.layout_for(me.world_size, me.rank)
    state.load(chunks[(ways, index)])
    state.layout = (ways, index, groups)
    loaded(step)
    _copies_for_holders(state, chunks, step, me)
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


def _wanted(state, world: int, member: int) -> list[tuple[int, int]]:
    """The new chunks `member` needs, (ways, index) each: its own, then those of the ranks it
    keeps peer copies of."""
    chunk = lambda r: tuple(state.layout_for(world, r)[:2])  # noqa: E731
    out = [chunk(member)]
    rep = state.replicas
    if rep is not None and rep.factor > 1:
        out += [chunk(src) for src in rep.sources_for(member, world) if chunk(src) not in out]
    return out


def _copies_for_holders(state, chunks: dict, step: int, me) -> None:
    """The old layout's copies dropped; this member's own snapshot and the copies it holds of
    its sources' new slices, at `step`, from the chunks it received."""
    rep = state.replicas
    with rep._lock:
        rep.own.clear()
        rep.held.clear()
    if rep.factor <= 1:
        return
    rep.snapshot(step, state.state())
    for src in rep.sources_for(me.rank, me.world_size):
        skel, flat = transfer.flatten_state(
            chunks[tuple(state.layout_for(me.world_size, src)[:2])])
        with rep._lock:
            rep.held.setdefault(src, {})[step] = (skel, flat)
            rep.sums.note((src, step), scrub.of(flat))
