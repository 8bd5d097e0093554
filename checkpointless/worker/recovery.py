"""The recovery state machine of one worker: from a failed step to the resumed one.

    TRAINING --step body--> IN_STEP --commit--> TRAINING
                               |
                    a peer failure (failures.py)
                               v
    FAILED --next steps() turn--> WAITING (for the supervisor's next plan)
           --> REGROUPING (group.py: barrier on the store, fresh process group)
           --> RESTORING (restore.py: agree on a step, receive or roll back) --> TRAINING

A spare starts in WAITING, and a worker of the first generation too; either builds its group in
join() and stops at JOINED until its first `steps()` call, when `protect()` has said what the state
is and the restore can run. A failure during REGROUPING or RESTORING (a second peer lost) goes back
to WAITING for the plan that replaces that peer too.
"""
from __future__ import annotations

import enum
import threading
import time
from dataclasses import asdict
from datetime import timedelta

from ..protocol import membership
from .. import protocol
from ..protocol.records import Entered
from . import restore
from .failures import Evicted, MembershipMoved, is_peer_failure
from .injector import FaultInjector
from .grads import KeptGrads
from .group import Group, Watch
from .reporter import Reporter
from .state import ProtectedState


class Phase(enum.Enum):
    """Where a worker is in the recovery state machine (see the diagram above)."""

    WAITING = "waiting"  # for a plan that includes this worker
    REGROUPING = "regrouping"  # building the group of a new generation
    JOINED = "joined"  # group built at join(); state agreed at the first steps() call
    RESTORING = "restoring"  # agreeing on a step and moving state between members
    TRAINING = "training"  # between steps
    IN_STEP = "in_step"  # inside a step's body: the watch thread may abort the group
    FAILED = "failed"  # a peer failure cut the step short; recovery runs at the next turn


# the phases in which a newer plan cuts this worker's group short: a step, and a recovery's own
# group forming or state moving (a second member lost inside a recovery)
_ABORTABLE = (Phase.IN_STEP, Phase.REGROUPING, Phase.RESTORING)


