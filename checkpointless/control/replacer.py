"""The supervisor's hands on a loss: the loss recorded (the record first: survivors wait for
it), the stop rules applied (stops.py), each lost rank given to a ready, healthy spare, and the
next generation published (publisher.py). With checkpointless.shrink on, the lost ranks no ready
spare takes move to the survivors at once (a shrink); a spare that warms up later takes one back
(a grow, grower.py)."""
from __future__ import annotations

import time

from . import policy
from .. import protocol
from .job_state import JobState
from .losses import LossFinder
from .processes import Worker
from .publisher import Publisher
from .report import Failure
from .spares import Spares
from .stops import StopRules
from .stragglers import Stragglers

D = protocol.DEFAULTS


class Replacer:
    """Acts on the losses the `losses` finder found: takes them out of `state`'s membership,
    hands their ranks to the `pool`'s `spares` or shrinks the job, and has the `publisher`
    publish the next generation; `stops` ends the run when a rule says so. `cluster`: the pool
    spans nodes (a loss's line names its node)."""

    def __init__(self, cfg, state: JobState, pool, losses: LossFinder, spares: Spares,
                 stops: StopRules, publisher: Publisher, stragglers: Stragglers, log=print,
                 cluster: bool = False):
        self.cfg, self.state, self.pool, self.log, self.cluster = cfg, state, pool, log, cluster
        self.losses, self.spares, self.stops = losses, spares, stops
        self.publisher, self.stragglers = publisher, stragglers

    def handle(self, lost: list[tuple[Worker, bool]]) -> None:
        """The workers just found `lost` (each with whether it was hung), with any other that
        shows within the gather window: on record, checked against the stop rules, killed,
        taken out of the membership, and their ranks given on in one new generation."""
        s = self.state
        # the record first: survivors whose collective failed are waiting for it (failures.py)
        s.store.add(protocol.LOST, len(lost))
        # failures often come together (a node, a switch): give the others a moment to show,
        # so that one new generation replaces them all
        t_seen = time.time()
        time.sleep(D.gather_window_s)
        seen = {w.wid for w, _ in lost}
        more = [w for w in self.losses.exited() if w.wid not in seen]
        if more:
            s.store.add(protocol.LOST, len(more))
        lost += [(w, False) for w in more]
        for w, hung in lost:
            self.stops.on_loss(w, hung)
        for w, _ in lost:  # hung ones, and the children of dead ones (their sockets too)
            self.pool.kill(w)
        for w, hung in lost:
            self.record_failure(w, hung, t_seen)
        self._replace(s.pending())

    def record_failure(self, w: Worker, hung: bool, now: float) -> Failure:
        """Take a lost worker out of the membership, say so, and stop if nothing is left."""
        s, store = self.state, self.state.store
        err = protocol.read_json(store, protocol.error_key(w.wid))
        fault = protocol.read_json(store, protocol.fault_time_key(w.wid))
        # the step the job was in: a worker's newest beat can be one step old when it dies (its
        # reporter thread had not yet written it), so the others' progress counts too
        beat = self.pool.beats([w.wid]).get(w.wid)
        diverged = store.check([protocol.diverged_key(w.wid)])
        sdc = self.cfg.audit_every > 0 and store.check([protocol.sdc_key(w.wid)])
        slow = self.stragglers.evicted(w.wid)
        if slow and not fault:  # slowed from outside: it began with its first slow step
            fault = self.stragglers.began(store, w.wid)
        f = Failure(wid=w.wid, rank=w.rank,
                    cause=policy.cause(w.node_lost, hung, diverged, err, slow, sdc),
                    t_fail=fault["t"] if fault else w.lost_at or now, t_detect=now,
                    step=max(beat["step"] if beat else 0, s.job_step(self.pool)),
                    error=err["error"] if err else None, node=w.node)
        s.failures.append(f)
        where = f", node {w.node}" if self.cluster else ""
        code = w.proc.returncode
        self.log(f"[checkpointless] rank {w.rank} lost ({f.cause}, worker {w.wid}{where}, "
                 f"exit code {code}) at step {f.step}; detected "
                 f"{f.t_detect - f.t_fail:.2f} s after the " +
                 ("slowdown began" if slow and fault else "failure") + self._hosted_said(w.rank))
        if f.error:
            self.log(f"[checkpointless] rank {w.rank} raised:\n{f.error.rstrip()}")
        del s.ranks[w.wid]
        w.rank = -2
        self.stops.after_loss(f, w, code)
        return f

    def _hosted_said(self, rank: int) -> str:
        """What a lost process hosted, said when it is not just its own logical rank."""
        hosted = self.state.placement.hosts[rank]
        return "" if hosted == (rank,) else f"; it hosted logical ranks {list(hosted)}"

    def _replace(self, pending: list[Failure]) -> None:
        """Give each lost rank to a ready spare, waiting for one (the refill) if none is ready."""
        cfg, s = self.cfg, self.state
        if cfg.refill:
            # With spares enough for now, the refill starts a little later: its imports would
            # otherwise compete for CPU with the recovery itself.
            later = len(self.pool.spares(s.store, ready=True)) >= len(pending)
            for f in pending:
                self.pool.refill(self.pool.workers[f.wid], later)
        # no waiting: what no ready spare takes moves to the survivors. Not under audits: an
        # audit replays one process's step, and a process hosting two would not match it
        # (not below shrink_min_processes, nor over shrink_max_hosted: the lost ranks then wait
        # for spares, as with off)
        if cfg.shrink != "off" and not cfg.audit_every and self._can_shrink(pending):
            self._replace_or_shrink(pending)
            return
        t0, said = time.time(), False
        while (spares := self._choose(pending)) is None:
            ready = self.pool.spares(s.store, ready=True)
            self.stops.no_spare_left(len(pending))
            if not said:
                self.log(f"[checkpointless] waiting up to {cfg.spare_wait_s:.0f} s for a "
                         f"spare to warm up ({len(ready)} ready, {len(pending)} needed)")
                said = True
            self.stops.spare_wait_over(time.time() - t0)
            for w in self.losses.exited():  # another active worker may fail meanwhile: fold
                s.store.add(protocol.LOST, 1)  # it in
                self.pool.kill(w)  # its children, if any, hold its connections
                self.record_failure(w, False, time.time())
                self.pool.refill(w, later=False)
                pending = s.pending()
            time.sleep(D.spare_poll_s)
        self._give(pending, spares)
        self.publisher.publish()
        for f, spare in zip(pending, spares):
            f.gen = spare.took_over_gen = s.gen

    def _can_shrink(self, pending: list[Failure]) -> bool:
        """The survivors could host every lost rank (no spare counted): enough processes left,
        none over checkpointless.shrink_max_hosted (on a device, what the memory plan leaves).
        Else said, and the lost ranks wait for a spare."""
        placement = self.state.placement
        left = placement.processes - len(pending)
        try:
            if left < self.cfg.shrink_min_processes:
                raise ValueError(f"{left} processes would be left, fewer than the "
                                 f"{self.cfg.shrink_min_processes} this strategy and its "
                                 "memory plan need")
            placement.shrink(sorted(f.rank for f in pending), self.cfg.shrink_max_hosted or None)
            return True
        except ValueError as exc:
            self.log(f"[checkpointless] no shrink ({exc}; checkpointless.shrink_max_hosted="
                     f"{self.cfg.shrink_max_hosted}): the lost ranks wait for a spare")
            return False

    def _choose(self, pending: list[Failure]) -> list[Worker] | None:
        """A fit spare for each pending failure's rank, or None (spares.choose)."""
        return self.spares.choose([self.pool.workers[f.wid] for f in pending])

    def _give(self, given: list[Failure], spares: list[Worker]) -> None:
        """Each failure's rank to its spare, in the membership the next plan publishes."""
        t = time.time()
        for f, spare in zip(given, spares):
            spare.rank = f.rank
            self.state.ranks[spare.wid] = f.rank
            f.t_spare, f.new_wid, f.new_node = t, spare.wid, spare.node

    def _replace_or_shrink(self, pending: list[Failure]) -> None:
        """The ready spares take as many lost ranks as they cover; the rest shrink the job."""
        given, spares = [], []
        for k in range(len(pending), 0, -1):  # the longest run of losses the spares cover
            chosen = self._choose(pending[:k])
            if chosen is not None:
                given, spares = pending[:k], chosen
                break
        self._give(given, spares)
        rest = pending[len(given):]
        event = self._shrink(rest) if rest else None
        self.publisher.publish()
        for f, spare in zip(given, spares):
            f.gen = spare.took_over_gen = self.state.gen
        for f in rest:
            f.gen = self.state.gen
        if event:
            self.publisher.resized(event)

    def _shrink(self, rest: list[Failure]) -> dict:
        """Move the logical ranks of the lost processes in `rest` to the survivors and number
        the processes anew (the placement keeps their order); the shrink's report entry."""
        s, workers = self.state, self.pool.workers
        old, lost = s.placement, sorted(f.rank for f in rest)
        try:
            new = old.shrink(lost, self.cfg.shrink_max_hosted or None)
        except ValueError as exc:
            self.stops.shrink_refused(str(exc))
        survivors = [p for p in range(old.processes) if p not in lost]
        number = {p: i for i, p in enumerate(survivors)}
        wid_at = {number[r]: wid for wid, r in s.ranks.items()}  # new process -> worker
        for wid, r in list(s.ranks.items()):
            s.ranks[wid] = workers[wid].rank = number[r]
        self.publisher.place(new)
        t, said = time.time(), []
        for f in rest:
            f.shrunk = True
            f.moved = {r: wid_at[new.process_of(r)] for r in old.hosts[f.rank]}
            f.t_spare, f.new_wid = t, f.moved[old.hosts[f.rank][0]]
            f.new_node = workers[f.new_wid].node
            said += [f"logical rank {r} moves to process {new.process_of(r)} (worker {w})"
                     for r, w in f.moved.items()]
        self.log(f"[checkpointless] no spare ready: {', '.join(said)}; {new.processes} "
                 f"processes host {new.logical_world} logical ranks "
                 f"(checkpointless.shrink={self.cfg.shrink})")
        return {"kind": "shrink", "step": s.job_step(self.pool), "from_processes": old.processes,
                "to_processes": new.processes,
                "logical_ranks_moved": sorted(r for p in lost for r in old.hosts[p])}
