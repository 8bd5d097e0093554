"""The step boundary: the one public API every loop drives, `Job`'s generators, the drop-in
Accelerator and a loop of your own alike.

    loop = job.steploop
    loop.start()                        # a replacement receives the state here
    while True:
        step = loop.next()              # recovers first if a peer failed since the last step
        if step >= max_steps: ...
        if not loop.ready(step):        # heartbeat, due faults, replica exchange, check
            continue                    # a peer failed meanwhile: the next turn recovers
        loop.open(step)                 # seeded, and from here the watch may abort a collective
        try:
            ...the step's body...
        except Exception as exc:
            if not loop.absorb(exc):    # a peer's failure is absorbed; any other error raised
                raise
        loop.close()                    # commits, unless a failure cut it short before its
                                        # update landed (then the step is redone)

The phase of the recovery state machine (recovery.py) changes only through its own transitions;
this class only asks for them. Its other duties (replica exchange, consistency check, securing
the state, settling audits) are duties.py's; the loops a script writes over it are turns.py's.
`PlainStepLoop` (plain.py) is the same surface under torchrun, where a failure ends the job.
"""
from __future__ import annotations

import signal
import sys
import time

from .. import protocol
from .duties import BoundaryDuties
from .failures import report_error
from .injector import FaultInjector, InjectedFault, die_here
from .pace import Pace, watch_collectives
from .recovery import Phase, Recovery
from .rehearsal import Rehearsal, ReplayMismatch
from .seeding import seed_all, step_seed
from .state import ProtectedState


