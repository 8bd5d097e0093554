"""The duties of a worker's step boundary besides the recovery's own turns: copying its shard to
peers when due, the replicas' consistency check, securing the state at a boundary outside the
steps, and waiting for the audits to settle at the loop's end.

`StepLoop` (steploop.py) owns one and calls it from `ready()`, `secure()` and `audits_settled()`;
it reads the loop's parts (its recovery, state, injector, audits) and reports through the loop."""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import consistency
from .. import protocol
from ..protocol import membership
from .failures import communicating
from .group import side_group


class BoundaryDuties:
    """What a step boundary does besides recovering: replicate, check, secure, settle audits."""

    def __init__(self, loop):
        self.loop = loop  # the StepLoop: its recovery, state, injector, audits and reports
        self._secured: tuple[int, int] | None = None  # (gen, step) whose state peers hold whole

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
        rec, replicas = self.loop.rec, self.loop.state.replicas
        if self._secured == (rec.gen, rec.completed) or replicas is None or replicas.factor <= 1:
            return True
        rec.enter_step()  # a hung peer is caught here as in a step
        try:
            if not self.replicate(rec.completed, force=True):
                return False
            replicas.wait(lambda: rec.watch.moved(rec.gen))
            with communicating("confirming every copy of the state at the loop's end"):
                dist.all_reduce(torch.zeros(1))
        except Exception as exc:
            self.loop.fail_or_raise(exc)
            return False
        finally:
            rec.leave_step()
        self._secured = (rec.gen, rec.completed)
        return True

    def audits_settled(self) -> bool:
        """At the loop's end with audits on: the spares judged the last audited step
        (audit_rank.settle; a wrong gradient found then is still recovered). False when a peer
        failed meanwhile (the next turn recovers, and the loop may go on)."""
        rec, audits = self.loop.rec, self.loop.audits
        if audits is None or audits.every <= 0:
            return True

        def failed() -> bool:
            rec.reporter.beat(rec.completed, rec.gen, "recover")  # waiting, not hung
            return rec.watch.moved(rec.gen)

        if audits.settle(rec.completed, rec.world_size, failed):
            return True
        rec.fail()
        return False

    def replicate(self, step: int, force: bool = False) -> bool:
        """Snapshot this rank's shard when due (or `force`d, with copies at all) and start
        copying it to its peers in the background (redundancy.py); False when a peer failed
        meanwhile."""
        replicas, rec = self.loop.state.replicas, self.loop.rec
        if replicas is None or not (replicas.due(step) or force and replicas.factor > 1):
            return True
        rec.reporter.kick()  # the heartbeat out before a collective that may hang
        if replicas.on_exchange is None:
            replicas.on_exchange = self._exchange_fault
        gen, rank, world, watch = rec.gen, rec.rank, rec.world_size, rec.watch
        try:
            replicas.replicate(
                step, self.loop.state.state, rank, world, gen=gen,
                connect=lambda: side_group(watch.host, watch.port, gen, rank, world,
                                           self.loop.spec.pg_timeout_s),
                moved=lambda: watch.moved(gen))
            return True
        except Exception as exc:
            self.loop.fail_or_raise(exc)
            return False

    def _exchange_fault(self, rank: int, step: int) -> None:
        """In the exchange thread: a kill or hang scheduled `@exchange` fires here, claimed over
        a store connection of the thread's own."""
        injector, watch = self.loop.injector, self.loop.rec.watch
        if injector.scheduled("exchange", rank, step):
            store = membership.connect(watch.host, watch.port)
            injector.at("exchange", rank, step, kinds=("kill", "hang"), store=store)

    def consistent(self, step: int) -> bool:
        """Every `consistency_every` steps, check that all replicas hold the same parameters; a
        rank off the majority reports itself and leaves (the supervisor replaces it). False when
        a peer failed meanwhile."""
        loop = self.loop
        every, rec = loop.spec.consistency_every, loop.rec
        if every <= 0 or step % every or (groups := loop.state.compared(rec.world_size)) is None:
            return True  # not due, or fsdp's slices exist once each: nothing to compare
        rec.reporter.kick()  # the heartbeat out before a collective that may hang
        try:
            sums = consistency.gather(loop.state.modules(), rec.world_size)
        except Exception as exc:
            loop.fail_or_raise(exc)
            return False
        try:
            consistency.judge_groups(sums, groups, rec.rank, step)
        except consistency.Diverged as exc:
            loop.store.set(protocol.diverged_key(loop.worker_id), str(exc))
            loop.report(exc)
            raise
        except consistency.NoMajority as exc:
            loop.report(exc)
            raise
        return True
