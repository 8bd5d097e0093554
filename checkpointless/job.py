"""The worker side: join the job, train step by step, survive a peer's failure in-process.

    job = checkpointless.join()                  # a spare waits here until it is given a rank
    job.protect(model=model, optimizer=opt)      # what a spare must receive to take over a rank
    for step in job.steps(max_steps):            # after a recovery, resumes at the agreed step
        with job.step():                         # a peer failure in here is recovered, step redone
            ...forward, backward...
            job.all_reduce_grads(model.parameters())
            opt.step()
    job.finish({"loss": ...})

A step commits when its body ends without error. If a collective fails because a peer died, the
body's exception is swallowed, the worker waits for the supervisor's next membership plan, builds the
new process group, and the members agree on the newest committed step: any member that holds it is a
source, every other member (the spare, a survivor that had not applied the update) receives the full
state from a source. No disk, no restart, no model rebuild.

This file is the facade; the parts live beside it: recovery.py (the state machine), group.py
(process groups), restore.py (who sends what to whom), state.py (what is protected), watch.py,
grads.py (the fixed-order all-reduce and kept gradients), failures.py (what counts as a peer's
failure), protocol.py (every store key and default), plain.py (the torchrun fallback).
"""
from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from . import consistency, detection, membership, protocol
from .data import END, Cursor, LoaderPosition
from .ddp import DistributedDataParallel
from .failures import GroupAborted, report_error, report_uncaught
from .faults import FaultInjector, parse_faults
from .grads import KeptGrads, all_reduce_extra
from .plain import PlainJob
from .recovery import Recovery
from .steploop import StepLoop
from .seeding import seed_all, step_seed
from .state import ProtectedState


