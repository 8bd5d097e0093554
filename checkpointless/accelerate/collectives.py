"""The collectives a script reaches through the drop-in Accelerator, guarded: a peer's failure
inside the loop body voids the rest of the body and returns a stand-in of the right shape (see
docs/accelerate.md). A mixin before accelerate.Accelerator: `super()` is accelerate's own."""
from __future__ import annotations

import contextlib
import sys

import torch
from accelerate.utils import recursively_apply


class GuardedCollectives:
    """Needs `steploop`, `_void` and `_in_body` from the Accelerator it is mixed into."""

    def _guarded(self, fn, stand_in, what: str):
        """Run the collective `fn()`. A peer's failure inside the loop body voids the rest of the
        body and gives `stand_in()` instead; so does any call once the body is void."""
        if self._void:
            return stand_in()
        if not self.steploop.may_communicate:
            raise RuntimeError(f"checkpointless.accelerate: {what} before the loop, in a worker "
                               "that took over a failed rank; the survivors are inside the loop "
                               "and would never meet this collective. Move it into the loop or "
                               "after it")
        try:
            return fn()
        except Exception as exc:
            if self._in_body and self.steploop.absorb(exc):
                self.steploop.say_void(what)
                self._void = True
                return stand_in()
            if not self._in_body:
                self.steploop.report(exc)
            raise

    def _stand_in_gathered(self, data, use_gather_object: bool = False):
        world = self.num_processes
        try:
            recursively_apply(lambda x: x, data, error_on_other_type=True)
            tensors = not use_gather_object
        except TypeError:
            tensors = False
        if not tensors:
            return list(data) * world if isinstance(data, list) else [data] * world
        return recursively_apply(
            lambda t: torch.cat([t.reshape(1) if t.dim() == 0 else t] * world), data)

    def backward(self, loss, **kwargs):
        fn = super().backward
        return self._guarded(lambda: fn(loss, **kwargs), lambda: None, "backward")

    def gather(self, tensor):
        fn = super().gather
        return self._guarded(lambda: fn(tensor), lambda: self._stand_in_gathered(tensor),
                             "gather")

    def gather_for_metrics(self, input_data, use_gather_object=False):
        fn = super().gather_for_metrics
        return self._guarded(lambda: fn(input_data, use_gather_object=use_gather_object),
                             lambda: self._stand_in_gathered(input_data, use_gather_object),
                             "gather_for_metrics")

    def reduce(self, tensor, reduction="sum", scale=1.0):
        fn = super().reduce
        return self._guarded(lambda: fn(tensor, reduction, scale), lambda: tensor, "reduce")

    def pad_across_processes(self, tensor, dim=0, pad_index=0, pad_first=False):
        fn = super().pad_across_processes
        return self._guarded(lambda: fn(tensor, dim=dim, pad_index=pad_index,
                                        pad_first=pad_first), lambda: tensor,
                             "pad_across_processes")

    def wait_for_everyone(self):
        if not self.steploop.may_communicate:
            return  # a replacement before the loop: nobody waits for it there
        fn = super().wait_for_everyone
        return self._guarded(fn, lambda: None, "wait_for_everyone")

    @contextlib.contextmanager
    def main_process_first(self):
        if not self.steploop.may_communicate:
            yield  # a replacement before the loop: the data is prepared already
            return
        with super().main_process_first():
            yield

    @contextlib.contextmanager
    def local_main_process_first(self):
        if not self.steploop.may_communicate:
            yield
            return
        with super().local_main_process_first():
            yield

    def print(self, *args, sep=" ", end="\n", file=None, flush=False):
        """Print on each node's lowest rank, as one write: the builtin writes each argument and
        the newline separately, and another process writing to the same pipe at that moment
        (a peer's last line, the supervisor's) could land between them and split the line."""
        # a void pass's figures are stand-ins; the replay rehearsal's first attempt of a step
        # is run again at once (rehearsal.py): its lines are the second attempt's to print
        if self._void or self.steploop.rehearsing or not self.is_local_main_process:
            return
        out = file if file is not None else sys.stdout
        out.write(sep.join(str(a) for a in args) + end)
        if flush:
            out.flush()

    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None):
        if not (self._void or self.steploop.rehearsing):
            return super().log(values, step=step, log_kwargs=log_kwargs)

