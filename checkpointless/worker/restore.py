"""Bringing every member of a new generation to one state: who sends what to whom.

Replicated state (ddp): the members all-gather their last committed step. Every member at the
newest step is a source; every other member (the spare, or a survivor that had not applied the
update) receives the whole state from one source, receivers spread evenly over the sources.

Sharded state (fsdp): each rank holds the only live copy of its slice, so the members agree on the
newest step to which every slice can be brought: a survivor rolls back to its own snapshot, a
spare receives its rank's slice from a peer that holds a copy (redundancy.py). Under HSDP the
ranks at the same shard position in the other replica groups (twins, mesh.py) hold the
slice live: a spare, or a survivor that cannot reach the step alone, receives it from a twin.
When some slice has no copy left anywhere, every rank loads the newest durable checkpoint
instead, and says so; before any rank finished a step, nothing was trained, and the lost slice is
the one its replacement built.

Who sends to whom is decided by pure functions over what the members told each other
(agreement.py); transfer.py moves the bytes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import reshard, transfer
from .agreement import (assign_sources, pick_holders, pick_senders,  # noqa: F401
                        replicated_step, restorable_step, stage_ranks)
from .failures import communicating
from .group import reshard_all
from .state import ProtectedState


@dataclass
class Position:
    """Where this member stands when a generation begins."""
    rank: int
    world_size: int
    completed: int  # steps this member has committed
    holds_state: bool  # False for a spare that has received nothing yet
    grads_kept: bool  # it still holds its own gradients of the step in flight
    # it has been through a restore since the launch: its state is the job's, not only its own
    # build (an unseeded script's ranks each build a different model)
    agreed: bool = True
    # its own build counts as the step-0 state: a worker of the launch, or a spare that took its
    # rank before any step was committed (nothing trained; no peer may hold a copy of its slice)
    built: bool = False


@dataclass
class Outcome:
    """What a restore decided for this member: the step to resume at, and what to drop."""
    resumed_step: int
    catching_up: int = 0  # >0: this rank computes while the others wait on it (see Job)
    drop_kept_grads: bool = False  # the state changed under the kept gradients
    info: dict = field(default_factory=dict)  # what happened, for the recovery report


def restore(state: ProtectedState, me: Position, before_receive=None,
            mid_send=None, loaded=None, rewind_to: int | None = None) -> Outcome:
    """`before_receive(rank, step)` is called on a receiver just before it receives, and
    `mid_send(rank, step)` on a sender midway through a send (faults). `loaded(step)` is called
    as soon as this member's live state was replaced by that of `step` (a roll-back to its
    snapshot, a slice received), so that a failure later in the same restore leaves the member
    knowing which step its state is at: its own count of committed steps would be wrong.
    `rewind_to`: the job goes back to a state known clean (a worker was found computing
    wrong, audit.py): every member loads the newest durable checkpoint at or before it."""
    hook = before_receive or (lambda rank, step: None)
    send_hook = mid_send or (lambda rank, step: None)
    if rewind_to is not None:
        out = _rewind(state, me, rewind_to, loaded or (lambda step: None))
    elif state.replicas is not None:
        out = _restore_shards(state, me, hook, send_hook, loaded or (lambda step: None))
    else:
        out = _restore_replicated(state, me, hook, send_hook)
    state.zero_grads()  # a loop that recomputes the step starts clean; kept ones are aside
    out.info["resumed_step"] = out.resumed_step
    return out


def _restore_replicated(state: ProtectedState, me: Position, hook, send_hook) -> Outcome:
    mine = torch.tensor([me.completed if me.holds_state else -1, int(me.grads_kept),
                         int(me.agreed)])
    got = [torch.zeros(3, dtype=torch.int64) for _ in range(me.world_size)]
    with communicating("agreeing on the newest committed step"):
        dist.all_gather(got, mine.to(torch.int64))
    steps = [int(g[0]) for g in got]
    kept = [bool(g[1]) for g in got]
    stages = stage_ranks(state, me.world_size)
    resume = replicated_step(steps, stages)
    sources = [r for r, s in enumerate(steps) if s == resume]
    receivers = [r for r, s in enumerate(steps) if s != resume]
    if me.world_size > 1 and any(not g[2] for g, s in zip(got, steps) if s >= 0):
        return _start_equal(state, me, steps, stages, sources, resume)
    out = Outcome(resumed_step=resume)
    # when every source redoes the step from kept gradients, it only waits for the receivers
    if me.rank in receivers and all(kept[r] for r in sources):
        out.catching_up = len(receivers)
    pairs = {}  # a pipeline stage's state comes from a source of the same stage
    for ranks in stages:
        pairs.update(assign_sources([r for r in receivers if r in ranks],
                                    [r for r in sources if r in ranks]))
    sent = received = 0
    t0 = time.time()
    for dst, src in pairs.items():
        if me.rank == src:
            sent += transfer.send_state(state.state(), dst,
                                        midway=lambda: send_hook(me.rank, resume))
        elif me.rank == dst:
            hook(me.rank, resume)
            got_state, received = transfer.recv_state(src)
            state.load(got_state)
            out.drop_kept_grads = True  # gradients of a state this rank no longer holds
    out.info = {"steps_by_rank": steps, "pairs": pairs, "bytes_sent": sent,
                "bytes_received": received, "transfer_s": time.time() - t0,
                "source": pairs.get(me.rank)}
    return out


def _start_equal(state: ProtectedState, me: Position, steps: list[int],
                 stages: list[list[int]], sources: list[int], resume: int) -> Outcome:
    """The launch's first agreement: every member takes `src`'s state (rank 0's, unless a
    failure took it before this), as torch's DDP broadcasts rank 0's parameters when it is
    built. A script that builds its model without a seed then trains equal replicas; a seeded
    one loses nothing (the bits are the same). Also after a failure during this broadcast: a
    member not yet through it asks for it again. Pipelined, each stage's first source sends
    its stage's state to the others of that stage, one at a time."""
    t0 = time.time()
    if len(stages) == 1:
        src = min(sources)
        got_state, moved = transfer.broadcast_state(state.state() if me.rank == src else None,
                                                    src, me.rank)
    else:
        mine = next(ranks for ranks in stages if me.rank in ranks)
        src, got_state, moved = min(r for r in sources if r in mine), None, 0
        for dst in mine:
            if dst != src and me.rank == src:
                moved += transfer.send_state(state.state(), dst)
            elif dst == me.rank != src:
                got_state, moved = transfer.recv_state(src)
    if got_state is not None:
        state.load(got_state)
    info = {"steps_by_rank": steps, "pairs": {}, "source": None if me.rank == src else src,
            "bytes_sent": moved if me.rank == src else 0,
            "bytes_received": 0 if me.rank == src else moved,
            "transfer_s": time.time() - t0, "start_broadcast_from": src}
    return Outcome(resumed_step=resume, drop_kept_grads=me.rank != src, info=info)


