"""What runs outside a loop's steps: `between_steps()` calls, replayed after a recovery, and the
barrier at which the ranks leave the job together (`finish()`)."""
from __future__ import annotations

import torch.distributed as dist

from ..protocol import membership
from .. import protocol
from .failures import GroupAborted
from .recovery import Recovery
from .steploop import StepLoop


class OutsideSteps:
    """The sections a rank ran since its last step, and the leaving barrier."""

    def __init__(self, steploop: StepLoop, rec: Recovery, store, worker_id: int):
        self.loop, self.rec, self.store, self.worker_id = steploop, rec, store, worker_id
        # between_steps() calls completed since the last step, in order: after a recovery this
        # rank runs them again, as a replacement runs them for the first time
        self.sections: list = []
        self.sections_gen = -1  # the generation in which they last ran
        self.on_recovered = None  # see Job.on_recovered

    def new_step(self) -> None:
        """A step's body starts: what ran between the steps before it is never run again."""
        self.sections, self.sections_gen = [], self.rec.gen

    def run(self, fn):
        """`fn()` outside the steps, recovered and run again after a peer's failure (see
        Job.between_steps)."""
        loop, rec = self.loop, self.rec
        loop.start()
        while True:
            gen, before = rec.gen, rec.completed
            loop.next()
            # outside the steps a rank beats here: one still busy after the loop (an export)
            # is not taken for one left behind while the others wait for it
            rec.reporter.beat(rec.completed, rec.gen, "between")
            if rec.gen != gen and self.on_recovered is not None and \
                    not self.on_recovered(before):
                continue
            if not loop.secure():
                continue
            loop.body(True)  # a hung peer is caught here as in a step
            try:
                if self.sections_gen != rec.gen:  # a recovery since they ran: again, in order
                    for done in self.sections:
                        done()
                    self.sections_gen = rec.gen
                out = fn()
            except Exception as exc:
                loop.fail_or_raise(exc)
                continue
            loop.body(False)
            rec.resumed()
            self.sections.append(fn)
            return out

    def leave(self, result_text: str) -> bool:
        """Report this rank's result, then meet every rank at a barrier. A peer lost before its
        result was in is recovered like a failure between steps; one lost after it, on its way
        out, loses nothing: True then (every result is in, the group is not whole)."""
        loop, rec = self.loop, self.rec
        while True:
            self.store.set(protocol.result_key(rec.rank), result_text)
            rec.reporter.beat(rec.completed, rec.gen, "finish")
            loop.body(True)  # a peer hung on its way here is caught as in a step
            try:
                if not dist.is_initialized():  # the watch aborted it: a newer generation exists
                    raise GroupAborted(f"the group of generation {rec.gen} was aborted")
                dist.barrier()  # leave together: no group torn down under a peer still in it
                return False
            except Exception as exc:  # noqa: BLE001
                loop.body(False)
                if self._results_in():  # the peer died on its way out: nothing is lost
                    return True
                loop.fail_or_raise(exc)
                self.run(lambda: None)  # recover; the calls since the last step again
            finally:
                loop.body(False)

    def _results_in(self) -> bool:
        try:
            return membership.results_in(self.store, self.rec.world_size)
        except Exception:  # noqa: BLE001  the store is gone: nothing to confirm with
            return False
