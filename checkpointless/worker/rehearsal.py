"""The replay rehearsal: one early step run twice, the state put back between, compared bit for bit.

A recovery redoes the step a failure cut short: the survivors put their state back to the step's
start (or keep it, when the update had not landed) and run the body again, and a replacement runs
it for the first time from the state it received. The run ends with a failure-free run's bits
only if running a step's body again from the same state gives the same result: the step is a
function of the protected state, the step number and the batch the loop hands it. A script
breaks that without noticing when it draws the next step's batch inside the current step (a
prefetch), keeps state across steps that `protect()` does not hold (a scheduler, an EMA, a
counter), or uses a nondeterministic kernel.

So early in every run (the launch's second step) the step boundary rehearses a recovery: it keeps
a host copy of the protected state, lets the step run, puts the state back as a recovery would and
ends the step uncommitted, so that every loop comes back to the same step (with the same batch)
and runs it again. Each attempt is described by four digests, in the order the step computes
them: the parameters the forward read, the forward's output, the gradient contributions before the
reduction (audit.GradTap) and the protected state after the update. The first digest that
differs says what went wrong; the ranks' findings go to the store, where rank 0 gathers them into
the job's verdict and says it in one message. `checkpointless.replay_check`: warn (say it, train
on), strict (stop the run), off (no rehearsal).

Only the launch's first generation rehearses: its ranks started together at one step, so each
decides alone and all decide alike. A failure during the rehearsal ends it unchecked (the
recovery restores the state as always); the redo check (`redo_mismatch`, fed by grads.KeptGrads)
then compares each step a survivor recomputes after a recovery with what it had computed before.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time

import torch

from .. import protocol
from ..protocol.replay import GATHER_S, RULE, judge, say
from .audit import GradTap, checksum
from .data import Position
from .transfer import flatten_state, strip_tensors, unflatten_state


class ReplayMismatch(RuntimeError):
    """Under replay_check=strict: the rehearsed step gave other bits the second time."""


def _object_digests(state) -> dict[str, str]:
    """Per protected object: a digest of its state (every tensor's bits and the values around
    them), on this rank's part of sharded tensors, with no collective."""
    out = {}
    for name, value in state.state().items():
        skeleton, tensors = strip_tensors(value)
        # an object's default repr names its address, which differs between two reads
        h = hashlib.sha256(re.sub(r" at 0x[0-9a-fA-F]+", "", repr(skeleton)).encode())
        for t in tensors:
            h.update(int(checksum(t)).to_bytes(8, "little", signed=True))
        out[name] = h.hexdigest()[:16]
    return out


