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
this class only asks for them. `PlainStepLoop` (plain.py) is the same surface under torchrun,
where a failure ends the job.
"""
from __future__ import annotations

import signal
import sys
import time

import torch
import torch.distributed as dist

from . import consistency
from ..protocol import membership
from .. import protocol
from .failures import communicating, report_error
from .injector import FaultInjector, InjectedFault, die_here
from .group import side_group
from .pace import Pace, watch_collectives
from .recovery import Phase, Recovery
from .seeding import seed_all, step_seed
from .state import ProtectedState


class StepLoop:
    """One worker's step boundary over its recovery state machine."""

    fault_tolerant = True

    def __init__(self, store, worker_id: int, spec: protocol.Spec, rec: Recovery,
                 state: ProtectedState, injector: FaultInjector, audits=None):
        self.store, self.worker_id, self.spec = store, worker_id, spec
        self.rec, self.state, self.injector = rec, state, injector
        self.audits = audits  # audit_rank.RankAudits: taps the gradients of audited steps
        self.started = False  # start() ran: the state is agreed
        self.step_started_at = 0.0
        self._secured: tuple[int, int] | None = None  # (gen, step) whose state peers hold whole
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
            self._reported(rec.recover)
        return rec.completed

    def ready(self, step: int) -> bool:
        """Before a step's body: heartbeat, due faults, replica exchange, consistency check.
        False when a peer failed meanwhile (the next turn recovers)."""
        # written as the body starts (open), or before a collective here that may hang
        self.rec.reporter.beat(step, self.rec.gen, "step", write=False, pace=self.pace.recent())
        if self.injector.scheduled("step", self.rec.rank, step):
            # a fault due here finds every record out (a hang's beat says where it stopped,
            # and the last step's record is not lost with a kill)
            self.rec.reporter.flush()
        self.injector.before_step(self.rec.rank, step)
        self.step_started_at = time.time()  # the replica snapshot (and any wait) is in the step
        self.state.update_applied = False
        return self._replicate(step) and self._consistent(step)

    def open(self, step: int) -> None:
        """The step's body starts: seeded per step (a redone step draws the same numbers), and a
        collective stuck on a hung peer may be aborted from here on."""
        self.state.update_applied = False
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
        if self.audits is not None:
            self.audits.close(step, rec.rank, rec.world_size, rec.gen, committed)
        if not committed:
            self.pace.drop()  # not a step's figure: it is redone
            return False
        self.pace.end(self.rec.completed, self.rec.gen)
        self.rec.commit(self.step_started_at)
        return True

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

    # ---- duties at the boundary ---------------------------------------------------------------
    def secure(self) -> bool:
        """At a boundary outside the loop's steps (its end, a between_steps call): make the
        state of this step restorable, whole, from peers' memory, once per generation.

        Under sharded state the snapshots are taken at a step's start, so the state after the
        last step exists nowhere but in the live shards: a failure after the loop would roll
        every rank back to a step no loop is left to redo. Here each rank snapshots and sends
        its slice, waits for its exchange, and all confirm in one collective: once that returns
        on any rank, every copy is complete, and any later failure restores exactly this step.
        False when a peer failed meanwhile (the next turn recovers; inside a loop, the restore
        may send it back to redo a step)."""
        rec, replicas = self.rec, self.state.replicas
        if self._secured == (rec.gen, rec.completed) or replicas is None or replicas.factor <= 1:
            return True
        rec.enter_step()  # a hung peer is caught here as in a step
        try:
            if not self._replicate(rec.completed, force=True):
                return False
            replicas.wait(lambda: rec.watch.moved(rec.gen))
            with communicating("confirming every copy of the state at the loop's end"):
                dist.all_reduce(torch.zeros(1))
        except Exception as exc:
            self.fail_or_raise(exc)
            return False
        finally:
            rec.leave_step()
        self._secured = (rec.gen, rec.completed)
        return True

    def audits_settled(self) -> bool:
        """At the loop's end with audits on: the spares judged the last audited step
        (audit_rank.settle; a wrong gradient found then is still recovered). False when a peer
        failed meanwhile (the next turn recovers, and the loop may go on)."""
        rec = self.rec
        if self.audits is None or self.audits.every <= 0:
            return True

        def failed() -> bool:
            rec.reporter.beat(rec.completed, rec.gen, "recover")  # waiting, not hung
            return rec.watch.moved(rec.gen)

        if self.audits.settle(rec.completed, rec.world_size, failed):
            return True
        rec.fail()
        return False

    def _replicate(self, step: int, force: bool = False) -> bool:
        """Snapshot this rank's shard when due (or `force`d, with copies at all) and start
        copying it to its peers in the background (redundancy.py); False when a peer failed
        meanwhile."""
        replicas, rec = self.state.replicas, self.rec
        if replicas is None or not (replicas.due(step) or force and replicas.factor > 1):
            return True
        self.rec.reporter.kick()  # the heartbeat out before a collective that may hang
        if replicas.on_exchange is None:
            replicas.on_exchange = self._exchange_fault
        gen, rank, world, watch = rec.gen, rec.rank, rec.world_size, rec.watch
        try:
            replicas.replicate(
                step, self.state.state, rank, world, gen=gen,
                connect=lambda: side_group(watch.host, watch.port, gen, rank, world,
                                           self.spec.pg_timeout_s),
                moved=lambda: watch.moved(gen))
            return True
        except Exception as exc:
            self.fail_or_raise(exc)
            return False

    def _exchange_fault(self, rank: int, step: int) -> None:
        """In the exchange thread: a kill or hang scheduled `@exchange` fires here, claimed over
        a store connection of the thread's own."""
        if self.injector.scheduled("exchange", rank, step):
            store = membership.connect(self.rec.watch.host, self.rec.watch.port)
            self.injector.at("exchange", rank, step, kinds=("kill", "hang"), store=store)

    def _consistent(self, step: int) -> bool:
        """Every `consistency_every` steps, check that all replicas hold the same parameters; a
        rank off the majority reports itself and leaves (the supervisor replaces it). False when
        a peer failed meanwhile."""
        every, rec = self.spec.consistency_every, self.rec
        if every <= 0 or step % every or (groups := self.state.compared(rec.world_size)) is None:
            return True  # not due, or fsdp's slices exist once each: nothing to compare
        self.rec.reporter.kick()  # the heartbeat out before a collective that may hang
        try:
            sums = consistency.gather(self.state.modules(), rec.world_size)
        except Exception as exc:
            self.fail_or_raise(exc)
            return False
        try:
            consistency.judge_groups(sums, groups, rec.rank, step)
        except consistency.Diverged as exc:
            self.store.set(protocol.diverged_key(self.worker_id), str(exc))
            self.report(exc)
            raise
        except consistency.NoMajority as exc:
            self.report(exc)
            raise
        return True


class StepScope:
    """The `with job.step():` scope over the step boundary: commit, or absorb a peer's failure
    (the step is redone after the recovery); any other error is reported and raised."""

    def __init__(self, job):
        self.job = job

    def __enter__(self):
        self.job._scope_used = True
        self.job.steploop.open(self.job.completed_steps)
        return self

    def __exit__(self, exc_type, exc, tb):
        loop = self.job.steploop
        absorbed = exc is not None and loop.absorb(exc)
        if exc is not None and not absorbed:
            loop.body(False)
            return False
        loop.close()
        return absorbed
