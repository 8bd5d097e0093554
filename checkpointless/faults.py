"""Fault injection: rehearse a failure at a chosen rank and step.

A fault is data, `{kind, rank, step, phase}`, or `kind:rank:step[@phase]` on a command line:
  kill   SIGKILL of the worker (nothing is flushed, like a node loss)
  hang   the worker stops itself (SIGSTOP): alive, holding its sockets, never progressing
  raise  an exception, as a bug or a bad batch would raise
  corrupt  one bit of one parameter flips, silently (a memory or device fault): only the
           consistency check (consistency.py) can catch it
and the phase says when it strikes:
  step     at the start of that step (the default; `raise` inside the step's scope)
  regroup  while the worker holding that rank builds a new generation's group after a failure
           at that step (a second failure during a recovery)
  receive  in the worker taking over that rank, just before it receives the state of that step
  exchange in that rank's background replica exchange (fsdp) of its snapshot of that step, after
           the headers and before the payloads: its holder is receiving, the step computing

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

KINDS = ("kill", "hang", "raise", "corrupt")
PHASES = ("step", "regroup", "receive", "exchange")


class InjectedFault(RuntimeError):
    """The exception a `raise` fault throws inside the step."""


@dataclass(frozen=True)
class Fault:
    """One scheduled failure: what (kind), where (rank), when (step, phase)."""
    kind: str
    rank: int
    step: int
    phase: str = "step"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"faults: kind={self.kind!r} is not one of {', '.join(KINDS)}")
        if self.phase not in PHASES:
            raise ValueError(f"faults: phase={self.phase!r} is not one of {', '.join(PHASES)}")
        if self.rank < 0 or self.step < 0:
            raise ValueError(f"faults: rank={self.rank} and step={self.step} must be >= 0")


def parse_faults(items) -> list[Fault]:
    """Faults from dicts ({kind, rank, step}) or 'kind:rank:step' strings."""
    out = []
    for item in items or []:
        if isinstance(item, str):
            spec, _, phase = item.partition("@")
            parts = spec.split(":")
            if len(parts) != 3:
                raise ValueError(f"fault {item!r}: expected kind:rank:step[@phase], e.g. kill:2:5")
            item = {"kind": parts[0], "rank": int(parts[1]), "step": int(parts[2]),
                    "phase": phase or "step"}
        out.append(Fault(kind=str(item["kind"]), rank=int(item["rank"]), step=int(item["step"]),
                         phase=str(item.get("phase", "step"))))
    return out


class FaultInjector:
    """Fires the faults scheduled for (rank, step), each at most once across the whole job."""

    def __init__(self, faults: list[Fault], store, worker_id: int):
        self.faults = list(faults)
        self.store = store
        self.worker_id = worker_id
        self.corrupt = lambda: None  # set by the job: flips a bit of the protected parameters

    def _claim(self, index: int, store=None) -> bool:
        return (store or self.store).add(protocol.fault_claim_key(index), 1) == 1

    def _record(self, fault: Fault, store=None) -> None:
        # The supervisor reads this to time detection from the real moment of failure.
        (store or self.store).set(protocol.fault_time_key(self.worker_id),
                       json.dumps({"t": time.time(), "kind": fault.kind, "step": fault.step}))

    def before_step(self, rank: int, step: int) -> None:
        """Kill or hang now if scheduled; a `raise` fault is returned by `raise_due`."""
        self.at("step", rank, step, kinds=("kill", "hang", "corrupt"))

    def raise_due(self, rank: int, step: int) -> None:
        self.at("step", rank, step, kinds=("raise",))

    def scheduled(self, phase: str, rank: int, step: int) -> bool:
        return any((f.phase, f.rank, f.step) == (phase, rank, step) for f in self.faults)

    def at(self, phase: str, rank: int, step: int, kinds=KINDS, store=None) -> None:
        """Fire the faults scheduled for this phase, rank and step (each once per job).
        `store`: a connection of the calling thread's own (the exchange thread's)."""
        for i, f in enumerate(self.faults):
            if (f.phase, f.rank, f.step) != (phase, rank, step) or f.kind not in kinds:
                continue
            if not self._claim(i, store):
                continue
            self._record(f, store)
            where = "" if phase == "step" else f" ({phase})"
            print(f"[fault] injecting {f.kind} at rank {rank}, step {step}{where}", flush=True)
            if f.kind in ("kill", "hang"):
                os.kill(os.getpid(), signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP)
                # the signal can take effect a few ms after kill() returns (seen here: a thread
                # sent a whole message after its own SIGSTOP); nothing may progress meanwhile
                time.sleep(5)
            elif f.kind == "corrupt":
                self.corrupt()
            else:
                raise InjectedFault(f"injected fault: raise at rank {rank}, step {step}{where}")
