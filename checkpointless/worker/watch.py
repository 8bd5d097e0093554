"""The watch: the thread of a worker that follows the published generations and the supervisor's
notices, and aborts the process group (group.py) the moment the membership moves on mid-step.

It blocks in the store instead of polling it, so a worker learns of a newer plan, a preemption or
a straggler's leave without a store call per step."""
from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

from .. import protocol
from ..protocol import membership

# How long one blocking wait lasts. Long: a wait that times out makes c10d log a warning.
_WAIT_S = 24 * 3600.0


class Watch:
    """Owns the thread (and its own store connection) that follows the published generations,
    and aborts the process group the moment the membership moves on mid-step.

    Gloo usually raises at once when a peer dies, but a rank whose ring neighbours are alive and
    equally stuck, or any rank on NCCL, would wait for the process-group timeout. The supervisor
    publishes the next plan as soon as it has declared a worker lost; this thread blocks in the
    store until that plan appears and then aborts the communicator, which turns the wait into an
    immediate error that the step scope recovers from.

    `latest_gen` is the newest generation seen; `generation()` gives the worker's own, and
    `abort_older(g)` is called once generation g is seen: it aborts the worker's group if that
    is still inside a step of an older generation. The check and the abort are one atomic act
    on the worker's side: this thread may be descheduled for a while after seeing g, and by
    then the worker may be in a step of generation g, whose group must not be touched."""

    def __init__(self, host: str, port: int, generation, abort_older, plans_at=None):
        self.host, self.port = host, port  # the job's store (preemption is asked there)
        self.plans_at = plans_at or (host, port)  # where the plans are: the node's store
        self.generation, self.abort_older = generation, abort_older
        self.latest_gen = -1
        self.preempt_at: int | None = None  # the step before which the job stops, once asked
        # generation -> (the worker that leaves, the step before which it does): a straggler
        self.leaves: dict[int, tuple[int, int]] = {}
        self._stop = threading.Event()
        self._seen = threading.Condition()

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True, name="checkpointless-watch").start()
        threading.Thread(target=self._run_notices, daemon=True,
                         name="checkpointless-notices").start()

    def stop(self) -> None:
        self._stop.set()

    def moved(self, gen: int) -> bool:
        """A generation newer than `gen` has been published."""
        return self.latest_gen > gen

    def wait_newer(self, gen: int, timeout_s: float) -> bool:
        """Sleep until a generation newer than `gen` is seen, at most `timeout_s`."""
        with self._seen:
            return self._seen.wait_for(lambda: self.latest_gen > gen, timeout_s)

    def leave(self, gen: int) -> tuple[int, int] | None:
        """(worker, step) when a worker of generation `gen` was asked to leave before that
        step (protocol.notice_key)."""
        return self.leaves.get(gen)

    def _run_notices(self) -> None:
        """Learn of the supervisor's notices (a preemption, a straggler asked to leave) the
        moment they are written, without a store call per step."""
        store = membership.connect(self.host, self.port)
        i = 0
        try:
            while True:
                store.wait([protocol.notice_key(i)], timedelta(seconds=_WAIT_S))
                n = json.loads(store.get(protocol.notice_key(i)))
                if n["kind"] == "preempt":
                    self.preempt_at = n["before_step"]
                elif n["kind"] == "leave":
                    self.leaves[n["gen"]] = (n["wid"], n["before_step"])
                elif n["kind"] == "regroup":  # a grow: every worker stops there for the plan;
                    # a straggler's leave in the same generation stops them too, and its plan
                    # (a new generation) cancels the grow: it is kept
                    self.leaves.setdefault(n["gen"], (-1, n["before_step"]))
                i += 1
        except Exception:  # noqa: BLE001  the store is gone: the job is over
            return

    def _run(self) -> None:
        store = membership.connect(*self.plans_at)
        while not self._stop.is_set():
            g = max(self.generation(), self.latest_gen) + 1
            t0 = time.time()
            try:
                store.wait([protocol.plan_key(g)], timedelta(seconds=_WAIT_S))
            except Exception:
                if time.time() - t0 < _WAIT_S / 2:  # not a timeout: the store is gone, job over
                    return
                continue
            if g > self.latest_gen:  # seen before this worker entered a generation too
                with self._seen:
                    self.latest_gen = g
                    self._seen.notify_all()
            mine = self.generation()
            if mine >= 0 and g > mine:
                self.abort_older(g)