class Job:
    """A worker's handle on the job: the public loop API over the recovery parts."""

    def __init__(self, store, worker_id: int, spec: protocol.Spec, host: str, port: int):
        self.store = store
        self.worker_id = worker_id
        self.spec = spec
        self.backend = spec.backend
        self.seed = int(spec.seed)
        self.device_slot = protocol.device_slot()
        self._state = ProtectedState(spec)
        self._kept = KeptGrads()
        self._injector = FaultInjector(parse_faults(spec.faults), store, worker_id)
        self._injector.corrupt = lambda: consistency.flip_a_bit(self._state.modules())
        self._injector.connect = lambda: membership.connect(host, port)
        self._rec = Recovery(store, worker_id, spec, host, port, self._state, self._kept,
                             self._injector)
        self._injector.where = lambda: (self._rec.rank, self._rec.completed)
        # the step boundary, the public API the drop-in Accelerator drives too (steploop.py)
        self.steploop = StepLoop(store, worker_id, spec, self._rec, self._state, self._injector)
        self._scope_used = False
        self._ddp: DistributedDataParallel | None = None
        self._preempted = False
        # between_steps() calls completed since the last step, in order: after a recovery this
        # rank runs them again, as a replacement runs them for the first time (see between_steps)
        self._sections: list = []
        self._sections_gen = -1  # the generation in which they last ran
        # called after a recovery outside a step with the committed step before it (the drop-in
        # Accelerator agrees on its loop's position there, as its replacement does on start);
        # False: a peer failed meanwhile
        self.on_recovered = None

    # ---- where this worker stands -------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._rec.rank

    @property
    def world_size(self) -> int:
        return self._rec.world_size

    @property
    def gen(self) -> int:
        return self._rec.gen

    @property
    def completed_steps(self) -> int:
        return self._rec.completed

    @property
    def is_replacement(self) -> bool:
        """True for a spare that took over a rank: its state comes from peers, not from disk."""
        return not self._rec.holds_state

    @property
    def last_recovery(self) -> dict | None:
        return self._rec.last

    @property
    def step_started_at(self) -> float:
        """Wall time at which the current (or last) step started."""
        return self.steploop.step_started_at

    def replica_host_bytes(self) -> int | None:
        """Host memory held for peer copies of shards (fsdp), or None without replication."""
        r = self._state.replicas
        return r.host_bytes() if r is not None else None

    def replica_timing(self) -> dict | None:
        """What the replica exchanges cost this rank's training thread: their count, and the
        seconds spent copying snapshots and waiting for the previous exchange (fsdp)."""
        r = self._state.replicas
        return dict(r.timing) if r is not None else None

    # ---- state ---------------------------------------------------------------------------------
    def protect(self, send_frozen: bool = True, **objects) -> None:
        """Register what a replacement needs: anything with state_dict() / load_state_dict(),
        and a DataLoader (its position, see data.py).

        send_frozen=False: parameters with requires_grad=False (a frozen base under LoRA) are
        not sent to a replacement, which builds them itself the way every worker did (from the
        same pretrained files, or the same seeded init): a recovery moves the adapters and
        their optimizer state only. The replicas are still compared whole."""
        self._state.send_frozen = send_frozen
        self._state.protect(**objects)
        for obj in objects.values():
            self._injector.install(obj)  # faults scheduled @backward or @optimizer
            if isinstance(obj, DistributedDataParallel):  # it keeps our gradients for a redo
                self._ddp = obj
                obj.on_local_grads = lambda grads, extra: self._kept.remember(
                    self._rec.completed, self.rank, self.world_size, grads, extra)

    def set_fallback(self, newest_step, load_step) -> None:
        """Durable checkpoints, used when no peer holds a lost slice: `newest_step()` gives the
        newest step on disk (None if none, finishing any write in flight first) and
        `load_step(step)` loads that checkpoint into the live objects."""
        self._state.fallback = (newest_step, load_step)

    def resume_at(self, step: int) -> None:
        """Start counting from `step` (after loading a checkpoint), before the first steps()."""
        self._rec.resume_at(step)

    def process_env(self) -> dict[str, str]:
        """What tools built on torch.distributed read from the environment (accelerate), as
        this job places the process: RANK and WORLD_SIZE are the job's; LOCAL_RANK counts the
        node's active ranks (a spare that took over a node's first rank is its local main
        process, whatever device slot it holds) and LOCAL_WORLD_SIZE is their number. The group
        exists already: MASTER_ADDR only satisfies a multi-node check."""
        per_node = max(1, self.spec.ranks_per_node)
        env = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
               "LOCAL_RANK": str(self.rank % per_node), "LOCAL_WORLD_SIZE": str(per_node)}
        if "MASTER_ADDR" not in os.environ:
            env["MASTER_ADDR"] = os.environ.get(protocol.ENV_STORE_HOST, "127.0.0.1")
        return env

    # ---- the loop ------------------------------------------------------------------------------
    @property
    def preempted(self) -> bool:
        """True once the job was asked to stop (SIGTERM or SIGINT to a launcher) and this rank's
        loop ended early at the agreed step: write a durable checkpoint now, then finish()."""
        return self._preempted

    def _stop_here(self, step: int) -> bool:
        """The job is being stopped and every rank stops before `step` or sooner."""
        if not self.store.check([protocol.PREEMPT]):
            return False
        self._preempted = step >= int(self.store.get(protocol.PREEMPT))
        return self._preempted

    def steps(self, max_steps: int):
        """Yield step numbers until `max_steps` steps are committed, recovering on failure."""
        self.steploop.start()
        while True:
            step = self.steploop.next()
            if step >= max_steps or self._stop_here(step):
                if self.steploop.secure():
                    return
                continue  # a peer failed at the end: recover, and redo what the restore says
            if not self.steploop.ready(step):
                continue
            self._new_step()
            yield step
            self._after_body()

    def epochs(self, num_epochs: int, max_steps: int | None = None, loader=None):
        """Yield epoch numbers of the protected loader's position (data.py), from the agreed
        one after a recovery, until `num_epochs` epochs (or `max_steps` steps) are done."""
        self.steploop.start()
        pos = self._position(loader)
        while True:
            self.steploop.next()
            if pos.epoch >= num_epochs or (max_steps is not None and
                                           self.completed_steps >= max_steps) \
                    or self._stop_here(self.completed_steps):
                if self.steploop.secure():
                    return
                continue
            epoch = pos.epoch
            yield epoch
            if pos.epoch == epoch:  # its batches ran out here, not moved on by a recovery
                pos.epoch, pos.epoch_start = epoch + 1, self._rec.completed

    def batches(self, loader, max_steps: int | None = None):
        """Yield the protected `loader`'s batches of the current epoch, one per step, like
        `steps()`: a step redone after a recovery gets the same batch again, and a replacement
        starts at the batch after the last committed one (data.py)."""
        self.steploop.start()
        pos = self._position(loader)
        epoch, cursor = pos.epoch, Cursor(loader)
        while True:
            step = self.steploop.next()
            if pos.epoch != epoch or (max_steps is not None and step >= max_steps) or \
                    self._stop_here(step):
                return  # the position moved to a later epoch in a recovery, or the run is done
            batch = cursor.batch(step - pos.epoch_start)  # this epoch's batch for this step
            if batch is END:
                return
            if not self.steploop.ready(step):
                continue
            self._new_step()
            yield batch
            self._after_body()

    def between_steps(self, fn):
        """Run `fn()`, which may use collectives, outside any step (a final evaluation, a
        gather for export) and return its result. A peer's failure inside it is recovered like
        one in a step, and `fn` runs again on the new group; a replacement that took over after
        the last step runs it too, as long as the script calls it after its loop.

        Every member runs the same collectives after a recovery: this rank first runs again the
        between_steps() calls it completed since the last step (their results are dropped), as
        the replacement, following the script, runs them for the first time. So `fn` must give
        the same result when run again (a gather, an evaluation, an export that rewrites its
        files). Under sharded state the state at this boundary is first copied whole to peers
        (`_secure`), so a failure here restores exactly it."""
        self.steploop.start()
        rec = self._rec
        while True:
            gen, before = rec.gen, rec.completed
            self.steploop.next()
            # outside the steps a rank beats here: one still busy after the loop (an export)
            # is not taken for one left behind while the others wait for it
            detection.beat(self.store, self.worker_id, rec.completed, rec.gen, "between")
            if rec.gen != gen and self.on_recovered is not None and \
                    not self.on_recovered(before):
                continue
            if not self.steploop.secure():
                continue
            self.steploop.body(True)  # a hung peer is caught here as in a step
            try:
                if self._sections_gen != rec.gen:  # a recovery since they ran: again, in order
                    for done in self._sections:
                        done()
                    self._sections_gen = rec.gen
                out = fn()
            except Exception as exc:
                self.steploop.fail_or_raise(exc)
                continue
            self.steploop.body(False)
            rec.resumed()
            self._sections.append(fn)
            return out

    def _new_step(self) -> None:
        """A step's body starts: what ran between the steps before it is never run again."""
        self._scope_used = False
        self._sections, self._sections_gen = [], self._rec.gen

    def _after_body(self) -> None:
        """A step body run without `with job.step():` commits when the loop moves on."""
        if not self._scope_used:
            self.steploop.close()

    def _position(self, loader) -> LoaderPosition:
        found = [o for o in self._state.objects.values() if isinstance(o, LoaderPosition) and
                 (loader is None or o.loader is loader)]
        if len(found) != 1:
            what = "this loader" if loader is not None else "one loader"
            raise RuntimeError(f"job.epochs()/job.batches(): protect {what} first, with "
                               "job.protect(..., loader=loader), so a replacement can resume at "
                               "its position" + ("" if loader is not None or not found else
                                                 "; with several, pass epochs(loader=...)"))
        return found[0]

    def step(self):
        """The scope of one step: it commits when the body ends without error; a peer's failure
        inside it is recovered (the step is redone); any other error is reported and raised."""
        return _StepScope(self)

    def seed_step(self, step: int, micro: int = 0) -> int:
        return seed_all(step_seed(self.seed, step, self.rank, micro))

    @property
    def grads_kept(self) -> bool:
        """True when this rank redoes a step whose all-reduce a peer's failure cut short and it
        still holds its own gradients of that step (same state, rank and world size).

        The loop may then skip forward and backward (and zero_grad): `all_reduce_grads` puts the
        kept gradients back and reuses the `extra` given with them. Only the replacement computes,
        so a recovery costs one rank's share of a step, not a whole step on every rank. A loop
        that ignores this and recomputes gets the same result, at the full cost.
        """
        return self._kept.usable(self._rec.completed, self.rank, self.world_size)

    @property
    def catching_up(self) -> int:
        """How many ranks compute this step while every other rank waits on them, if this rank
        is one of them; else 0.

        That is a replacement's first step when the survivors redo it from kept gradients: the
        job waits on the replacement alone, so on CPU it may use the idle cores (if that gives the
        same bits, see launcher/loop.py)."""
        return self._rec.catching_up

    def all_reduce_grads(self, params, extra: torch.Tensor | None = None):
        """Average the gradients of `params` over the ranks in one fixed-order collective and
        return `extra` summed over the ranks (see `grads.all_reduce_grads`).

        With a protected checkpointless.DistributedDataParallel the gradients were already
        averaged during backward, with the `extra` given to its `reduce_with()`: this returns
        that sum (or sums `extra` now if none was given). When the loop skipped the compute
        because `grads_kept`, it averages the kept gradients and extra in the wrapper's buckets."""
        ddp = self._ddp
        if ddp is None:
            return self._kept.all_reduce(params, self._rec.completed, self.rank,
                                         self.world_size, extra)
        params = list(params)
        if self.grads_kept and all(p.grad is None for p in params):
            ddp.reduce_now(self._kept.restore())
            return ddp.extra_sum
        if ddp.extra_sum is not None:
            summed, ddp.extra_sum = ddp.extra_sum, None
            return summed
        return all_reduce_extra(extra)

    def finish(self, result: dict | None = None) -> None:
        """Check the replicas agree, report this rank's result and leave the job cleanly.

        Replicas that disagree at the end are an error on every rank, never a quiet success.
        The ranks leave together, at a barrier after every result is reported: a peer lost
        before its result was in is recovered like a failure between steps (this rank runs
        again what the replacement runs on its way here); a peer lost after it (on its way
        out) loses nothing, and the run stands."""
        if self._state.replicas is None and self._state.modules():
            sums = self.between_steps(
                lambda: consistency.gather(self._state.modules(), self.world_size))
            if len(set(sums)) > 1:
                exc = consistency.NoMajority(
                    f"the replicas disagree at the end of the run (parameter checksums by rank: "
                    f"{sums}); the run is not a success")
                report_error(self.store, self.worker_id, exc)
                raise exc
        text, rec = json.dumps(result or {}), self._rec
        complete = False
        while True:
            self.store.set(protocol.result_key(self.rank), text)
            detection.beat(self.store, self.worker_id, rec.completed, rec.gen, "finish")
            self.steploop.body(True)  # a peer hung on its way here is caught as in a step
            try:
                if not dist.is_initialized():  # the watch aborted it: a newer generation exists
                    raise GroupAborted(f"the group of generation {rec.gen} was aborted")
                dist.barrier()  # leave together: no group torn down under a peer still in it
                break
            except Exception as exc:  # noqa: BLE001
                self.steploop.body(False)
                if self._results_in():  # the peer died on its way out: nothing is lost
                    complete = True
                    break
                self.steploop.fail_or_raise(exc)
                self.between_steps(lambda: None)  # recover; the calls since the last step again
            finally:
                self.steploop.body(False)
        if self._state.replicas is not None:  # the last copy is worth nothing now: stop it
            self._state.replicas.close(lambda: self._rec.watch.moved(self.gen), timeout_s=10.0)
        detection.beat(self.store, self.worker_id, self._rec.completed, self.gen, "done")
        self.store.set(protocol.done_key(self.worker_id), "1")
        self.store.add(protocol.DONE, 1)
        self._rec.watch.stop()
        if complete:
            self._rec.group.teardown()  # its sockets are shut; a peer may still hold its end
        elif dist.is_initialized():
            dist.destroy_process_group()

    def _results_in(self) -> bool:
        try:
            return membership.results_in(self.store, self.world_size)
        except Exception:  # noqa: BLE001  the store is gone: nothing to confirm with
            return False



