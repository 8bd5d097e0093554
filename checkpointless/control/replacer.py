"""The supervisor's hands on a failure: the loss recorded (the record first: survivors wait for
it), the stop rules applied, each lost rank given to a ready, healthy spare, and the next
generation published. With checkpointless.shrink on, the lost ranks no ready spare takes move
to the survivors at once (a shrink), and a spare that warms up later takes one back (a grow).
A half of `Supervisor` (supervisor.py), kept apart for its size."""
from __future__ import annotations

import json
import time
from ..protocol import membership
from ..protocol.placement import Placement
from . import policy
from .. import protocol
from .processes import Worker
from .report import Failure

D = protocol.DEFAULTS


def fit_spares(store, ready: list, said: dict, log=print) -> list:
    """The ready spares whose newest check in the store passed (policy.healthy_spares); each
    one set aside is said once per reason (`said`: wid -> the reason last said)."""
    found = [w for w in ready if store.check([protocol.health_key(w.wid)])]
    records = dict(zip([w.wid for w in found],
                       (json.loads(v) for v in store.multi_get(
                           [protocol.health_key(w.wid) for w in found])))) if found else {}
    fit, unfit = policy.healthy_spares(ready, records)
    nodes = {w.wid: w.node for w in ready}
    for wid, why in unfit.items():
        if said.get(wid) != why:
            said[wid] = why
            log(f"[checkpointless] spare worker {wid} (node {nodes[wid]}) is not promoted: its "
                f"node is unhealthy ({why}); the next spare is taken")
    return fit


