"""Fault injection: rehearse a failure at a chosen rank and step.

A fault is data, `{kind, rank, step, phase}`, or `kind:rank:step[@phase]` on a command line:
  kill   SIGKILL of the worker (nothing is flushed, like a node loss)
  hang   the worker stops itself (SIGSTOP): alive, holding its sockets, never progressing
  raise  an exception, as a bug or a bad batch would raise
  corrupt  one bit of one parameter flips, silently (a memory or device fault): only the
           consistency check (consistency.py) can catch it
  slow     from that step on, the worker holding that rank then takes FACTOR times as long over
           each step's own work (`slow:RANK:STEP[:FACTOR]`, 3 by default): a straggler, alive and
           correct, that the straggler check (policy.find_stragglers) must find
  sdc      silent data corruption (`sdc:RANK:STEP[:EVERY]`): from that step on, every EVERY steps
           (1 by default), the worker holding that rank flips one bit of its local gradient
           contribution before the reduction, as a chip that computes wrong would. Every replica
           then receives the same wrong sum: only an audit (audit.py, audit.every) can catch it.
           The fault belongs to the process that claims it (the first to hold the rank at or
           after STEP): a replacement of it computes right
and the phase says when it strikes:
  init     while a worker of the first generation starts up, before it says it is ready (its
           imports are done, its model not yet built): STEP must be 0 and RANK is the rank that
           worker was launched for (worker RANK); kill and hang only
  join     while the worker holding that rank forms a generation's process group, after every
           member met at the store barrier and before the group's own rendezvous: at STEP 0 the
           first generation's, at a later STEP the group of a recovery after a failure in it
  step     at the start of that step (the default; `raise` inside the step's scope)
  backward in that step's backward, once the later half of the model's blocks have their
           gradients (under fsdp they were reduce-scattered, under ddp their buckets' all-reduce
           started) and the earlier half do not: after some but not all gradient collectives
  optimizer as the optimizer's step() begins: after every collective of the step's compute
           (gradient reduction, the loss sum, the clipping norm), before the update lands
  random   at a seeded random moment of that step: `@random` or `@random:SEED`; the delay is
           that fraction of the previous step's duration, so it falls anywhere from the step's
           start to its end (kill and hang only: a timer thread fires it)
  regroup  while the worker holding that rank builds a new generation's group after a failure
           at that step (a second failure during a recovery)
  receive  in the worker taking over that rank, just before it receives the state of that step
  send     in the rank sending the state of that step (or a copy of a slice) to a replacement,
           midway: after the sizes and the skeleton, before the payload (the receiver is inside
           its receive; the sender lost mid-transfer)
  exchange in that rank's background replica exchange (fsdp) of its snapshot of that step, after
           the headers and before the payloads: its holder is receiving, the step computing

Each fault fires once per run: the first worker to reach it claims it in the shared store, so the
spare that takes over the rank and redoes the step does not fail again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

KINDS = ("kill", "hang", "raise", "corrupt", "slow", "sdc")
SLOW_FACTOR = 3.0  # a slow fault's factor when none is given
PHASES = ("step", "init", "join", "regroup", "receive", "send", "exchange", "backward",
          "optimizer", "random")
# the kinds each phase can fire: a thread can only kill or stop its process, and a bit flipped
# anywhere but between steps would be a different fault from the one the consistency check sees
_KINDS_AT = {"exchange": ("kill", "hang"), "random": ("kill", "hang"), "init": ("kill", "hang"),
             "join": ("kill", "hang", "raise"), "send": ("kill", "hang", "raise"),
             "backward": ("kill", "hang", "raise"), "optimizer": ("kill", "hang", "raise"),
             "regroup": ("kill", "hang", "raise", "corrupt"),
             "receive": ("kill", "hang", "raise", "corrupt")}


def kinds_at(phase: str) -> tuple:
    """The kinds of fault that can strike at `phase`."""
    return _KINDS_AT.get(phase, KINDS)


class FaultError(ValueError):
    """A fault that cannot be scheduled. Its text is the library's (`python -m checkpointless
    --fault`); `field`, `value` and `fix` let a caller word its own, naming its own key (the
    recipe loader says `faults[2].kind='explode': choose one of ...`)."""

    def __init__(self, message: str, field: str, value, fix: str):
        super().__init__(message)
        self.field, self.value, self.fix = field, value, fix


@dataclass(frozen=True)
class Fault:
    """One scheduled failure: what (kind), where (rank), when (step, phase). Also the shape of a
    recipe's `faults:` entries (launcher/recipe/schema.py), hence the defaults."""
    kind: str = "kill"  # kill (SIGKILL), hang (SIGSTOP), raise (in the step), corrupt (a bit)
    rank: int = 0  # rank that fails
    step: int = 0  # step in which it fails
    phase: str = "step"  # when in it (PHASES; the module's docstring says what each means)
    seed: int = 0  # phase=random: the seed of the moment (kill:2:5@random:7)
    factor: Optional[float] = None  # kind=slow: how many times as long its steps take (None: SLOW_FACTOR)
    every: Optional[int] = None  # kind=sdc: its wrong steps are STEP, STEP+EVERY, ... (None: 1)

    def __post_init__(self):
        problem = _problem(self)
        if problem is not None:
            raise problem


def _problem(f: Fault) -> FaultError | None:
    """The first thing wrong with a fault's values, whatever the world it runs in."""
    if f.kind not in KINDS:
        return FaultError(f"faults: kind={f.kind!r} is not one of {', '.join(KINDS)}",
                          "kind", f.kind, f"choose one of {', '.join(KINDS)}")
    if f.phase not in PHASES:
        return FaultError(f"faults: phase={f.phase!r} is not one of {', '.join(PHASES)}",
                          "phase", f.phase, f"choose one of {', '.join(PHASES)}")
    if f.kind not in kinds_at(f.phase):
        there = ", ".join(kinds_at(f.phase))
        return FaultError(f"faults: kind={f.kind!r} cannot strike @{f.phase}; there, use one of "
                          f"{there}", "kind", f.kind,
                          f"cannot strike @{f.phase}; use one of {there}")
    if f.seed != 0 and f.phase != "random":
        return FaultError(f"faults: seed={f.seed} is for phase=random only (@random:SEED)", "seed",
                          f.seed, "only phase=random takes a seed (kill:2:5@random:7); delete it")
    if f.factor is not None and f.kind != "slow":
        return FaultError(f"faults: factor={f.factor:g} is for kind=slow only (slow:2:5:3)",
                          "factor", f.factor, "only kind=slow takes a factor; delete it")
    if f.every is not None and f.kind != "sdc":
        return FaultError(f"faults: every={f.every} is for kind=sdc only (sdc:2:12:3)", "every",
                          f.every, "only kind=sdc takes an every; delete it")
    if f.every is not None and f.every < 1:
        return FaultError(f"faults: every={f.every} must be >= 1 (an sdc fault strikes every "
                          "that many steps)", "every", f.every, "must be >= 1, e.g. 1")
    if f.kind == "slow" and f.factor is not None and not f.factor > 1:
        return FaultError(f"faults: factor={f.factor:g} must be > 1 (a slow rank's steps take "
                          "that many times as long)", "factor", f.factor, "must be > 1, e.g. 3")
    if f.phase == "init" and f.step != 0:
        return FaultError(f"faults: step={f.step} with phase=init: a start-up fault strikes "
                          "before the first step", "step", f.step, "use step 0 (kill:2:0@init)")
    if f.rank < 0 or f.step < 0:
        field = "rank" if f.rank < 0 else "step"
        return FaultError(f"faults: rank={f.rank} and step={f.step} must be >= 0", field,
                          getattr(f, field), "must be >= 0")
    return None


def split_fault(text: str) -> dict:
    """The fields of a 'kind:rank:step[@phase]' string (the random phase takes its seed as
    '@random:SEED', a slow fault its factor as 'slow:RANK:STEP:FACTOR', an sdc fault its period
    as 'sdc:RANK:STEP:EVERY'), checked for form only:
    Fault checks the values."""
    spec, _, phase = text.partition("@")
    phase, _, seed = phase.partition(":")
    parts = spec.split(":")
    factor = every = None
    if len(parts) == 4 and parts[0] == "slow":
        factor = parts.pop()
    elif len(parts) == 4 and parts[0] == "sdc":
        every = parts.pop()
    if len(parts) != 3:
        raise ValueError(f"fault {text!r}: expected kind:rank:step[@phase], e.g. kill:2:5 or "
                         "kill:2:5@backward")
    if seed and phase != "random":
        raise ValueError(f"fault {text!r}: only @random takes a seed (@random:SEED)")
    try:
        return {"kind": parts[0], "rank": int(parts[1]), "step": int(parts[2]),
                "phase": phase or "step", "seed": int(seed or 0),
                "factor": None if factor is None else float(factor),
                "every": None if every is None else int(every)}
    except ValueError:
        raise ValueError(f"fault {text!r}: rank, step and seed must be integers (an sdc fault's "
                         "every too) and a slow fault's factor a number, e.g. kill:2:5@random:7, "
                         "slow:1:20:3 or sdc:2:12:1") \
            from None


def parse_fault(item) -> Fault:
    """One fault from a dict ({kind, rank, step[, phase, seed]}) or a string (split_fault)."""
    if isinstance(item, str):
        item = split_fault(item)
    return Fault(kind=str(item["kind"]), rank=int(item["rank"]), step=int(item["step"]),
                 phase=str(item.get("phase", "step")), seed=int(item.get("seed", 0) or 0),
                 factor=None if item.get("factor") is None else float(item["factor"]),
                 every=None if item.get("every") is None else int(item["every"]))


def parse_faults(items) -> list[Fault]:
    """Faults from dicts or 'kind:rank:step[@phase]' strings (parse_fault)."""
    return [parse_fault(item) for item in items or []]