class Recovery:
    """Owns this worker's place in the job and its phase: generation, rank, world size, committed
    steps, whether it holds the state; waiting for plans, entering a generation, and the records
    (commits, generation entries) the supervisor reads to time each recovery."""

    def __init__(self, store, worker_id: int, spec: protocol.Spec, host: str, port: int,
                 state: ProtectedState, kept: KeptGrads, injector: FaultInjector,
                 reporter: Reporter, node_port: int = 0, node: int = 0):
        self.store, self.worker_id, self.spec = store, worker_id, spec
        self.state, self.kept, self.injector = state, kept, injector
        self.reporter, self.node = reporter, node
        # the node's own store (its heartbeats, the plans its agent copies there, the barrier's
        # first gathering and its outcome), or the main one on the coordinator's node
        plans_at = protocol.node_store_address(host, port, node_port)
        self.node_store = membership.connect(*plans_at) if node_port else store
        self.group = Group(store, self.node_store, spec.backend, spec.pg_timeout_s,
                           {port, node_port} - {0}, state.modules, spec.shard_size,
                           spec.tp_size, connect=lambda: membership.connect(host, port),
                           pp_size=spec.pp_size)
        self.watch = Watch(host, port, lambda: self.gen, self._abort_from_watch,
                           plans_at=plans_at)
        # held while the watch thread judges and aborts, and while this thread enters a step or
        # a generation: the abort can then only hit a step of an older generation
        self._gate = threading.Lock()
        self._phase = Phase.WAITING  # changed only by this class's transitions below
        self.plan: membership.Seat | None = None
        self.gen, self.rank, self.world_size = -1, -1, 0
        self.completed = 0  # committed steps
        self.holds_state = True
        self.own_build = True  # its own build is a state the job may start from (join())
        self.agreed = False  # through a restore since the launch (restore.Position)
        self.catching_up = 0
        self.awaiting_first: int | None = None  # generation whose first commit is not yet recorded
        self.last: dict | None = None  # how the newest generation was entered
        self.t_group = 0.0

    @property
    def phase(self) -> Phase:
        return self._phase

    def _abort_from_watch(self, newer_gen: int) -> None:
        """The watch saw generation `newer_gen`: abort this worker's group if it is inside a
        step of an older one. Seen in CI: the check made before the watch thread lost the CPU,
        the abort after this worker had recovered into the new generation, whose group it then
        destroyed under the next collective."""
        with self._gate:
            if self._phase not in _ABORTABLE or self.gen >= newer_gen:
                return
            if self._phase is Phase.REGROUPING:  # a member lost inside the group's rendezvous
                self.group.cut_rendezvous()
            # gloo's abort does not release a blocked collective; shutting the sockets does,
            # even when a dead peer's forked children keep its end open
            self.group.release_peers()
            Group.abort()

    # ---- waiting ---------------------------------------------------------------------------
    def wait_plan(self, after_gen: int, timeout_s: float | None) -> membership.Seat:
        """This worker's seat in the newest plan with generation > after_gen that includes it.

        Nothing polls: a spare blocks in the store until the next plan is published; a rank
        (its watch thread is running) sleeps until that thread sees the next plan, beating every
        heartbeat_every_s meanwhile, so that the supervisor does not take a long spare wait for a
        hang."""
        self._phase = Phase.WAITING
        deadline = None if timeout_s is None else time.time() + timeout_s
        seen = after_gen  # plans up to here are read
        while True:
            # the watch saw the newest plan already (a recovery), or the store says (a start)
            g = self.watch.latest_gen if self.watch.latest_gen > seen else \
                membership.current_gen(self.node_store)
            if g > seen:
                seat = membership.follow(self.node_store, self.worker_id, self.node, self.rank,
                                         seen, g)
                if seat is not None:
                    return seat
                if self.rank >= 0:
                    raise Evicted(f"worker {self.worker_id} is not in generation {g}")
                seen = g  # a spare not picked this time keeps waiting
            if self.store.check([protocol.SHUTDOWN]):
                raise SystemExit(0)
            if deadline is not None and time.time() > deadline:
                raise TimeoutError(f"no new membership within {timeout_s:.0f} s after a failure")
            if self.rank < 0:
                self._block_until_plan(seen + 1)
                continue
            self.reporter.beat(self.completed, self.gen, "recover")
            self.watch.wait_newer(seen, protocol.DEFAULTS.heartbeat_every_s)

    def _block_until_plan(self, gen: int) -> None:
        try:
            self.node_store.wait([protocol.plan_key(gen)], timedelta(days=1))
        except Exception:  # the store is gone: the supervisor ended
            if not self.store_alive():
                raise SystemExit(0)

    def store_alive(self) -> bool:
        try:
            self.store.check([protocol.GEN])
            return True
        except Exception:
            return False

    def join(self, plan: membership.Seat) -> None:
        """A new worker's first plan: build its group (JOINED); the state waits for sync_first.

        Workers of the first generation all start from the same seeded state; a worker that
        joins later is a spare and holds nothing until it receives the state."""
        # a worker launched as a rank built its own state even when the first plan it reads is
        # a later one (a peer was lost before the first group formed)
        self.holds_state = plan.gen == 0 or not protocol.started_as_spare()
        # a spare taking a rank before any step was committed: nothing was trained, so its own
        # build (if it makes one: Job.builds_own_state) is that rank's step-0 state
        self.own_build = self.holds_state or not self.store.check([protocol.LAST_STEP])
        self.watch.start()  # before the first group forms: a newer plan cuts that short too
        self.enter(plan, sync=False)

    def resume_at(self, step: int) -> None:
        """Count from `step` (a checkpoint was loaded), before the first step."""
        self.completed = step

    # ---- entering a generation -------------------------------------------------------------
    def enter(self, plan: membership.Seat, sync: bool = True) -> None:
        """Build the group for a plan (or a newer one) and bring every member to one state.

        With sync=False only the group is built (JOINED); the restore waits for `sync_first`."""
        while True:
            try:
                if self.gen >= 0 and self.holds_state:  # rehearse a failure during recovery
                    self.injector.at("regroup", plan.rank, self.completed)
                with self._gate:  # an abort judged on the older generation ends first
                    self.plan, self.gen = plan, plan.gen
                    self._phase = Phase.REGROUPING
                self.rank, self.world_size = plan.rank, plan.world_size
                if not self.group.form(plan, self._joining):
                    plan = self.wait_plan(plan.gen, None)
                    continue
                self.t_group = time.time()
                if not sync:
                    self._phase = Phase.JOINED
                    return
                self._restore(plan, awaiting=plan.gen)
                return
            except Exception as exc:  # a member died during the regroup itself: next plan
                if not self.is_peer_failure(exc):
                    raise
                self.group.teardown()
                plan = self.wait_plan(plan.gen, self.recovery_timeout())

    def _joining(self) -> None:
        """Every member met at the barrier; the group's rendezvous comes next. A newer plan seen
        by now would not cut it (the watch acts once per plan): stop here instead."""
        self.injector.at("join", self.rank, self.completed, kinds=("kill", "hang", "raise"))
        if self.watch.moved(self.gen):
            raise MembershipMoved(f"generation {self.watch.latest_gen} replaced generation "
                                  f"{self.gen} while its group formed")

    def sync_first(self) -> None:
        """The restore deferred from join(); a failure here is recovered like any other."""
        plan = self.plan
        try:
            self._restore(plan, awaiting=plan.gen if plan.gen > 0 else None)
        except Exception as exc:
            if not self.is_peer_failure(exc):
                raise
            self.fail()

    def _restore(self, plan: membership.Seat, awaiting: int | None) -> None:
        with self._gate:  # from here a newer plan aborts the transfers (_abort_from_watch)
            self._phase = Phase.RESTORING
        if self.watch.moved(self.gen):  # one seen before: the group already lacks a member
            raise MembershipMoved(f"generation {self.watch.latest_gen} replaced generation "
                                  f"{self.gen} before its state was agreed")
        me = restore.Position(self.rank, self.world_size, self.completed, self.holds_state,
                              self.kept.reusable(self.completed, self.rank, self.world_size),
                              agreed=self.agreed, built=self.own_build)
        rewind = protocol.read_json(self.store, protocol.rewind_key(plan.gen))
        out = restore.restore(self.state, me,
                              lambda rank, step: self.injector.at("receive", rank, step),
                              lambda rank, step: self.injector.at("send", rank, step),
                              self._loaded, rewind_to=rewind["at_most"] if rewind else None)
        if out.drop_kept_grads:
            self.kept.drop()
        self.completed, self.holds_state = out.resumed_step, True
        self.agreed = True  # every member holds the same state now
        self.catching_up = out.catching_up
        entered = Entered(**out.info, t_plan=plan.t_published, t_group=self.t_group,
                          t_ready=time.time(), worker_id=self.worker_id,
                          grads_kept=self.kept.reusable(self.completed, self.rank,
                                                        self.world_size))
        self.store.set(protocol.entered_key(plan.gen, self.rank), entered.to_json())
        self.last = asdict(entered)
        self.awaiting_first = awaiting
        self._phase = Phase.TRAINING

    def _loaded(self, step: int) -> None:
        """A restore replaced this member's live state by that of `step` (and may still fail
        after this): from now on it is at `step`, whatever it had committed before."""
        self.kept.drop()
        self.completed, self.holds_state = step, True

    # ---- failing and recovering ------------------------------------------------------------
    def enter_step(self) -> None:
        """Control enters a step's body (or a boundary that communicates): from here the watch
        thread may abort a collective stuck on a hung peer."""
        with self._gate:
            if self._phase is Phase.TRAINING:
                self._phase = Phase.IN_STEP

    def leave_step(self) -> None:
        if self._phase is Phase.IN_STEP:
            self._phase = Phase.TRAINING

    def fail(self) -> None:
        """A peer's failure cut the step (or boundary) short: the next turn recovers."""
        self._phase = Phase.FAILED

    @property
    def failed(self) -> bool:
        return self._phase is Phase.FAILED

    def recover(self) -> None:
        self.catching_up = 0
        if self.state.replicas is not None:  # its thread may be blocked on the dead peer
            self.state.replicas.abandon()
        self.group.teardown()
        plan = self.wait_plan(self.gen, self.recovery_timeout())
        self.enter(plan)

    def recovery_timeout(self) -> float:
        return protocol.recovery_timeout_s(self.spec.heartbeat_timeout_s)

    def loss_seen(self) -> bool:
        """The supervisor has declared a worker lost since this generation's plan, or moved on."""
        if self.watch.moved(self.gen):
            return True
        try:
            lost = membership.counter(self.store, protocol.LOST)
            return lost > (self.plan.lost if self.plan else 0) or \
                membership.current_gen(self.store) > self.gen
        except Exception:  # the store itself is gone: nothing will confirm anything
            return False

    def is_peer_failure(self, exc: BaseException) -> bool:
        return is_peer_failure(exc, self.loss_seen, self.spec.confirm_s)

    # ---- committing ------------------------------------------------------------------------
    def commit(self, step_started_at: float) -> None:
        t1 = time.time()
        self.catching_up = 0
        self.kept.drop()  # the step stands: its gradients will never be needed again
        step = self.completed
        self.completed += 1
        if self.rank == 0:
            self.reporter.step_done(step, step_started_at, t1)
        self.resumed(t1)

    def resumed(self, t: float | None = None) -> None:
        """The generation did its first useful work (a commit, or after the loop a between-steps
        call): the recovery that entered it is over (report.py times it to here)."""
        if self.awaiting_first is not None:
            self.store.set(protocol.first_commit_key(self.awaiting_first, self.rank),
                           f"{time.time() if t is None else t:.6f}")
            self.awaiting_first = None
