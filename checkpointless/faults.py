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
and the phase says when it strikes:
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
  exchange in that rank's background replica exchange (fsdp) of its snapshot of that step, after
           the headers and before the payloads: its holder is receiving, the step computing

Each fault fires once per run: the first worker to reach it claims it in the shared store, so the
spare that takes over the rank and redoes the step does not fail again.
"""
from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass

import torch

from . import protocol

KINDS = ("kill", "hang", "raise", "corrupt", "slow")
SLOW_FACTOR = 3.0  # a slow fault's factor when none is given
PHASES = ("step", "regroup", "receive", "exchange", "backward", "optimizer", "random")
# the kinds each phase can fire: a thread can only kill or stop its process, and a bit flipped
# anywhere but between steps would be a different fault from the one the consistency check sees
_KINDS_AT = {"exchange": ("kill", "hang"), "random": ("kill", "hang"),
             "backward": ("kill", "hang", "raise"), "optimizer": ("kill", "hang", "raise"),
             "regroup": ("kill", "hang", "raise", "corrupt"),
             "receive": ("kill", "hang", "raise", "corrupt")}


def kinds_at(phase: str) -> tuple:
    """The kinds of fault that can strike at `phase`."""
    return _KINDS_AT.get(phase, KINDS)


class InjectedFault(RuntimeError):
    """The exception a `raise` fault throws inside the step."""


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
    recipe's `faults:` entries (launcher/schema.py), hence the defaults."""
    kind: str = "kill"  # kill (SIGKILL), hang (SIGSTOP), raise (in the step), corrupt (a bit)
    rank: int = 0  # rank that fails
    step: int = 0  # step in which it fails
    phase: str = "step"  # when in it (PHASES; the module's docstring says what each means)
    seed: int = 0  # phase=random: the seed of the moment (kill:2:5@random:7)
    factor: float = 0.0  # kind=slow: how many times as long its steps take (0: SLOW_FACTOR)

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
    if f.factor and f.kind != "slow":
        return FaultError(f"faults: factor={f.factor:g} is for kind=slow only (slow:2:5:3)",
                          "factor", f.factor, "only kind=slow takes a factor; delete it")
    if f.kind == "slow" and f.factor and f.factor <= 1:
        return FaultError(f"faults: factor={f.factor:g} must be > 1 (a slow rank's steps take "
                          "that many times as long)", "factor", f.factor, "must be > 1, e.g. 3")
    if f.rank < 0 or f.step < 0:
        field = "rank" if f.rank < 0 else "step"
        return FaultError(f"faults: rank={f.rank} and step={f.step} must be >= 0", field,
                          getattr(f, field), "must be >= 0")
    return None


def split_fault(text: str) -> dict:
    """The fields of a 'kind:rank:step[@phase]' string (the random phase takes its seed as
    '@random:SEED', a slow fault its factor as 'slow:RANK:STEP:FACTOR'), checked for form only:
    Fault checks the values."""
    spec, _, phase = text.partition("@")
    phase, _, seed = phase.partition(":")
    parts = spec.split(":")
    factor = "0"
    if len(parts) == 4 and parts[0] == "slow":
        factor = parts.pop()
    if len(parts) != 3:
        raise ValueError(f"fault {text!r}: expected kind:rank:step[@phase], e.g. kill:2:5 or "
                         "kill:2:5@backward")
    if seed and phase != "random":
        raise ValueError(f"fault {text!r}: only @random takes a seed (@random:SEED)")
    try:
        return {"kind": parts[0], "rank": int(parts[1]), "step": int(parts[2]),
                "phase": phase or "step", "seed": int(seed or 0), "factor": float(factor)}
    except ValueError:
        raise ValueError(f"fault {text!r}: rank, step and seed must be integers and a slow "
                         "fault's factor a number, e.g. kill:2:5@random:7 or slow:1:20:3") \
            from None


def parse_fault(item) -> Fault:
    """One fault from a dict ({kind, rank, step[, phase, seed]}) or a string (split_fault)."""
    if isinstance(item, str):
        item = split_fault(item)
    return Fault(kind=str(item["kind"]), rank=int(item["rank"]), step=int(item["step"]),
                 phase=str(item.get("phase", "step")), seed=int(item.get("seed", 0) or 0),
                 factor=float(item.get("factor", 0) or 0))


def parse_faults(items) -> list[Fault]:
    """Faults from dicts or 'kind:rank:step[@phase]' strings (parse_fault)."""
    return [parse_fault(item) for item in items or []]