class _StepScope:
    """The `with job.step():` scope over the step boundary: commit, or absorb a peer's failure
    (the step is redone after the recovery); any other error is reported and raised."""

    def __init__(self, job: Job):
        self.job = job

    def __enter__(self):
        self.job._scope_used = True
        self.job.steploop.open(self.job.completed_steps)
        return self

    def __exit__(self, exc_type, exc, tb):
        loop = self.job.steploop
        absorbed = exc is not None and loop.absorb(exc)
        if exc is not None and not absorbed:
            loop.body(False)
            return False
        loop.close()
        return absorbed


def started_as_spare() -> bool:
    """True in a process the supervisor started as a hot spare, before `join()` returns.

    A spare has time while it waits: a loop can use it to run one forward and backward off the
    books (kernels chosen, memory pools grown), so the first step it trains after taking over a
    rank, which every other rank waits for, runs at full speed."""
    return protocol.started_as_spare()


def join(seed: int | None = None, backend: str | None = None):
    """Join the job; blocks until this worker holds a rank (a spare waits here, warm).

    Under the supervisor (`python -m checkpointless` or `python -m launcher train`) this returns a
    fault-tolerant Job; under torchrun, a PlainJob with the same API and no recovery.
    """
    if not protocol.supervised():
        if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ:
            if backend is None:
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            return PlainJob(backend, 0 if seed is None else seed)
        raise RuntimeError("checkpointless.join(): not started by the supervisor. Launch with "
                           "`python -m checkpointless --nproc N --spares S script.py`.")
    host = os.environ[protocol.ENV_STORE_HOST]
    port = int(os.environ[protocol.ENV_STORE_PORT])
    worker_id = int(os.environ[protocol.ENV_WORKER_ID])
    store = membership.connect(host, port)
    spec = protocol.Spec.from_json(store.get(protocol.SPEC))
    if seed is not None:
        spec.seed = seed
    job = Job(store, worker_id, spec, host, port)
    report_uncaught(store, worker_id)
    store.set(protocol.ready_key(worker_id), f"{time.time():.6f}")
    plan = job._rec.wait_plan(-1, None)
    try:  # a refilled spare warmed up at low priority; training runs at normal priority
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        pass
    job._rec.join(plan)
    return job
