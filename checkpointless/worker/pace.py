"""A worker's own pace: how long each step's body took it, less the time it waited on peers.

Under data parallelism every rank's step lasts as long as the slowest one's: a rank that computes
fast waits for the slow one in the gradient collective, so wall time per step cannot tell them
apart. What can is the time a rank spends *not* waiting: the step's body (from `open` to `close`)
minus the time its training thread spent blocked on peers: in this library's collectives (the
gradient all-reduce, the wait for the bucketed all-reduces of checkpointless.DistributedDataParallel,
the loss sum) and in any wait for a collective to complete (`watch_collectives`: torch's
`Work.wait`, through which FSDP's all-gathers and reduce-scatters pass too). The slow rank arrives
last and waits for nobody, so its figure is its whole step; the others' figures are their own
compute. Communication itself (the bytes on the wire) counts as waiting on every rank alike, so it
cancels out of the comparison.

Chosen over "from the step's start to its first gradient collective" because that point moves
with the gradient sync (one flat all-reduce after backward, or buckets launched during it) and
comes inside forward under FSDP; the wall-minus-waiting figure reads the same whatever the sync.
Its blind spot: a collective whose wait does not pass through `Work.wait` (a functional
collective's `wait_tensor`, a CUDA stream wait with no host block) counts as compute.

The supervisor compares these figures across ranks (policy.find_stragglers); a worker reports
them with its heartbeat (reporter.py), the last `KEEP` steps each time, so a coordinator that reads
heartbeats less often than once a step still sees every step.
"""
from __future__ import annotations

import contextlib
import threading
import time

KEEP = 16  # steps of figures each heartbeat carries
WARMUP = 3  # steps not judged after a worker enters a generation (a start, a recovery)

_local = threading.local()


@contextlib.contextmanager
def waiting():
    """Around a call in which this thread waits on peers: its time is not the rank's own work.
    Nested (a library collective whose torch call waits on its Work), only the outermost
    counts."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _local.depth = depth
        if depth == 0:
            _local.waited = getattr(_local, "waited", 0.0) + time.perf_counter() - t0


def watch_collectives() -> None:
    """Count every wait for a collective to complete (torch's `Work.wait`, which blocking
    collectives call too) as waiting on peers: FSDP's own all-gathers and reduce-scatters, a
    user's collectives, as well as this library's. Installed once per worker process."""
    import torch.distributed as dist
    work = getattr(dist, "Work", None)
    if work is None or getattr(work.wait, "_checkpointless_pace", False):
        return
    wait = work.wait

    def timed_wait(self, *args, **kwargs):
        with waiting():
            return wait(self, *args, **kwargs)
    timed_wait._checkpointless_pace = True
    work.wait = timed_wait


def waited() -> float:
    """Seconds this thread has spent inside `waiting()` so far."""
    return getattr(_local, "waited", 0.0)


class Pace:
    """One worker's step figures: `begin()` as a step's body opens, `end(step, gen)` as it closes;
    `recent()` is what its heartbeat carries: [[step, ms], ...] of the newest steps judged."""

    def __init__(self):
        self._t0: float | None = None
        self._w0 = 0.0
        self._gen, self._in_gen = -1, 0  # the generation, and steps ended in it so far
        self._recent: list[list] = []
        self.own_s: list[float] = []  # recent figures less any injected slowness (faults.py)
        self.injected_s = 0.0  # slowness injected into the step in flight

    def begin(self) -> None:
        self._t0, self._w0, self.injected_s = time.perf_counter(), waited(), 0.0

    def drop(self) -> None:
        """The step in flight is not committed (it is redone): no figure for it."""
        self._t0 = None

    def end(self, step: int, gen: int) -> float | None:
        """The step's figure in seconds (None when no body was timed)."""
        if self._t0 is None:
            return None
        busy = max(0.0, time.perf_counter() - self._t0 - (waited() - self._w0))
        self._t0 = None
        if gen != self._gen:
            self._gen, self._in_gen = gen, 0
        self._in_gen += 1
        self.own_s = (self.own_s + [max(0.0, busy - self.injected_s)])[-KEEP:]
        if self._in_gen > WARMUP:  # the first steps of a generation warm caches, build groups
            self._recent = (self._recent + [[step, round(busy * 1000, 2)]])[-KEEP:]
        return busy

    def recent(self) -> list[list]:
        return self._recent  # replaced, never changed in place: safe to hand to the reporter