class StepLoop:
    """One worker's step boundary over its recovery state machine."""

    fault_tolerant = True

    def __init__(self, store, worker_id: int, spec: protocol.Spec, rec: Recovery,
                 state: ProtectedState, injector: FaultInjector, audits=None,
                 rehearsal: Rehearsal | None = None):
        self.store, self.worker_id, self.spec = store, worker_id, spec
        self.rec, self.state, self.injector = rec, state, injector
        self.audits = audits  # audit_rank.RankAudits: taps the gradients of audited steps
        # the replay rehearsal (rehearsal.py): an early step run twice and compared
        self.rehearsal = rehearsal or Rehearsal("off", state, None, store)
        self.started = False  # start() ran: the state is agreed
        self.step_started_at = 0.0
        self.duties = BoundaryDuties(self)  # replica exchange, consistency, securing, audits
        self.pace = Pace()  # this worker's own time per step, for the straggler check
        watch_collectives()

    # ---- where the loop stands ---------------------------------------------------------------
    @property
    def generation(self) -> int:
        return self.rec.gen

    @property
    def completed(self) -> int:
        return self.rec.completed

    @property
    def failed(self) -> bool:
        """A peer's failure cut the current step short; the next `next()` recovers."""
        return self.rec.failed

    @property
    def update_applied(self) -> bool:
        """The optimizer's update of the current step landed (its step hook ran)."""
        return self.state.update_applied

    @property
    def rehearsing(self) -> bool:
        """The body in flight is the replay rehearsal's first attempt, which is run again from
        the same state: a side effect outside the protected state (a checkpoint written, a line
        logged) belongs to the second."""
        return self.rehearsal.rehearsing

    @property
    def may_communicate(self) -> bool:
        """False in a replacement before its first step: the survivors are inside the loop and
        would never meet a collective it made there."""
        return self.started or self.rec.holds_state

    # ---- the turns ----------------------------------------------------------------------------
    def start(self) -> None:
        """At the first loop call: agree on the state (a replacement receives it here)."""
        rec = self.rec
        if rec.phase is Phase.JOINED:
            self._reported(rec.sync_first)
            if rec.rank == 0 and rec.gen == 0:  # where this launch's step records begin
                self.store.set(protocol.FIRST_STEP, str(rec.completed))
                self.store.set(protocol.FIRST_T, f"{time.time():.6f}")
        self.rehearsal.plan(rec.gen, rec.completed)
        self.started = True

    def next(self) -> int:
        """Recover if a peer failed since the last step (or a straggler leaves at this boundary);
        the step to run next."""
        rec = self.rec
        if rec.watch.moved(rec.gen) and not rec.failed:
            rec.fail()
        leave = rec.watch.leave(rec.gen)
        if leave is not None and rec.completed >= leave[1] and not rec.failed:
            if leave[0] == self.worker_id:
                self._leave(leave[1])
            rec.fail()  # no step in flight: wait here for the plan that replaces the leaver
        if rec.failed:
            self.rehearsal.interrupted()  # a failure between its attempts ends the rehearsal
            self._reported(rec.recover)
        return rec.completed

    def ready(self, step: int) -> bool:
        """Before a step's body: heartbeat, due faults, replica exchange, consistency check.
        False when a peer failed meanwhile (the next turn recovers)."""
        # written as the body starts (open), or before a collective here that may hang
        self.rec.reporter.beat(step, self.rec.gen, "step", write=False, pace=self.pace.recent())
        if self.rehearsal.second_pass(step, self.rec.gen):  # the same step once more: its
            self.state.update_applied = False  # faults, copies and checks were done for it
            return True
        if self.injector.scheduled("step", self.rec.rank, step):
            # a fault due here finds every record out (a hang's beat says where it stopped,
            # and the last step's record is not lost with a kill)
            self.rec.reporter.flush()
        self.injector.before_step(self.rec.rank, step)
        self.step_started_at = time.time()  # the replica snapshot (and any wait) is in the step
        self.state.update_applied = False
        return self.duties.replicate(step) and self.duties.consistent(step)

    def open(self, step: int) -> None:
        """The step's body starts: seeded per step (a redone step draws the same numbers), and a
        collective stuck on a hung peer may be aborted from here on."""
        self.state.update_applied = False
        self._reported(lambda: self.rehearsal.open(step, self.rec.gen))  # the state kept
        # before a rehearsed step
        self.rec.enter_step()
        seed_all(step_seed(int(self.spec.seed), step, self.rec.rank, 0))
        self.rec.reporter.kick()  # this step's heartbeat, the last one's record
        self.pace.begin()
        self.pace.injected_s = self.injector.slow_down(self.rec.rank, step, self.pace.own_s)
        if self.audits is not None:
            rank = self.rec.rank
            self.audits.open(step, rank, self.rec.world_size, self.injector.sdc_due(rank, step))
        try:
            self.injector.raise_due(self.rec.rank, step)
        except InjectedFault as exc:
            self.rec.leave_step()
            report_error(self.store, self.worker_id, exc)
            raise

    def body(self, inside: bool) -> None:
        """Control enters (True) or leaves (False) a body of the script's own outside `open`,
        such as an evaluation between an epoch's steps: a hung peer is caught there too."""
        if inside:
            self.rec.enter_step()
            self.rec.reporter.kick()  # the last step's record, before the body's work
        else:
            self.rec.leave_step()

    def absorb(self, exc: BaseException) -> bool:
        """An exception inside a body: True when it is a peer's failure, which marks the step
        failed (its body may run on as a void pass); any other error is reported to the
        supervisor and False is returned, for the caller to raise it."""
        if (self.rec.phase is Phase.IN_STEP or self.rec.failed) and \
                self.rec.is_peer_failure(exc):
            self.rec.fail()
            return True
        self.report(exc)
        return False

    def close(self) -> bool:
        """The step's body ended. It commits unless a failure cut it short before its update
        landed (an update that landed stands, and the recovery follows at the next turn). True:
        committed."""
        self.rec.leave_step()
        rec, step = self.rec, self.rec.completed
        committed = not (rec.failed and not self.state.update_applied)
        rehearsed = self.rehearsal.close(step, rec.gen, rec.failed, self.state.update_applied)
        if rehearsed == "redo":  # the rehearsal's first attempt: the state is back at the start
            committed = False
        if self.audits is not None:
            self.audits.close(step, rec.rank, rec.world_size, rec.gen, committed)
        if not committed:
            self.pace.drop()  # not a step's figure: it is redone
            return False
        self.pace.end(self.rec.completed, self.rec.gen)
        self.rec.commit(self.step_started_at)
        self._replay_verdict(rehearsed == "mismatch")
        return True

    def _replay_verdict(self, stop: bool) -> None:
        """After the rehearsal ended on this rank: its finding published (rank 0 says the
        job's verdict); under strict a step that gave other bits stops the run here."""
        rec = self.rec
        self.rehearsal.publish(rec.rank, rec.world_size, lambda: rec.watch.moved(rec.gen),
                               lambda: rec.reporter.beat(rec.completed, rec.gen, "step"))
        if stop:
            exc = ReplayMismatch(
                f"checkpointless.replay_check=strict: step {rec.completed - 1} gave other bits "
                f"when run again from the same state on rank {rec.rank}; see the replay check's "
                "message for what differed and why")
            self.store.set(protocol.REPLAY_STOP, str(exc))
            self.report(exc)
            raise exc

    def fail_or_raise(self, exc: Exception) -> None:
        """After an exception outside a step's body: a peer's failure marks this worker failed
        (the next turn recovers); any other error is its own, reported and raised."""
        self.rec.leave_step()
        if not self.rec.is_peer_failure(exc):
            self.report(exc)
            raise exc
        self.rec.fail()

    def report(self, exc: BaseException) -> None:
        report_error(self.store, self.worker_id, exc)

    def _leave(self, step: int) -> None:
        """This worker is a straggler the supervisor evicts: it leaves at this step boundary,
        its records written first (rank 0's step records), as a failure would (the supervisor
        sees the exit and gives the rank to a spare), with no step cut short."""
        print(f"[checkpointless] rank {self.rec.rank}: evicted for slowness, leaving before "
              f"step {step}", file=sys.stderr, flush=True)
        self.rec.reporter.flush()
        die_here(signal.SIGKILL)

    def say_void(self, what: str) -> None:
        print(f"[checkpointless] rank {self.rec.rank}: a peer was lost during {what}; the rest "
              "of this pass is void and it is run again after the recovery", file=sys.stderr,
              flush=True)

    def _reported(self, fn):
        """Run a recovery phase; an error of this worker's own in it reaches the supervisor."""
        try:
            return fn()
        except Exception as exc:
            self.report(exc)
            raise

    # ---- duties at the boundary (duties.py) ---------------------------------------------------
    def secure(self) -> bool:
        """At a boundary outside the loop's steps (its end, a between_steps call): make the
        state of this step restorable, whole, from peers' memory, once per generation (duties.py
        says how). False when a peer failed meanwhile (the next turn recovers)."""
        return self.duties.secure()

    def audits_settled(self) -> bool:
        """At the loop's end with audits on: the spares judged the last audited step. False when
        a peer failed meanwhile (the next turn recovers, and the loop may go on)."""
        return self.duties.audits_settled()
