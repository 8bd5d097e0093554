"""Fault injection: rehearse a failure at a chosen rank and step.

A fault is data, `{kind, rank, step}`:
  kill   SIGKILL of the worker at the start of that step (nothing is flushed, like a node loss)
  hang   the worker stops itself (SIGSTOP): alive, holding its sockets, never progressing
  raise  an exception inside the step, as a bug or a bad batch would raise

Each fault fires once per run: the first worker to reach it claims it in the shared store, so the
spare that takes over the rank and redoes the step does not fail again.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass

from . import protocol

KINDS = ("kill", "hang", "raise")


class InjectedFault(RuntimeError):
    """The exception a `raise` fault throws inside the step."""


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"faults: kind={self.kind!r} is not one of {', '.join(KINDS)}")
        if self.rank < 0 or self.step < 0:
            raise ValueError(f"faults: rank={self.rank} and step={self.step} must be >= 0")


def parse_faults(items) -> list[Fault]:
    """Faults from dicts ({kind, rank, step}) or 'kind:rank:step' strings."""
    out = []
    for item in items or []:
        if isinstance(item, str):
            parts = item.split(":")
            if len(parts) != 3:
                raise ValueError(f"fault {item!r}: expected kind:rank:step, e.g. kill:2:5")
            item = {"kind": parts[0], "rank": int(parts[1]), "step": int(parts[2])}
        out.append(Fault(kind=str(item["kind"]), rank=int(item["rank"]), step=int(item["step"])))
    return out


class FaultInjector:
    """Fires the faults scheduled for (rank, step), each at most once across the whole job."""

    def __init__(self, faults: list[Fault], store, worker_id: int):
        self.faults = list(faults)
        self.store = store
        self.worker_id = worker_id

    def _claim(self, index: int) -> bool:
        return self.store.add(protocol.fault_claim_key(index), 1) == 1

    def _record(self, fault: Fault) -> None:
        # The supervisor reads this to time detection from the real moment of failure.
        self.store.set(protocol.fault_time_key(self.worker_id),
                       json.dumps({"t": time.time(), "kind": fault.kind, "step": fault.step}))

    def before_step(self, rank: int, step: int) -> None:
        """Kill or hang now if scheduled; a `raise` fault is returned by `raise_due`."""
        for i, f in enumerate(self.faults):
            if f.rank != rank or f.step != step or f.kind == "raise":
                continue
            if not self._claim(i):
                continue
            self._record(f)
            print(f"[fault] injecting {f.kind} at rank {rank}, step {step}", flush=True)
            if f.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            else:
                os.kill(os.getpid(), signal.SIGSTOP)

    def raise_due(self, rank: int, step: int) -> None:
        for i, f in enumerate(self.faults):
            if f.kind == "raise" and f.rank == rank and f.step == step and self._claim(i):
                self._record(f)
                print(f"[fault] injecting raise at rank {rank}, step {step}", flush=True)
                raise InjectedFault(f"injected fault: raise at rank {rank}, step {step}")