class Replacing:
    """Mixed into `Supervisor`: acts on its store, pool, ranks, failures and facts."""

    def _handle(self, lost: list[tuple[Worker, bool]]) -> None:
        # the record first: survivors whose collective failed are waiting for it (failures.py)
        self.store.add(protocol.LOST, len(lost))
        # failures often come together (a node, a switch): give the others a moment to show,
        # so that one new generation replaces them all
        t_seen = time.time()
        time.sleep(D.gather_window_s)
        seen = {w.wid for w, _ in lost}
        more = [w for w in self._exited() if w.wid not in seen]
        if more:
            self.store.add(protocol.LOST, len(more))
        lost += [(w, False) for w in more]
        for w, hung in lost:
            code = None if hung or w.node_lost else w.proc.returncode
            err = protocol.read_json(self.store, protocol.error_key(w.wid))
            self._stop_if(policy.startup_failure(w.wid, w.rank, code,
                                                 self.store.check([protocol.ready_key(w.wid)]),
                                                 err and err["error"]))
            self._stop_if(policy.clean_exit(w.wid, w.rank, w.proc.returncode, hung,
                                            w.node_lost))
        for w, _ in lost:  # hung ones, and the children of dead ones (their sockets too)
            self.pool.kill(w)
        for w, hung in lost:
            self._record_failure(w, hung, t_seen)
        self._replace([f for f in self.failures if f.gen < 0])

    def _record_failure(self, w: Worker, hung: bool, now: float) -> Failure:
        """Take a lost worker out of the membership, say so, and stop if nothing is left."""
        err = protocol.read_json(self.store, protocol.error_key(w.wid))
        fault = protocol.read_json(self.store, protocol.fault_time_key(w.wid))
        # the step the job was in: a worker's newest beat can be one step old when it dies (its
        # reporter thread had not yet written it), so the others' progress counts too
        beat = self.pool.beats([w.wid]).get(w.wid)
        diverged = self.store.check([protocol.diverged_key(w.wid)])
        sdc = self.cfg.audit_every > 0 and self.store.check([protocol.sdc_key(w.wid)])
        slow = self.stragglers.evicted(w.wid)
        if slow and not fault:  # slowed from outside: it began with its first slow step
            fault = self.stragglers.began(self.store, w.wid)
        f = Failure(wid=w.wid, rank=w.rank,
                    cause=policy.cause(w.node_lost, hung, diverged, err, slow, sdc),
                    t_fail=fault["t"] if fault else w.lost_at or now, t_detect=now,
                    step=max(beat["step"] if beat else 0, self._job_step()),
                    error=err["error"] if err else None, node=w.node)
        self.failures.append(f)
        where = f", node {w.node}" if self.cluster else ""
        code = w.proc.returncode
        self.log(f"[checkpointless] rank {w.rank} lost ({f.cause}, worker {w.wid}{where}, "
                 f"exit code {code}) at step {f.step}; detected "
                 f"{f.t_detect - f.t_fail:.2f} s after the " +
                 ("slowdown began" if slow and fault else "failure") + self._hosted_said(w.rank))
        if f.error:
            self.log(f"[checkpointless] rank {w.rank} raised:\n{f.error.rstrip()}")
        del self.ranks[w.wid]
        w.rank = -2
        if w.took_over_gen is not None:  # a replacement: did it complete a step?
            stepped = any(self.store.check([protocol.first_commit_key(g, f.rank)])
                          for g in range(w.took_over_gen, self.gen + 1))
            crashes = policy.crashes_after(self._crashes.get(f.rank, 0), stepped)
            self._crashes[f.rank] = crashes
            self._stop_if(policy.crash_loop(f.rank, crashes, self.cfg.max_replacement_failures,
                                            f.error, code))
        self._stop_if(policy.disabled(self.cfg.enabled, f.rank, w.wid, f.cause, code))
        self._stop_if(policy.escalation(self.failures, f))
        self._stop_if(policy.none_left(len(self.ranks),
                                       [g.error for g in self.failures if g.error]))
        return f

    def _hosted_said(self, rank: int) -> str:
        """What a lost process hosted, said when it is not just its own logical rank."""
        hosted = self.placement.hosts[rank]
        return "" if hosted == (rank,) else f"; it hosted logical ranks {list(hosted)}"

    def _job_step(self) -> int:
        """The step the job is at: the furthest of the active workers' heartbeats, or the step
        after rank 0's newest committed one (heartbeats from other nodes come at most one
        health record late)."""
        last = protocol.read_json(self.store, protocol.LAST_STEP)  # an integer, or None
        return max(policy.job_step(self.pool.beats(list(self.ranks)).values()),
                   0 if last is None else last + 1)

    def _replace(self, pending: list[Failure]) -> None:
        """Give each lost rank to a ready spare, waiting for one (the refill) if none is ready."""
        cfg = self.cfg
        if cfg.refill:
            # With spares enough for now, the refill starts a little later: its imports would
            # otherwise compete for CPU with the recovery itself.
            later = len(self.pool.spares(self.store, ready=True)) >= len(pending)
            for f in pending:
                self.pool.refill(self.workers[f.wid], later)
        # no waiting: what no ready spare takes moves to the survivors. Not under audits: an
        # audit replays one process's step, and a process hosting two would not match it
        # (not below shrink_min_processes, nor over shrink_max_hosted: the lost ranks then wait
        # for spares, as with off)
        if cfg.shrink != "off" and not cfg.audit_every and self._can_shrink(pending):
            self._replace_or_shrink(pending)
            return
        t0, said = time.time(), False
        while (spares := self._choose_spares(pending)) is None:
            ready = self.pool.spares(self.store, ready=True)
            self._stop_if(policy.no_spare_left(
                len(pending), len(self.pool.spares(self.store, ready=False)), cfg.spares,
                cfg.refill))
            if not said:
                self.log(f"[checkpointless] waiting up to {cfg.spare_wait_s:.0f} s for a "
                         f"spare to warm up ({len(ready)} ready, {len(pending)} needed)")
                said = True
            self._stop_if(policy.spare_wait_over(time.time() - t0, cfg.spare_wait_s))
            for w in self._exited():  # another active worker may fail meanwhile: fold it in
                self.store.add(protocol.LOST, 1)
                self.pool.kill(w)  # its children, if any, hold its connections
                self._record_failure(w, False, time.time())
                self.pool.refill(w, later=False)
                pending = [f for f in self.failures if f.gen < 0]
            time.sleep(D.spare_poll_s)
        t = time.time()
        for f, spare in zip(pending, spares):
            spare.rank = f.rank
            self.ranks[spare.wid] = f.rank
            f.t_spare, f.new_wid, f.new_node = t, spare.wid, spare.node
        self._publish()
        for f, spare in zip(pending, spares):
            f.gen = spare.took_over_gen = self.gen

    def _can_shrink(self, pending: list[Failure]) -> bool:
        """The survivors could host every lost rank (no spare counted): enough processes left,
        none over checkpointless.shrink_max_hosted (on a device, what the memory plan leaves).
        Else said, and the lost ranks wait for a spare."""
        left = self.placement.processes - len(pending)
        try:
            if left < self.cfg.shrink_min_processes:
                raise ValueError(f"{left} processes would be left, fewer than the "
                                 f"{self.cfg.shrink_min_processes} this strategy and its "
                                 "memory plan need")
            self.placement.shrink(sorted(f.rank for f in pending),
                                  self.cfg.shrink_max_hosted or None)
            return True
        except ValueError as exc:
            self.log(f"[checkpointless] no shrink ({exc}; checkpointless.shrink_max_hosted="
                     f"{self.cfg.shrink_max_hosted}): the lost ranks wait for a spare")
            return False

    def _choose_spares(self, pending: list[Failure]) -> list[Worker] | None:
        lost = [self.workers[f.wid] for f in pending]
        return policy.choose_spares(self._healthy(self.pool.spares(self.store, ready=True)),
                                    [(w.node, w.slot) for w in lost],
                                    self.pool.lost_node_ids(), self.pool.spare_node_ids())

    def _healthy(self, ready: list[Worker]) -> list[Worker]:
        """The ready spares whose newest health check passed (fit_spares)."""
        return fit_spares(self.store, ready, self._unhealthy_said, self.log)

    def _replace_or_shrink(self, pending: list[Failure]) -> None:
        """The ready spares take as many lost ranks as they cover; the rest shrink the job."""
        given, spares = [], []
        for k in range(len(pending), 0, -1):  # the longest run of losses the spares cover
            chosen = self._choose_spares(pending[:k])
            if chosen is not None:
                given, spares = pending[:k], chosen
                break
        t = time.time()
        for f, spare in zip(given, spares):
            spare.rank = f.rank
            self.ranks[spare.wid] = f.rank
            f.t_spare, f.new_wid, f.new_node = t, spare.wid, spare.node
        rest = pending[len(given):]
        event = self._shrink(rest) if rest else None
        self._publish()
        for f, spare in zip(given, spares):
            f.gen = spare.took_over_gen = self.gen
        for f in rest:
            f.gen = self.gen
        if event:
            self._resized(event)

    def _shrink(self, rest: list[Failure]) -> dict:
        """Move the logical ranks of the lost processes in `rest` to the survivors and number
        the processes anew (the placement keeps their order); the shrink's report entry."""
        old, lost = self.placement, sorted(f.rank for f in rest)
        try:
            new = old.shrink(lost, self.cfg.shrink_max_hosted or None)
        except ValueError as exc:
            self._stop_if(policy.shrink_refused(str(exc), self.cfg.shrink_max_hosted))
        survivors = [p for p in range(old.processes) if p not in lost]
        number = {p: i for i, p in enumerate(survivors)}
        wid_at = {number[r]: wid for wid, r in self.ranks.items()}  # new process -> worker
        for wid, r in list(self.ranks.items()):
            self.ranks[wid] = self.workers[wid].rank = number[r]
        self._place(new)
        t, said = time.time(), []
        for f in rest:
            f.shrunk = True
            f.moved = {r: wid_at[new.process_of(r)] for r in old.hosts[f.rank]}
            f.t_spare, f.new_wid = t, f.moved[old.hosts[f.rank][0]]
            f.new_node = self.workers[f.new_wid].node
            said += [f"logical rank {r} moves to process {new.process_of(r)} (worker {w})"
                     for r, w in f.moved.items()]
        self.log(f"[checkpointless] no spare ready: {', '.join(said)}; {new.processes} "
                 f"processes host {new.logical_world} logical ranks "
                 f"(checkpointless.shrink={self.cfg.shrink})")
        return {"kind": "shrink", "step": self._job_step(), "from_processes": old.processes,
                "to_processes": new.processes,
                "logical_ranks_moved": sorted(r for p in lost for r in old.hosts[p])}

    def _grow_if_ready(self) -> None:
        """While some process hosts more than one logical rank and a healthy spare is ready,
        grow at a step boundary: a notice (kind "regroup") asks every worker of this
        generation to stop before the step after next, where they wait for a new plan (as for a
        straggler's leave) instead of aborting a step in flight and redoing it; once the job
        is there, the spares join as new processes, each taking a logical rank back
        (Placement.grow), and receive the state from their peers as a replacement does."""
        at = self.grow_at
        if at is not None:  # announced: publish once the job reached the boundary, whatever
            if at[0] != self.gen or self._ending():  # came since (the workers wait there for a
                self.grow_at = None  # plan). A failure's plan came first (its generation needs a
            elif self._job_step() >= at[1]:  # notice of its own), or the job ended before it
                self.grow_at = None
                self._grow(at[1])
            return
        old = self.placement
        if self.cfg.shrink == "off" or old.processes >= old.logical_world or \
                self.preempted_at is not None or any(f.gen < 0 for f in self.failures):
            return
        if self._ending():
            return
        if not self._healthy(self.pool.spares(self.store, ready=True)):
            return
        # two steps on, as for a straggler: every worker learns of it first
        self.grow_at = (self.gen, self._job_step() + 2)
        self._notice(kind="regroup", gen=self.gen, before_step=self.grow_at[1])
        self.log(f"[checkpointless] a spare is ready: the job grows before step "
                 f"{self.grow_at[1]} (every process stops there for the new plan)")

    def _ending(self) -> bool:
        """Rank 0's result is in, or a rank is done: a new generation would only delay the
        end. Two reads, not one per rank, on every turn of the loop while shrunk."""
        return self.store.check([protocol.result_key(0)]) or \
            membership.counter(self.store, protocol.DONE) > 0

    def _grow(self, step: int) -> None:
        """The grow announced for the boundary before `step`, where every worker now waits for
        a plan: with no healthy spare ready any more, one with the same placement."""
        old = self.placement
        ready = self._healthy(self.pool.spares(self.store, ready=True))
        if not ready:
            self.log(f"[checkpointless] the spare is no longer ready at step {step}: the job "
                     "goes on with the same processes")
            self._publish()
            return
        spares = ready[:old.logical_world - old.processes]
        new = old.grow(len(spares))
        said = []
        for i, w in enumerate(spares):
            w.rank = self.ranks[w.wid] = old.processes + i
            said.append(f"logical rank {new.hosts[w.rank][0]} moves to process {w.rank} "
                        f"(spare worker {w.wid})")
        self._place(new)
        event = {"kind": "grow", "step": self._job_step(), "from_processes": old.processes,
                 "to_processes": new.processes,
                 "logical_ranks_moved": sorted(new.hosts[w.rank][0] for w in spares)}
        self._publish()
        for w in spares:
            w.took_over_gen = self.gen
        self.log(f"[checkpointless] spare ready: {', '.join(said)}; {new.processes} processes "
                 f"host {new.logical_world} logical ranks (checkpointless.shrink="
                 f"{self.cfg.shrink})")
        self._resized(event)

    def _place(self, new: Placement) -> None:
        """A new placement: the stragglers' figures measured under the old one compare
        unlike loads, and a process hosting more than one logical rank is slow by design."""
        self.placement = new
        self.stragglers.placement_changed(max(new.loads()) > 1)

    def _resized(self, event: dict) -> None:
        """A shrink or grow, on record (the report's `shrinks` and `grows`, and the facts)."""
        self.resizes.append(event)
        self.ledger.record_resize(len(self.resizes) - 1, event)

    def _publish(self) -> None:
        """The next generation's plan: what changed since the last one, node by node. Its world
        is the processes of the placement; after a shrink, each lists its logical ranks."""
        self.gen += 1
        self._issue_rewind()  # before the plan: its members read it as they restore
        pl = self.placement
        hosts = {} if pl.hosts == Placement.identity(pl.logical_world).hosts else \
            {wid: list(pl.hosts[r]) for wid, r in self.ranks.items()}
        plan = membership.Plan(gen=self.gen, world_size=pl.processes, ranks=dict(self.ranks),
                               lost=membership.counter(self.store, protocol.LOST),
                               nodes={wid: self.workers[wid].node for wid in self.ranks},
                               hosts=hosts,
                               logical_world=pl.logical_world if self.cfg.shrink != "off" else 0)
        self.facts.record_plan(plan, plan.lost, self.pool.next_wid)  # etcd first: a takeover
        membership.publish(self.store, plan, self._plan)  # finds every published plan there
        self._plan = plan
