"""What a worker reports as it trains, written off the step's critical path.

Each step a worker beats (its heartbeat: when it last made progress, at which step) and rank 0
records the step's times. Written from the training loop, each is a store round trip between one
step and the next; here the loop only leaves the newest values in memory and a thread of the
worker's own writes them, on connections of its own: the heartbeat to the node's store (its agent
judges it; the coordinator never reads a rank's heartbeat), the step record to the main store.

The heartbeat's time is taken by the loop, not by the thread, so a hung loop still reads as
silent. `flush()` waits for what is pending (the last beats before a worker leaves).
"""
from __future__ import annotations

import json
import threading
import time

from .. import protocol
from ..protocol.membership import connect


HOLD_S = 0.5  # the longest a queued record waits for a kick


class Reporter:
    """A worker's heartbeat and step records, written by a background thread."""

    def __init__(self, worker_id: int, host: str, port: int, node_port: int = 0):
        self.worker_id = worker_id
        self.host, self.port, self.node_port = host, port, node_port
        self._beat: dict | None = None  # the newest heartbeat not yet written
        self._steps: list[tuple[int, str]] = []  # step records not yet written
        self._queued = self._written = 0
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._broken = False  # a store is gone: the job is over or this worker is lost
        self._kicked = False  # what is queued is to be written now
        self._held_since = 0.0  # when the oldest record not yet written was queued

    def beat(self, step: int, gen: int, phase: str, write: bool = True,
             pace: list | None = None) -> None:
        """This worker's heartbeat, written at once; or, with `write=False`, at the next
        `kick()` (the step loop's: its beat waits for the step's body, see `kick`). `pace`: its
        newest steps' own times ([[step, ms], ...], pace.py), for the straggler check."""
        beat = {"t": time.time(), "step": step, "gen": gen, "phase": phase}
        if pace:
            beat["pace"] = pace
        self._put(beat=beat, wake=write)  # serialized by the thread, off the step's path

    def step_done(self, step: int, t0: float, t1: float) -> None:
        """Rank 0: step `step` ran from t0 to t1 (report.py reads these for goodput). Written
        with the next step's heartbeat, at its `kick()`, or after at most `HOLD_S` without one
        (a script's long work between steps outside any body)."""
        self._put(step=(step, f"{t0:.6f},{t1:.6f}"), wake=False)

    def kick(self) -> None:
        """Write what is queued now. The step loop calls it as a body starts (a step's, or one
        outside the steps): waking the thread between two steps, where the loop runs Python
        and holds the interpreter lock, made the loop wait for the thread's turn (on a busy
        machine, for a core), which is what stood between the failure-free mode's gap between
        steps and plain torchrun's; in a body, the thread's few calls overlap the compute."""
        with self._cond:
            if self._queued > self._written:
                self._kicked = True
                self._cond.notify_all()

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait until everything reported so far is written (or the stores are gone)."""
        with self._cond:
            target = self._queued
            self._kicked = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._written >= target or self._broken, timeout_s)

    def _put(self, beat: dict | None = None, step: tuple[int, str] | None = None,
             wake: bool = True) -> None:
        with self._cond:
            if beat is not None:
                self._beat = beat
            if step is not None:
                self._steps.append(step)
            if self._queued == self._written:
                self._held_since = time.monotonic()
            self._queued += 1
            if wake:
                self._kicked = True
                self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="checkpointless-reporter")
                self._thread.start()

    def _run(self) -> None:
        try:
            node = connect(*protocol.node_store_address(self.host, self.port, self.node_port))
            main = None
            while True:
                with self._cond:
                    while True:  # until kicked, or something has waited HOLD_S
                        if self._queued > self._written:
                            held = time.monotonic() - self._held_since
                            if self._kicked or held >= HOLD_S:
                                break
                            self._cond.wait(HOLD_S - held)
                        else:
                            self._cond.wait()
                    self._kicked = False
                    beat, steps, upto = self._beat, self._steps, self._queued
                    self._beat, self._steps = None, []
                if beat is not None:
                    node.set(protocol.heartbeat_key(self.worker_id), json.dumps(beat))
                if steps:
                    main = main or connect(self.host, self.port)
                    main.multi_set([protocol.step_key(s) for s, _ in steps] + [protocol.LAST_STEP],
                                   [v for _, v in steps] + [str(steps[-1][0])])
                with self._cond:
                    self._written = upto
                    self._cond.notify_all()
        except Exception:  # noqa: BLE001  a store is gone: nothing more can be reported
            with self._cond:
                self._broken = True
                self._cond.notify_all()
