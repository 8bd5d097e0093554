"""The fault injector: fires the faults of a run's schedule (protocol/faults.py says what each
kind and phase means) inside the worker holding that rank, each at most once across the job."""
from __future__ import annotations

import json
import os
import random
import signal
import threading
import time

import torch

from .. import protocol
from ..protocol.faults import KINDS, SLOW_FACTOR, Fault



def die_here(sig: int) -> None:
    """Signal this process (SIGKILL, SIGSTOP) and wait for it to land: nothing this process
    does after kill() returns may reach its peers."""
    os.kill(os.getpid(), sig)
    time.sleep(protocol.DEFAULTS.signal_settle_s)

class InjectedFault(RuntimeError):
    """The exception a `raise` fault throws inside the step."""

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
        self._sdc = None  # the sdc fault this process claimed (False: claimed by another)

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
                    self._slow = SLOW_FACTOR if f.factor is None else f.factor
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

    def sdc_due(self, rank: int, step: int) -> bool:
        """True when this process computes `step` wrong: it claimed an sdc fault (the first to
        hold its rank at or after its step; the fault is the chip's, so a spare taking the rank
        over computes right) and the step is one of the fault's (STEP, STEP+EVERY, ...)."""
        if self._sdc is None:
            for i, f in enumerate(self.faults):
                if f.kind == "sdc" and f.rank == rank and step >= f.step:
                    self._sdc = f if self._claim(i) else False
                    if self._sdc:
                        self._record(f)
                        print(f"[fault] injecting sdc at rank {rank} from step {step} (every "
                              f"{f.every or 1}): a bit of its gradient flips", flush=True)
                    break
        f = self._sdc
        return bool(f) and step >= f.step and (step - f.step) % (f.every or 1) == 0

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
                # seen here: a thread sent a whole message after its own SIGSTOP
                die_here(signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP)
            elif f.kind == "corrupt":
                self.corrupt()
            else:
                raise InjectedFault(f"injected fault: raise at rank {rank}, step {step}{where}")


def _middle_block(model: torch.nn.Module):
    """The block in the middle of the model's longest list of layers (a transformer's decoder
    blocks; a pipeline stage keeps its own by index), or None for a model without one."""
    lists = [list(m.values()) if isinstance(m, torch.nn.ModuleDict) else list(m)
             for m in model.modules()
             if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict)) and len(m) >= 2]
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
