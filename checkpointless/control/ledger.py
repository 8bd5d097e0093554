"""The run's record across coordinators (coordinator=etcd): its step records, failures and
recoveries, copied where the next holder of the coordinator's role finds them (facts.py).

The records themselves live in the coordinator's store (rank 0's step records, each member's
entry into a generation), and that store is lost with the coordinator's node. So that a report
written after a takeover still counts from the launch (steps, goodput, every recovery), the
coordinator copies them into the job's facts as it goes:
- `steps/<c>`: steps c*CHUNK .. c*CHUNK+CHUNK-1, step -> [start, end], the chunks that changed,
  at most once every `every_s` (usually one write of a few KB, never one per step);
- `failure/<wid>`: each lost worker, as the report lists it, once the loss is recorded;
- `recovery/<wid>`: its recovery's entry, once the recovery completed (said in the log);
- `stragglers/<token>`: each coordinator's straggler entries, when they change;
- `resize/<i>`: the job's i-th shrink or grow (checkpointless.shrink), as it happens;
- `notice/<i>`: the supervisor's notices (a preemption, a straggler asked to leave), written by
  the supervisor itself before it publishes each, and published again by takeover.py.
A coordinator taking over reads them back (`resume`) and merges its own store's on top. The
steps a lost coordinator had not copied yet (those of its last `every_s` at most) are missing
from the record: goodput counts their time as lost, as it counts the takeover's.

On one machine, or with the default coordinator, the facts keep nothing (NoFacts) and this does
nothing: the store is the whole record.
"""
from __future__ import annotations

import json
import time

from .. import protocol
from .report import Failure, failure_of, new_step_records, recovery_entry

# steps per key: about 2.5 KB of JSON, the most rewritten at once (the open chunk, up to once
# every `every_s`), so that etcd's history grows slowly between its compactions
CHUNK = 64
RESCAN = 8  # newest step records read again: a step redone after a rollback rewrites its own


class Ledger:
    """One coordinator's copy of the run's record into the job's facts, and what the
    coordinators before it copied (after a takeover)."""

    def __init__(self, facts, every_s: float = 1.0):
        self.facts, self.every_s = facts, every_s
        self.steps: dict[int, tuple[float, float]] = {}  # every step known, earlier ones too
        self.resumed_steps: dict[int, tuple[float, float]] = {}  # as read back; never changed
        self.next_step: int | None = None  # the first step record of this store not read yet
        self.earlier_failures: list[dict] = []  # recorded by coordinators before this one
        self.earlier_recoveries: list[dict] = []
        self.earlier_stragglers: list[dict] = []
        self.earlier_resizes: list[dict] = []  # the shrinks and grows, in order
        self._stragglers = "[]"  # this coordinator's entries as last copied
        self._dirty: set[int] = set()  # chunks with steps not copied yet
        self._failures: set[int] = set()  # worker ids whose failure / recovery is copied
        self._recoveries: set[int] = set()
        self._last = 0.0
        self._resizes: dict[int, str] = {}  # resizes not copied yet: index -> JSON

    # ---- a takeover ---------------------------------------------------------------------------
    def resume(self, store, record: dict) -> None:
        """Take the record the coordinators before this one kept (Known.record: name -> JSON)
        and make this store's step records start where it ends."""
        for name, raw in record.items():
            kind, _, key = name.partition("/")
            value = json.loads(raw)
            if kind == "steps":
                self.steps.update({int(s): tuple(v) for s, v in value.items()})
            elif kind == "failure":
                self.earlier_failures.append(value)
                self._failures.add(int(key))
            elif kind == "recovery":
                self.earlier_recoveries.append(value)
                self._recoveries.add(int(key))
            elif kind == "stragglers":
                self.earlier_stragglers += value
            elif kind == "resize":
                self.earlier_resizes.append((int(key), value))
            # notice/<i>: the supervisor's notices, published again by takeover.py
        self.earlier_failures.sort(key=lambda f: f.get("t_fail", 0.0))
        self.earlier_recoveries.sort(key=lambda e: e["generation"])
        self.earlier_stragglers.sort(key=lambda e: e.get("from_step", 0))
        self.earlier_resizes = [e for _, e in sorted(self.earlier_resizes, key=lambda x: x[0])]
        self.resumed_steps = dict(self.steps)  # the scraper's thread reads it (prometheus.py)
        if self.steps:
            # this store holds only the steps from now on: its scan starts past the known ones
            # (from step 0 it would stop at the first 64 missing records and find none)
            self.next_step = max(self.steps) + 1
            store.set(protocol.FIRST_STEP, str(self.next_step))

    # ---- as the job runs ----------------------------------------------------------------------
    def tick(self, store, failures: list[Failure], said: set[int], nproc: int,
             last_gen: int, force: bool = False, stragglers: list | None = None) -> None:
        """Copy what changed since the last call (at most every `every_s`, unless `force`)."""
        if not self.facts.durable or (not force and time.time() - self._last < self.every_s):
            return
        self._last = time.time()
        self._read_steps(store)
        for c in sorted(self._dirty):
            chunk = {str(s): [round(self.steps[s][0], 6), round(self.steps[s][1], 6)]
                     for s in range(c * CHUNK, c * CHUNK + CHUNK) if s in self.steps}
            if self.facts.record(f"steps/{c}", json.dumps(chunk)):
                self._dirty.discard(c)  # else tried again at the next call
        for i, f in enumerate(failures):
            if f.wid not in self._failures and \
                    self.facts.record(f"failure/{f.wid}", json.dumps(failure_of(f))):
                self._failures.add(f.wid)
            if i in said and f.wid not in self._recoveries:  # complete: its entry, once
                e = recovery_entry(store, f, nproc, last_gen)
                if e is not None and self.facts.record(f"recovery/{f.wid}", json.dumps(e)):
                    self._recoveries.add(f.wid)
        self._copy_resizes()
        raw = json.dumps(stragglers or [])
        if raw != self._stragglers and self.facts.record(
                f"stragglers/{self.facts.taking.get('token', 0)}", raw):
            self._stragglers = raw

    def record_resize(self, i: int, event: dict) -> None:
        """The job's i-th shrink or grow, at once: a takeover keeps the report's `shrinks`,
        `grows` and the capacity they cost. One etcd did not take now is tried again at the
        next tick."""
        if self.facts.durable:
            self._resizes[i] = json.dumps(event)
            self._copy_resizes()

    def _copy_resizes(self) -> None:
        for i, raw in list(self._resizes.items()):
            if self.facts.record(f"resize/{i}", raw):
                del self._resizes[i]

    def _read_steps(self, store) -> None:
        """The step records written since the last read (report.new_step_records' cursor)."""
        got, self.next_step = new_step_records(store, self.next_step, RESCAN)
        for s, t in got.items():
            if self.steps.get(s) != t:
                self.steps[s] = t
                self._dirty.add(s // CHUNK)

    def earlier(self) -> dict:
        """What the report adds to its own store's records (report.RunFacts.earlier)."""
        return {"steps": dict(self.steps), "failures": list(self.earlier_failures),
                "recoveries": list(self.earlier_recoveries),
                "stragglers": list(self.earlier_stragglers)}
