"""The loops a script writes over the step boundary: `job.steps()`, `job.epochs()`,
`job.batches()` and the `with job.step():` scope, each turn asking the step boundary
(steploop.py) to recover, get ready, and commit.

`Job` (job.py) owns one `LoopTurns` and hands these out as its own; the turns keep what a loop
needs between two of them: whether the body used the scope (it commits there) and whether the
job is being stopped (SIGTERM, SIGINT) at this boundary."""
from __future__ import annotations

from .data import END, Cursor, LoaderPosition


class LoopTurns:
    """A worker's loops over its step boundary, recovering on a peer's failure."""

    def __init__(self, steploop, rec, state, outside):
        self.steploop, self.rec, self.state, self.outside = steploop, rec, state, outside
        self.scope_used = False  # the body ran `with job.step():`, which committed the step
        self.preempted = False  # the loop ended at the agreed step of a stop (SIGTERM, SIGINT)

    def stop_here(self, step: int) -> bool:
        """The job is being stopped and every rank stops before `step` or sooner."""
        stop = self.rec.watch.preempt_at  # the watch learns of it (no store call per step)
        if stop is None:
            return False
        self.preempted = step >= stop
        return self.preempted

    def steps(self, max_steps: int):
        """Yield step numbers until `max_steps` steps are committed, recovering on failure."""
        self.steploop.start()
        while True:
            step = self.steploop.next()
            if step >= max_steps or self.stop_here(step):
                if self.steploop.secure() and (self.preempted or
                                               self.steploop.audits_settled()):
                    return
                continue  # a peer failed at the end: recover, and redo what the restore says
            if not self.steploop.ready(step):
                continue
            self._new_step()
            yield step
            self._after_body()

    def epochs(self, num_epochs: int, max_steps: int | None = None, loader=None):
        """Yield epoch numbers of the protected loader's position (data.py), from the agreed
        one after a recovery, until `num_epochs` epochs (or `max_steps` steps) are done."""
        self.steploop.start()
        pos = self._position(loader)
        while True:
            self.steploop.next()
            if pos.epoch >= num_epochs or (max_steps is not None and
                                           self.rec.completed >= max_steps) \
                    or self.stop_here(self.rec.completed):
                if self.steploop.secure():
                    return
                continue
            epoch = pos.epoch
            yield epoch
            if pos.epoch == epoch:  # its batches ran out here, not moved on by a recovery
                pos.epoch, pos.epoch_start = epoch + 1, self.rec.completed

    def batches(self, loader, max_steps: int | None = None):
        """Yield the protected `loader`'s batches of the current epoch, one per step, like
        `steps()`: a step redone after a recovery gets the same batch again, and a replacement
        starts at the batch after the last committed one (data.py)."""
        self.steploop.start()
        pos = self._position(loader)
        epoch, cursor = pos.epoch, Cursor(loader)
        while True:
            step = self.steploop.next()
            if pos.epoch != epoch or (max_steps is not None and step >= max_steps) or \
                    self.stop_here(step):
                return  # the position moved to a later epoch in a recovery, or the run is done
            batch = cursor.batch(step - pos.epoch_start)  # this epoch's batch for this step
            if batch is END:
                return
            if not self.steploop.ready(step):
                continue
            self._new_step()
            yield batch
            self._after_body()

    def _new_step(self) -> None:  # what ran between the steps before it is never run again
        self.scope_used = False
        self.outside.new_step()

    def _after_body(self) -> None:  # a body run without `with job.step():` commits here
        if not self.scope_used:
            self.steploop.close()

    def _position(self, loader) -> LoaderPosition:
        found = [o for o in self.state.objects.values() if isinstance(o, LoaderPosition) and
                 (loader is None or o.loader is loader)]
        if len(found) != 1:
            what = "this loader" if loader is not None else "one loader"
            raise RuntimeError(f"job.epochs()/job.batches(): protect {what} first, with "
                               "job.protect(..., loader=loader), so a replacement can resume at "
                               "its position" + ("" if loader is not None or not found else
                                                 "; with several, pass epochs(loader=...)"))
        return found[0]


class StepScope:
    """The `with job.step():` scope over the step boundary: commit, or absorb a peer's failure
    (the step is redone after the recovery); any other error is reported and raised."""

    def __init__(self, turns: LoopTurns):
        self.turns = turns

    def __enter__(self):
        self.turns.scope_used = True
        self.turns.steploop.open(self.turns.rec.completed)
        return self

    def __exit__(self, exc_type, exc, tb):
        loop = self.turns.steploop
        absorbed = exc is not None and loop.absorb(exc)
        if exc is not None and not absorbed:
            loop.body(False)
            return False
        loop.close()
        return absorbed