class FaultInjector:
    """Fires the faults scheduled for (rank, step), each at most once across the whole job."""

    def __init__(self, faults: list[Fault], store, worker_id: int):
        self.faults = list(faults)
        self.store = store
        self.worker_id = worker_id
        self.corrupt = lambda: None  # set by the job: flips a bit of the protected parameters
        self.connect = None  # set by the job: a store connection for a timer thread of its own
        self.where = lambda: (-1, -1)  # set by the job: (rank, step) of the step in flight
        self._armed_backward: set = set()  # (id(module), step) whose output hook is placed
        self._last_start = None  # when the previous step began, and how long it took:
        self._step_s = None  # a random moment is a fraction of that
        self._slow: float | None = None  # this worker's slowness factor, once it claimed one

    def _claim(self, index: int, store=None) -> bool:
        return (store or self.store).add(protocol.fault_claim_key(index), 1) == 1

    def _record(self, fault: Fault, store=None) -> None:
        # The supervisor reads this to time detection from the real moment of failure.
        (store or self.store).set(protocol.fault_time_key(self.worker_id),
                       json.dumps({"t": time.time(), "kind": fault.kind, "step": fault.step}))

    def before_step(self, rank: int, step: int) -> None:
        """Kill or hang now if scheduled; a `raise` fault is returned by `raise_due`. Arms a
        fault scheduled at a random moment of this step."""
        now = time.time()
        if self._last_start is not None and now > self._last_start:
            self._step_s = now - self._last_start
        self._last_start = now
        self.at("step", rank, step, kinds=("kill", "hang", "corrupt"))
        if self.scheduled("random", rank, step):
            self._arm_random(rank, step)

    def _arm_random(self, rank: int, step: int) -> None:
        """Claim the random fault now (once per job) and fire it from a timer thread after its
        seeded fraction of the previous step's duration, wherever the step then is."""
        for i, f in enumerate(self.faults):
            if (f.phase, f.rank, f.step) != ("random", rank, step) or not self._claim(i):
                continue
            fraction = random.Random(f"{f.seed}:{rank}:{step}").random()
            delay = fraction * (self._step_s or 0.5)
            due = time.time() + delay

            def fire(f=f, delay=delay, fraction=fraction, due=due):
                store = self.connect() if self.connect is not None else self.store
                time.sleep(max(0.0, due - time.time()))
                self._record(f, store)
                print(f"[fault] injecting {f.kind} at rank {rank}, step {step} (random: "
                      f"{delay:.3f} s into the step, {fraction:.0%} of the last one)", flush=True)
                os.kill(os.getpid(), signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP)

            threading.Thread(target=fire, daemon=True, name="checkpointless-fault").start()

    # ---- faults inside a step's compute --------------------------------------------------------
    def install(self, obj) -> None:
        """Place the hooks by which `@backward` and `@optimizer` faults strike inside a protected
        model's backward or a protected optimizer's step (nothing when none is scheduled)."""
        phases = {f.phase for f in self.faults}
        if "optimizer" in phases and isinstance(obj, torch.optim.Optimizer):
            obj.register_step_pre_hook(lambda *_: self._inside("optimizer"))
        if "backward" in phases and isinstance(obj, torch.nn.Module):
            block = _middle_block(obj)
            if block is not None:
                block.register_forward_hook(
                    lambda module, args, output: self._arm_backward(obj, module, output))

    def _inside(self, phase: str) -> None:
        rank, step = self.where()
        if self.scheduled(phase, rank, step):
            self.at(phase, rank, step)

    def _arm_backward(self, model, block, output) -> None:
        """In the middle block's forward: the fault fires when the gradient of its output is
        computed, i.e. once every block after it has had its backward (and its collectives).
        Under a ddp wrapper only a backward that syncs counts (not a no_sync micro-batch)."""
        rank, step = self.where()
        if not self.scheduled("backward", rank, step) or not torch.is_grad_enabled() or \
                not getattr(model, "_sync", True) or (id(block), step) in self._armed_backward:
            return
        tensor = _first_tensor(output)
        if tensor is None or not tensor.requires_grad:
            return
        self._armed_backward.add((id(block), step))
        tensor.register_hook(lambda grad: (self.at("backward", rank, step), grad)[1])

    def slow_down(self, rank: int, step: int, own_s: list[float]) -> float:
        """As a step's body opens: a worker that claimed a slow fault (the first to hold its
        rank at or after its step: the spare that takes the rank over later is not slow) sleeps
        (FACTOR - 1) times its own recent time per step. The seconds slept."""
        if self._slow is None:
            for i, f in enumerate(self.faults):
                if f.kind == "slow" and f.rank == rank and step >= f.step and \
                        self._claim(i):
                    self._slow = f.factor or SLOW_FACTOR
                    self._record(f)
                    print(f"[fault] injecting slow x{self._slow:g} at rank {rank}, step {step}",
                          flush=True)
                    break
            else:
                if not any(f.kind == "slow" and f.rank == rank and step >= f.step
                           for f in self.faults):
                    return 0.0
                self._slow = 1.0  # claimed by another worker: this one stays as it is
        if self._slow <= 1.0 or not own_s:
            return 0.0
        s = sorted(own_s)[len(own_s) // 2] * (self._slow - 1.0)
        time.sleep(s)
        return s

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


def _middle_block(model: torch.nn.Module):
    """The block in the middle of the model's longest list of layers (a transformer's decoder
    blocks), or None for a model without one."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) >= 2]
    if not lists:
        return None
    layers = max(lists, key=len)
    return layers[len(layers) // 2]


def _first_tensor(output):
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        for x in output:
            if isinstance(x, torch.Tensor):
                return x
    return None
