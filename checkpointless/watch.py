"""The watch thread: abort the process group the moment the membership moves on mid-step.

Gloo usually raises at once when a peer dies, but a rank whose ring neighbours are alive and
equally stuck, or any rank on NCCL, would wait for the process-group timeout. The supervisor
publishes the next plan as soon as it has declared a worker lost; this thread blocks in the store
until that plan appears and then aborts the communicator, which turns the wait into an immediate
error that the step scope recovers from.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta

from . import membership, protocol

# How long one blocking wait lasts. Long: a wait that times out makes c10d log a warning.
_WAIT_S = 24 * 3600.0


class Watch:
    """Owns the thread (and its own store connection) that follows the published generations.

    `latest_gen` is the newest generation seen; `generation()` gives the worker's own, `in_step()`
    whether it is inside a step, and `abort()` aborts its group."""

    def __init__(self, host: str, port: int, generation, in_step, abort):
        self.host, self.port = host, port
        self.generation, self.in_step, self.abort = generation, in_step, abort
        self.latest_gen = -1
        self._stop = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, daemon=True, name="checkpointless-watch").start()

    def stop(self) -> None:
        self._stop.set()

    def moved(self, gen: int) -> bool:
        """A generation newer than `gen` has been published."""
        return self.latest_gen > gen

    def _run(self) -> None:
        store = membership.connect(self.host, self.port)
        while not self._stop.is_set():
            g = max(self.generation(), self.latest_gen) + 1
            t0 = time.time()
            try:
                store.wait([protocol.plan_key(g)], timedelta(seconds=_WAIT_S))
            except Exception:
                if time.time() - t0 < _WAIT_S / 2:  # not a timeout: the store is gone, job over
                    return
                continue
            mine = self.generation()
            if mine >= 0 and g > mine and g > self.latest_gen:
                self.latest_gen = g
                if self.in_step():
                    self.abort()