def _restore_shards(state: ProtectedState, me: Position, hook, send_hook, loaded) -> Outcome:
    t0 = time.time()
    replicas = state.replicas
    reshard_all(state.modules())
    has_state = me.holds_state or me.built
    mine = {"completed": me.completed if has_state else -1,
            "built": me.built and not me.holds_state, **replicas.summary(),
            "layout": getattr(state, "layout", None) if has_state else None}
    infos = [None] * me.world_size
    with communicating("exchanging which shard copies each member holds"):
        dist.all_gather_object(infos, mine)
    if reshard.needed(infos, me.world_size, state.layout_for):  # a shrink or grow: every slice cut anew
        return _reshard(state, me, infos, hook, send_hook, loaded, t0)
    newest = max(i["completed"] for i in infos)
    twins = state.twins(me.world_size)
    step = restorable_step(infos, twins)
    info = {"steps_by_rank": [i["completed"] for i in infos], "bytes_sent": 0,
            "bytes_received": 0, "pairs": {}, "source": None}
    # sharded gradients are reduced inside backward: there are none to keep
    if step is None:  # a peer-memory step is always preferred to disk when one exists
        return _restore_from_disk(state, me, info, newest, t0)
    senders = pick_senders(infos, step, twins)
    # A member with state rolls back to its own snapshot of `step`, even when it had completed
    # exactly `step`: the interrupted body may have touched its live state (a user's loop can
    # change anything before the collective that failed), and the snapshot is the state every
    # rank had at that boundary, byte for byte. Without one (it failed before taking it), its
    # live state is that boundary's: the body never started. A member that can reach `step`
    # neither way receives it, as a spare does.
    if has_state and me.rank not in senders:
        if step in replicas.own:
            skel, flat = replicas.own[step]
            state.load(transfer.unflatten_state(skel, flat))
            loaded(step)
        elif me.completed != step:
            raise RuntimeError(f"restore: rank {me.rank} has no snapshot of step {step} and "
                               f"completed {me.completed}")
    for f, (h, how) in sorted(senders.items()):
        if me.rank == h:
            if how == "held":  # a peer's copy in host memory; views: send_state packs them
                skel, flat = replicas.held[f][step]
                payload = transfer.unflatten_state(skel, flat, copy=False)
            else:  # a twin (HSDP): its live state is at `step` now, and is f's slice
                payload = state.state()
            info["bytes_sent"] += transfer.send_state(payload, f,
                                                      midway=lambda: send_hook(me.rank, step))
        elif me.rank == f:
            hook(me.rank, step)
            got_state, info["bytes_received"] = transfer.recv_state(h)
            state.load(got_state)
            loaded(step)
            info["source"] = h
    # replacements of ranks lost before the first commit that start from their own build
    built = [r for r, i in enumerate(infos) if i.get("built") and r not in senders]
    if built and me.rank == min(set(range(me.world_size)) - set(built)):
        print(f"[checkpointless] rank(s) {built} lost before any step was trained start from "
              f"their replacement's own build of the step-{step} state", flush=True)
    info.update(pairs={f: h for f, (h, _) in senders.items()},
                sent_from={f: how for f, (_, how) in senders.items()},
                restored_from="build" if built else "peer_memory",
                steps_redone=max(0, newest - step),
                transfer_s=time.time() - t0)
    return Outcome(resumed_step=step, drop_kept_grads=True, info=info)