class Rehearsal:
    """One worker's part in the rehearsal and the redo check, driven by its StepLoop."""

    def __init__(self, mode: str, state, kept, store, log=print):
        self.mode, self.state, self.kept, self.store = mode, state, kept, store
        self.log = log
        self.at: int | None = None  # the step rehearsed (planned at start, generation 0 only)
        self.attempt = 0  # 1 or 2: that attempt's body is in flight or was the last to end
        self.first: dict | None = None  # the first attempt's digests
        self._snapshot = None  # (skeleton, flat): the protected state at the step's start
        self._taps: list[GradTap] = []
        self._hooks: list = []
        self._outputs: torch.Tensor | None = None
        self.finding: dict | None = None  # this rank's finding once the rehearsal ended
        self.verdict: dict | None = None  # the job's, on rank 0 (protocol.replay.judge)
        self.redo_seen = 0  # redo mismatches this rank recorded
        self._t0 = self.cost_s = 0.0
        self._in_first = False  # the first attempt's body is in flight (open to close)

    # ---- where it stands ------------------------------------------------------------------
    def plan(self, gen: int, completed: int) -> None:
        """At the loop's start: the launch's generation rehearses its second step."""
        if self.mode != "off" and gen == 0 and self.at is None:
            self.at = completed + 1

    def due(self, step: int, gen: int) -> bool:
        return self.at == step and gen == 0 and self.finding is None

    @property
    def rehearsing(self) -> bool:
        """The first attempt's body runs (from open to close, on every rank alike): its effects
        outside the protected state (a checkpoint written, a line logged) are the second
        attempt's to make."""
        return self._in_first

    def second_pass(self, step: int, gen: int) -> bool:
        """The step about to run is the rehearsal's second attempt."""
        return self.due(step, gen) and self.first is not None

    # ---- the attempts ---------------------------------------------------------------------
    def open(self, step: int, gen: int) -> None:
        """A step's body starts: take the snapshot before the first attempt, arm the taps for
        either."""
        if not self.due(step, gen):
            return
        if self.first is None:
            self._t0 = time.perf_counter()
            state = self.state.state()
            short = _host_short(state, int(getattr(self.state.spec, "workers_per_node", 1)))
            if short:
                self._abandon(step, short)
                return
            skeleton, flat = flatten_state(state)
            self._snapshot = (skeleton, flat)
            self.attempt, self._in_first = 1, True
        else:
            self.attempt = 2
        self._arm(step)

    def close(self, step: int, gen: int, failed: bool, applied: bool) -> str | None:
        """A step's body ended. "redo": the first attempt ended cleanly and the state is back
        at the step's start (the step must not commit); "mismatch": the second attempt differed
        under strict (the caller commits, then stops the run); None otherwise."""
        self._in_first = False
        if not self.due(step, gen):
            return None
        if self.attempt == 0:  # the body ran without open(): nothing was kept to compare
            return self._abandon(step, "the loop's steps do not open (with job.step(), or "
                                 "steploop.open), so there is no step to run again")
        digests = self._disarm()
        if failed and not applied:  # cut short before the update: the recovery restores it
            return self._abandon(step, "a failure cut the rehearsed step short")
        digests["state"] = _object_digests(self.state)
        if self.attempt == 1:
            if failed:  # the update landed, then a peer was lost: the step stands as it is
                return self._abandon(step, "a failure followed the rehearsed step's update")
            self.first = digests
            self._put_back()
            # what the rehearsal cost this rank: the snapshot, the first attempt, the put-back
            self.cost_s = round(time.perf_counter() - self._t0, 4)
            return "redo"
        self._snapshot = None
        differs = [k for k in ("params", "output", "grads") if digests[k] != self.first[k]]
        objects = sorted(k for k in digests["state"]
                         if digests["state"][k] != self.first["state"].get(k))
        if objects:
            differs.append("state")
        self.finding = {"step": step, "differs": differs, "objects": objects,
                        "cost_s": self.cost_s}
        return "mismatch" if differs and self.mode == "strict" else None

    def interrupted(self) -> None:
        """A failure came between the two attempts (the first ended cleanly, the second never
        opened in this generation): the rehearsal is over, unchecked, its copy freed. Called
        as the loop recovers."""
        if self.finding is None and self.first is not None:
            self.first = None
            self._abandon(self.at, "a failure came between the rehearsed step's two attempts")

    def _put_back(self) -> None:
        """The state at the step's start, as a recovery restores it: loaded whole, gradients
        cleared, none kept (the second attempt computes them, as a replacement would). A loop
        position's pending move (not part of its state: the drop-in's next epoch, waiting for
        its first commit) stays as it was."""
        skeleton, flat = self._snapshot
        pending = {n: o.pending for n, o in self.state.objects.items() if isinstance(o, Position)}
        self.state.load(unflatten_state(skeleton, flat))
        for name, move in pending.items():
            self.state.objects[name].pending = move
        self.state.zero_grads()
        self.kept.drop()
        self.state.update_applied = False

    def _abandon(self, step: int, why: str) -> None:
        self._snapshot, self.attempt, self._in_first = None, 0, False
        self.finding = {"step": step, "differs": None, "why": why}
        return None

    def _arm(self, step: int) -> None:
        self._outputs = None
        modules = self.state.modules()
        self._taps = [GradTap(m) for m in modules]
        for tap in self._taps:
            tap.arm(step)
        self._hooks = [m.register_forward_hook(self._on_output) for m in modules]

    def _disarm(self) -> dict:
        found = [tap.digests() for tap in self._taps]
        for tap in self._taps:
            tap.remove()
        for h in self._hooks:
            h.remove()
        self._taps, self._hooks = [], []
        grads = sum(f[0] for f in found if f is not None)
        params = sum(f[1] for f in found if f is not None)
        out = None if self._outputs is None else int(self._outputs.item())
        self._outputs = None
        return {"params": params, "output": out, "grads": grads}

    def _on_output(self, module, args, output) -> None:
        if not torch.is_grad_enabled():  # an evaluation inside the step is not the step
            return
        _, tensors = strip_tensors(output if isinstance(output, (dict, list, tuple)) else
                                   dict(output) if hasattr(output, "keys") else [output])
        for t in tensors:
            if t.is_floating_point() or t.dtype in (torch.int64, torch.int32):
                s = checksum(t)
                self._outputs = s if self._outputs is None else self._outputs + s.to(
                    self._outputs.device)

    # ---- the verdict ----------------------------------------------------------------------
    def publish(self, rank: int, world: int, moved, beat=lambda: None) -> dict | None:
        """After the rehearsal ended on this rank: its finding to the store. Rank 0, having
        compared both attempts, gathers every rank's (until `moved()`: a failure ends the wait),
        writes the job's verdict and says it; the verdict on rank 0, else None. (A rehearsal cut
        short waits for nobody: the supervisor's report judges from what the ranks left.)
        `beat()` keeps rank 0's heartbeat going while it waits."""
        if self.finding is None or self.finding.get("published"):
            return None
        self.finding["published"] = True
        mine = {k: v for k, v in self.finding.items() if k != "published"}
        self.store.set(protocol.replay_rank_key(rank), json.dumps({**mine, "rank": rank}))
        self.store.add(protocol.REPLAY_RANKS, 1)
        if rank != 0 or mine["differs"] is None:
            return None
        deadline, beaten = time.time() + GATHER_S, time.time()
        while self.store.add(protocol.REPLAY_RANKS, 0) < world and time.time() < deadline \
                and not moved():
            if time.time() - beaten > 0.5:
                beat()
                beaten = time.time()
            time.sleep(0.01)
        found = [protocol.read_json(self.store, protocol.replay_rank_key(r))
                 for r in range(world)]
        verdict = judge([f for f in found if f], world, self.mode)
        self.store.set(protocol.REPLAY, json.dumps(verdict))
        if verdict["replayable"] is False:
            self.log(say(verdict), file=sys.stderr, flush=True)
        self.verdict = verdict
        return verdict

    def redo_mismatch(self, step: int, rank: int, what: str) -> None:
        """The redo check: a step recomputed after a recovery differed from what this survivor
        had computed of it before the failure (kept gradients, grads.KeptGrads)."""
        self.redo_seen += 1
        i = self.store.add(protocol.REPLAY_REDO, 1)
        self.store.set(protocol.replay_redo_key(i), json.dumps(
            {"step": step, "rank": rank, "what": what}))
        self.log(f"[checkpointless] replay check: rank {rank} redid step {step} after a recovery "
                 f"and its {what} differed from the first time; this run's bits are not those of "
                 f"a run without failures. See {RULE}", file=sys.stderr, flush=True)


def _host_short(state, workers_per_node: int) -> str | None:
    """Why a host copy of `state` would not fit in this worker's share of the node's free
    memory (with room to spare), or None. Checked before the rehearsal takes one: a run is never
    put at risk for the check (it is then said unchecked, with this reason)."""
    _, tensors = strip_tensors(state)
    need = sum(t.numel() * t.element_size() for t in tensors)
    try:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None
    share = free / max(1, workers_per_node)
    if 2 * need <= share:
        return None
    return (f"a host copy of this rank's state ({need / 1e9:.1f} GB) would not fit twice in "
            f"its share of the node's free memory ({share / 1e9:.1f} GB)")