def _reshard(state: ProtectedState, me: Position, infos: list[dict], hook, send_hook, loaded,
             t0: float) -> Outcome:
    """From peer memory when every old slice has a copy (reshard.py); else every member builds
    its objects for this generation and loads the newest durable checkpoint, cut for it."""
    newest = max(i["completed"] for i in infos)
    got = reshard.restore_resharded(state, me, infos, loaded, hook, send_hook)
    if got is None:
        reshard.rebuild_for(state, me)
        info = {"steps_by_rank": [i["completed"] for i in infos], "bytes_sent": 0,
                "bytes_received": 0, "pairs": {}, "source": None,
                "resharded": [None, me.world_size]}
        return _restore_from_disk(state, me, info, newest, t0)
    step, info = got
    info["steps_redone"] = max(0, newest - step)
    return Outcome(resumed_step=step, drop_kept_grads=True, info=info)


def _restore_from_disk(state: ProtectedState, me: Position, info: dict, newest: int,
                       t0: float) -> Outcome:
    if state.fallback is None:
        raise RuntimeError("a lost slice has no copy in any peer's memory and no durable "
                           "checkpoint is configured (set checkpoint.interval)")
    newest_step, load_step = state.fallback[:2]
    found = [None] * me.world_size
    with communicating("agreeing on the durable checkpoint to load"):
        # newest_step() first finishes this rank's checkpoint write in flight, whose commit may
        # add a newer checkpoint and rotate an older one away; once this gather returns no rank
        # writes any more, so the second answer is the same on every rank and stays on disk
        dist.all_gather_object(found, newest_step())
        dist.all_gather_object(found, newest_step())  # every rank must load the same one
    if None in found:
        raise RuntimeError("a lost slice has no copy in any peer's memory and no durable "
                           "checkpoint has been written yet")
    step = min(found)
    load_step(step)
    if me.rank == 0:
        print(f"[checkpointless] no peer holds every lost slice: all ranks resume from the "
              f"durable checkpoint at step {step} ({newest - step} steps to redo)", flush=True)
    state.replicas.own.clear()
    state.replicas.held.clear()
    info.update(restored_from="durable_checkpoint", steps_redone=max(0, newest - step),
                transfer_s=time.time() - t0)
    return Outcome(resumed_step=step, drop_kept_grads=True, info=info)


def _rewind(state: ProtectedState, me: Position, at_most: int, loaded) -> Outcome:
    """Every member (a spare too) loads the newest durable checkpoint at or before `at_most`;
    the checkpoints after it were written from a state that may be wrong, and go."""
    t0 = time.time()
    reshard_all(state.modules())  # FSDP as a step cut short left it (group.reshard_all)
    if state.fallback is None:
        raise RuntimeError("a worker computed wrong gradients and the job must go back to a "
                           "state known clean, but no durable checkpoint is configured (set "
                           "checkpoint.interval)")
    newest_step, load_step = state.fallback[:2]
    found = [None] * me.world_size
    with communicating("agreeing on the durable checkpoint known clean"):
        newest_step()  # a write in flight lands first: it must not land after the cleanup
        dist.all_gather_object(found, (newest_step(at_most), me.completed if me.holds_state
                                       else -1))
    newest = max(c for _, c in found)
    found = [f for f, _ in found]
    if None in found:
        raise RuntimeError(f"a worker computed wrong gradients: the job must go back to step "
                           f"{at_most} or before, and no durable checkpoint that old is left "
                           "(raise checkpoint.keep, or lower checkpoint.interval)")
    step = min(found)
    load_step(step)
    loaded(step)
    if len(state.fallback) > 2:
        state.fallback[2](step)  # drops the checkpoints after it
    if me.rank == 0:
        print(f"[checkpointless] every rank goes back to the durable checkpoint at step {step}, "
              f"known clean (the newest at or before step {at_most}); "
              f"{max(0, newest - step)} steps to redo", flush=True)
    if state.replicas is not None:
        state.replicas.own.clear()
        state.replicas.held.clear()
    info = dict(restored_from="durable_checkpoint", steps_redone=max(0, newest - step),
                transfer_s=time.time() - t0)
    return Outcome(resumed_step=step, drop_kept_grads=True, info=info)
