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
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from . import detection, membership, transfer
from .faults import FaultInjector, InjectedFault, parse_faults
from .redundancy import ShardReplicas, pick_holders, restorable_step
from .release import sever_peer_connections


class Evicted(RuntimeError):
    """This worker was left out of the new membership (declared failed by the supervisor)."""


def step_seed(seed: int, step: int, rank: int, micro: int = 0) -> int:
    """A seed that depends only on (seed, step, rank, micro-batch), never on process history.

    Seeding every step this way makes dropout and sampling identical whichever process runs the
    rank, so a spare redoing a step draws the same random numbers as the worker it replaced.
    """
    h = hashlib.sha256(f"{seed}/{step}/{rank}/{micro}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


class Job:
    def __init__(self, store, worker_id: int, spec: dict, host: str, port: int):
        self.store = store
        self.worker_id = worker_id
        self.spec = spec
        self.backend = spec["backend"]
        self.seed = int(spec.get("seed", 0))
        self.heartbeat_timeout_s = float(spec["heartbeat_timeout_s"])
        self.pg_timeout_s = float(spec.get("pg_timeout_s", 300))
        self._host, self._port = host, port
        self.rank = -1
        self.world_size = 0
        self.gen = -1
        self.device_slot = int(os.environ.get("CL_DEVICE_SLOT", "0"))
        self._objects: dict = {}
        self._completed = 0
        self._has_state = True
        self._failed = False
        self._fail_t = 0.0
        self._in_step = False
        self._scope_used = False
        self._applied = False
        self._step_t0 = 0.0
        self._pending_first: int | None = None  # generation waiting for its first committed step
        self._latest_gen = -1  # newest generation the watch thread has seen in the store
        self._injector = FaultInjector(parse_faults(spec.get("faults", [])), store, worker_id)
        self.last_recovery: dict | None = None
        self._unsynced_plan: membership.Plan | None = None
        self._replicas: ShardReplicas | None = None
        self._fallback = None
        # this rank's own gradients of a step whose all-reduce a peer's failure cut short
        self._kept: dict | None = None
        self._catching_up = 0

    # ---- membership ----------------------------------------------------------------------
    def _wait_plan(self, after_gen: int, timeout_s: float | None) -> membership.Plan:
        """The newest plan with generation > after_gen that includes this worker."""
        deadline = None if timeout_s is None else time.time() + timeout_s
        last_beat = 0.0
        while True:
            g = membership.current_gen(self.store)
            if g > after_gen:
                plan = membership.read_plan(self.store, g)
                if self.worker_id in plan.ranks:
                    return plan
                if self.rank >= 0:
                    raise Evicted(f"worker {self.worker_id} is not in generation {g}")
                after_gen = g  # a spare not picked this time keeps waiting
            if self.store.check(["shutdown"]):
                raise SystemExit(0)
            if deadline is not None and time.time() > deadline:
                raise TimeoutError(f"no new membership within {timeout_s:.0f} s after a failure")
            if self.rank >= 0 and time.time() - last_beat > 0.5:
                detection.beat(self.store, self.worker_id, self._completed, self.gen, "recover")
                last_beat = time.time()
            # block in the store until the next plan is published: no polling, no delay. A rank
            # wakes twice a second to keep its heartbeat; a spare has none to keep and sleeps
            # long (the store logs a warning at every timeout). The supervisor ends spares.
            try:
                self.store.wait([f"plan/{max(g, after_gen) + 1}"],
                                timedelta(seconds=0.5 if self.rank >= 0 else 60.0))
            except Exception:  # the wait timed out: look again (shutdown, heartbeat)
                pass

    def _teardown_group(self) -> None:
        # Drop FSDP's handles on the old group first: while anything references it, its
        # sockets stay open and a peer blocked on us would wait for the timeout.
        self._rebind_sharded_modules(None)
        if dist.is_initialized():
            try:
                dist.distributed_c10d._abort_process_group()
            except Exception:
                pass
            try:
                dist.destroy_process_group()
            except Exception:
                pass
            if self.backend == "gloo":  # peers blocked on us get an error now, not at timeout
                sever_peer_connections({self._port})

    def _form_group(self, plan: membership.Plan) -> bool:
        self._teardown_group()
        self.gen = plan.gen
        self._replications_this_gen = 0
        self.rank = plan.ranks[self.worker_id]
        self.world_size = plan.world_size
        if not membership.barrier(self.store, plan.gen, plan.world_size):
            return False
        dist.init_process_group(
            self.backend, store=dist.PrefixStore(f"pg/{plan.gen}", self.store),
            rank=self.rank, world_size=self.world_size,
            timeout=timedelta(seconds=self.pg_timeout_s))
        self._t_group = time.time()
        self._rebind_sharded_modules()
        got = dist.get_world_size()
        if got != self.world_size:
            raise RuntimeError(f"process group has world size {got}, the plan asked for "
                               f"{self.world_size}")
        return True

    def _rebind_sharded_modules(self, group="world") -> None:
        """Point FSDP2 modules at the new process group.

        FSDP keeps the group object it was built with; after a regroup that object is dead.
        The new default group gets the old one's name, so DTensor's mesh resolves to it; only
        FSDP's cached handles need replacing, no parameter moves.
        """
        world = dist.group.WORLD if group == "world" else group
        for obj in self._objects.values():
            if not isinstance(obj, torch.nn.Module):
                continue
            for module in obj.modules():
                get_state = getattr(module, "_get_fsdp_state", None)
                group = get_state()._fsdp_param_group if get_state else None
                if group is None:
                    continue
                for info in (group.mesh_info, getattr(group, "post_forward_mesh_info", None)):
                    if info is not None and hasattr(info, "shard_process_group"):
                        info.shard_process_group = world

    def _enter_generation(self, first_plan: membership.Plan, sync: bool = True) -> None:
        """Build the group for a plan (or a newer one) and bring every member to one state.

        With sync=False only the group is built; the state agreement waits for the first
        `steps()` call, once `protect()` has said what the state is.
        """
        plan = first_plan
        while True:
            try:
                if not self._form_group(plan):
                    plan = self._wait_plan(plan.gen, None)
                    continue
                t_group = time.time()
                if not sync:
                    self._unsynced_plan = plan
                    return
                info = self._agree_and_transfer()
                info.update(t_plan=plan.t_published, t_group=t_group, t_ready=time.time(),
                            worker_id=self.worker_id, grads_kept=self.grads_kept)
                self.store.set(f"rec/{plan.gen}/{self.rank}", json.dumps(info))
                self.last_recovery = info
                self._pending_first = plan.gen
                return
            except Exception as exc:  # a member died during the regroup itself: next plan
                if not detection.is_peer_failure(exc):
                    raise
                self._teardown_group()
                plan = self._wait_plan(plan.gen, self._recovery_timeout())

    def _sync_first(self, plan: membership.Plan) -> None:
        """The state agreement deferred from join(); a failure here is recovered like any other."""
        try:
            info = self._agree_and_transfer()
            info.update(t_plan=plan.t_published, t_group=self._t_group, t_ready=time.time(),
                        worker_id=self.worker_id)
            self.store.set(f"rec/{plan.gen}/{self.rank}", json.dumps(info))
            self.last_recovery = info
            self._pending_first = plan.gen if plan.gen > 0 else None
        except Exception as exc:
            if not detection.is_peer_failure(exc):
                raise
            self._failed, self._fail_t = True, time.time()

    def _recovery_timeout(self) -> float:
        return 4 * self.heartbeat_timeout_s + 60

    def _agree_and_transfer(self) -> dict:
        if self._replicas is not None:
            return self._agree_and_restore_shards()
        mine = [self._completed if self._has_state else -1, int(self.grads_kept)]
        got = [torch.zeros(2, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(got, torch.tensor(mine, dtype=torch.int64))
        steps = [int(g[0]) for g in got]
        kept = [bool(g[1]) for g in got]
        resume = max(steps)
        if resume < 0:
            raise RuntimeError("no member of the new generation holds training state")
        sources = [r for r, s in enumerate(steps) if s == resume]
        receivers = [r for r, s in enumerate(steps) if s != resume]
        # when every source redoes the step from kept gradients, it only waits for the receivers
        if self.rank in receivers and all(kept[r] for r in sources):
            self._catching_up = len(receivers)
        pairs = transfer.assign_sources(receivers, sources)
        sent = received = 0
        t0 = time.time()
        for dst, src in pairs.items():
            if self.rank == src:
                sent += transfer.send_state(self._state(), dst)
            elif self.rank == dst:
                state, received = transfer.recv_state(src)
                self._load(state)
                self._kept = None  # gradients of a state this rank no longer holds
        self._completed = resume
        self._has_state = True
        self._zero_grads()  # a loop that recomputes the step starts clean; kept ones are aside
        return {"resumed_step": resume, "steps_by_rank": steps, "pairs": pairs,
                "bytes_sent": sent, "bytes_received": received, "transfer_s": time.time() - t0,
                "source": pairs.get(self.rank)}

    def _agree_and_restore_shards(self) -> dict:
        """Sharded state: roll every rank back to the newest step all slices exist for.

        Survivors restore their own snapshot (if they went past it), each spare receives its
        rank's slice from a peer holding a copy; if no peer holds some slice, every rank loads
        the newest durable checkpoint instead.
        """
        t0 = time.time()
        self._kept = None  # sharded gradients are reduced inside backward: nothing to keep
        for obj in self._objects.values():  # a step cut short may leave FSDP params gathered
            if isinstance(obj, torch.nn.Module):
                for module in obj.modules():
                    if hasattr(module, "reshard") and hasattr(module, "_get_fsdp_state"):
                        module.reshard()
        mine = {"completed": self._completed if self._has_state else -1,
                **self._replicas.summary()}
        infos = [None] * self.world_size
        dist.all_gather_object(infos, mine)
        newest = max(i["completed"] for i in infos)
        step = restorable_step(infos)
        info = {"steps_by_rank": [i["completed"] for i in infos], "bytes_sent": 0,
                "bytes_received": 0, "pairs": {}, "source": None}
        if step is None:  # a peer-memory step is always preferred to disk when one exists
            return self._restore_from_disk(info, newest, t0)
        holders = pick_holders(infos, step)
        if self._has_state and self._completed != step:
            skel, flat = self._replicas.own[step]
            self._load(transfer.unflatten_state(skel, flat))
        for f, h in holders.items():
            if self.rank == h:
                skel, flat = self._replicas.held[f][step]
                # views, not copies: send_state packs them into one buffer anyway
                info["bytes_sent"] += transfer.send_state(
                    transfer.unflatten_state(skel, flat, copy=False), f)
            elif self.rank == f:
                state, info["bytes_received"] = transfer.recv_state(h)
                self._load(state)
                info["source"] = h
        self._completed = step
        self._has_state = True
        self._zero_grads()
        info.update(resumed_step=step, pairs=holders, restored_from="peer_memory",
                    steps_redone=max(0, newest - step), transfer_s=time.time() - t0)
        return info

    def _restore_from_disk(self, info: dict, newest: int, t0: float) -> dict:
        if self._fallback is None:
            raise RuntimeError("a lost slice has no copy in any peer's memory and no durable "
                               "checkpoint is configured (set checkpoint.interval)")
        newest_step, load_step = self._fallback
        mine = newest_step()
        found = [None] * self.world_size
        dist.all_gather_object(found, mine)  # every rank must load the same checkpoint
        if None in found:
            raise RuntimeError("a lost slice has no copy in any peer's memory and no durable "
                               "checkpoint has been written yet")
        step = min(found)
        load_step(step)
        if self.rank == 0:
            print(f"[checkpointless] no peer holds every lost slice: all ranks resume from the "
                  f"durable checkpoint at step {step} ({newest - step} steps to redo)", flush=True)
        self._completed = step
        self._has_state = True
        self._replicas.own.clear()
        self._replicas.held.clear()
        self._zero_grads()
        info.update(resumed_step=step, restored_from="durable_checkpoint",
                    steps_redone=max(0, newest - step), transfer_s=time.time() - t0)
        return info

    def _zero_grads(self) -> None:
        for obj in self._objects.values():
            if isinstance(obj, torch.nn.Module):
                obj.zero_grad(set_to_none=True)

    # ---- state ---------------------------------------------------------------------------
    def protect(self, **objects) -> None:
        """Register what a replacement needs: anything with state_dict() / load_state_dict()."""
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"protect({name}=...): needs state_dict() and load_state_dict()")
            if isinstance(obj, torch.optim.Optimizer):
                obj.register_step_post_hook(self._on_optimizer_step)
        self._objects.update(objects)
        sharded = any(_is_dtensor(p) for o in objects.values() if isinstance(o, torch.nn.Module)
                      for p in o.parameters())
        if sharded and self._replicas is None:
            rep = self.spec.get("replication", {})
            self._replicas = ShardReplicas(int(rep.get("factor", 2)), int(rep.get("interval", 1)),
                                           int(rep.get("offset", 1)))
            self._check_host_memory()

    def set_fallback(self, newest_step, load_step) -> None:
        """Durable checkpoints, used when no peer holds a lost slice: `newest_step()` gives the
        newest step on disk (None if none, finishing any write in flight first) and
        `load_step(step)` loads that checkpoint into the live objects."""
        self._fallback = (newest_step, load_step)

    def _check_host_memory(self) -> None:
        """Refuse to start when the peer copies would not fit in this node's memory."""
        local = sum(_local(p).numel() * _local(p).element_size() for o in self._objects.values()
                    if isinstance(o, torch.nn.Module) for p in o.parameters())
        need = local * 3 * self._replicas.factor * 2  # params + 2 Adam moments, 2 versions each
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return
        per_worker = avail / max(1, int(self.spec.get("workers_per_node", 1)))
        if need > per_worker:
            raise RuntimeError(
                f"checkpointless.replication.factor={self._replicas.factor} needs about "
                f"{need / 1e9:.1f} GB of host memory per worker for peer copies, but this node "
                f"has {per_worker / 1e9:.1f} GB available per worker. Lower the factor, raise "
                "checkpointless.replication.interval (same memory, fewer copies) or add nodes")

    def _on_optimizer_step(self, *_):
        self._applied = True

    def _state(self) -> dict:
        return {name: obj.state_dict() for name, obj in self._objects.items()}

    def _load(self, state: dict) -> None:
        for name, obj in self._objects.items():
            value = state[name]
            if self._replicas is not None:  # plain local shards -> DTensors shaped like the live ones
                value = _as_sharded(obj, value)
            obj.load_state_dict(value)

    # ---- the loop ------------------------------------------------------------------------
    @property
    def completed_steps(self) -> int:
        return self._completed

    @property
    def is_replacement(self) -> bool:
        """True for a spare that took over a rank: its state comes from peers, not from disk."""
        return not self._has_state

    def resume_at(self, step: int) -> None:
        """Start counting from `step` (after loading a checkpoint), before the first steps()."""
        self._completed = step

    @property
    def step_started_at(self) -> float:
        """Wall time at which the current (or last) step started."""
        return self._step_t0

    def steps(self, max_steps: int):
        """Yield step numbers until `max_steps` steps are committed, recovering on failure."""
        if self._unsynced_plan is not None:
            plan, self._unsynced_plan = self._unsynced_plan, None
            self._sync_first(plan)
            if self.rank == 0 and plan.gen == 0:  # where this run's step records begin
                self.store.set("first_step", str(self._completed))
        while True:
            if self._membership_moved() and not self._failed:
                self._failed, self._fail_t = True, time.time()
            if self._failed:
                self._recover()
            if self._completed >= max_steps:
                return
            step = self._completed
            detection.beat(self.store, self.worker_id, step, self.gen, "step")
            self._injector.before_step(self.rank, step)
            self._step_t0 = time.time()  # the replica exchange is part of the step's cost
            if self._replicas is not None and self._replicas.due(step):
                try:
                    # message sizes are exchanged on the first two copies of each generation
                    # (the optimizer state appears after the first step), then reused
                    known = self._replications_this_gen >= 2
                    self._replicas.replicate(step, self._state(), self.rank, self.world_size,
                                             moved=self._membership_moved, sizes_known=known)
                    self._replications_this_gen += 1
                except Exception as exc:
                    if not detection.is_peer_failure(exc):
                        raise
                    self._failed, self._fail_t = True, time.time()
                    continue
            self._scope_used = False
            yield step
            if not self._scope_used and not self._failed:
                self._commit()

    def step(self):
        return _StepScope(self)

    def seed_step(self, step: int, micro: int = 0) -> int:
        s = step_seed(self.seed, step, self.rank, micro)
        torch.manual_seed(s)
        random.seed(s)
        try:
            import numpy as np
            np.random.seed(s % (2 ** 32))
        except ImportError:
            pass
        return s

    @property
    def grads_kept(self) -> bool:
        """True when this rank redoes a step whose all-reduce a peer's failure cut short and it
        still holds its own gradients of that step (same state, rank and world size).

        The loop may then skip forward and backward (and zero_grad): `all_reduce_grads` puts the
        kept gradients back and reuses the `extra` given with them. Only the replacement computes,
        so a recovery costs one rank's share of a step, not a whole step on every rank. A loop
        that ignores this and recomputes gets the same result, at the full cost.
        """
        k = self._kept
        return (k is not None and k["step"] == self._completed and k["rank"] == self.rank
                and k["world"] == self.world_size)

    @property
    def catching_up(self) -> int:
        """How many ranks compute this step while every other rank waits on them, if this rank
        is one of them; else 0.

        That is a replacement's first step when the survivors redo it from kept gradients: the
        job waits on the replacement alone, so on CPU it may use the idle cores (if that gives the
        same bits, see launcher/loop.py)."""
        return self._catching_up

    def all_reduce_grads(self, params, extra: torch.Tensor | None = None):
        """Average the gradients of `params` over the ranks in one fixed-order collective and
        return `extra` summed over the ranks (see `grads.all_reduce_grads`)."""
        from .grads import all_reduce_grads
        params = list(params)
        if self.grads_kept and all(p.grad is None for p in params):
            for p, g in self._kept["grads"]:  # the loop skipped the compute: reuse ours
                p.grad = g
            extra = self._kept["extra"]
        else:  # keep references (no copy): a failed collective leaves every .grad untouched
            self._kept = {"step": self._completed, "rank": self.rank, "world": self.world_size,
                          "grads": [(p, p.grad) for p in params if p.grad is not None],
                          "extra": None if extra is None else extra.detach().clone()}
        out = all_reduce_grads(params, self.world_size, extra)
        self._kept = None
        return out

    def _commit(self) -> None:
        t1 = time.time()
        self._catching_up = 0
        step = self._completed
        self._completed += 1
        if self.rank == 0:
            self.store.set(f"steps/{step}", f"{self._step_t0:.6f},{t1:.6f}")
        if self._pending_first is not None:
            self.store.set(f"recfirst/{self._pending_first}/{self.rank}", f"{t1:.6f}")
            self._pending_first = None

    def _membership_moved(self) -> bool:
        return self._latest_gen > self.gen

    def _recover(self) -> None:
        self._catching_up = 0
        self._teardown_group()
        plan = self._wait_plan(self.gen, self._recovery_timeout())
        self._enter_generation(plan)
        self._failed = False

    def finish(self, result: dict | None = None) -> None:
        """Report this rank's result and leave the job cleanly."""
        self.store.set(f"result/{self.rank}", json.dumps(result or {}))
        detection.beat(self.store, self.worker_id, self._completed, self.gen, "done")
        self.store.set(f"done/{self.worker_id}", "1")
        self.store.add("done", 1)
        self._stop_watch.set()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    # ---- release of a survivor blocked in a collective -----------------------------------
    def _start_watch(self) -> None:
        self._stop_watch = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="checkpointless-watch").start()

    def _watch(self) -> None:
        """Abort the process group when the membership moves on while we are inside a step.

        Gloo usually raises at once when a peer dies, but a rank whose ring neighbours are alive
        and equally stuck, or any rank on NCCL, would wait for the process-group timeout. Aborting
        the communicator turns that wait into an immediate error that the step scope recovers from.
        """
        store = membership.connect(self._host, self._port)
        while not self._stop_watch.is_set():
            # block in the store until the next generation's plan appears: no polling, and the
            # communicator is aborted the moment it is published
            g = max(self.gen, self._latest_gen) + 1
            t0, wait_s = time.time(), 3600.0
            try:
                store.wait([f"plan/{g}"], timedelta(seconds=wait_s))
            except Exception:
                if time.time() - t0 < wait_s / 2:  # not a timeout: the store is gone, job over
                    return
                continue
            if self.gen >= 0 and g > self.gen and g > self._latest_gen:
                self._latest_gen = g
                if self._in_step and dist.is_initialized():
                    try:
                        dist.distributed_c10d._abort_process_group()
                    except Exception:
                        pass


class _StepScope:
    def __init__(self, job: Job):
        self.job = job

    def __enter__(self):
        job = self.job
        job._scope_used = True
        job._applied = False
        job._in_step = True
        job.seed_step(job._completed)
        try:
            job._injector.raise_due(job.rank, job._completed)
        except InjectedFault as exc:
            job._in_step = False
            _report_error(job, exc)
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        job = self.job
        job._in_step = False
        if exc is None:
            job._commit()
            return False
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            return False
        if detection.is_peer_failure(exc) or job._membership_moved():
            job._failed, job._fail_t = True, time.time()
            if job._applied:  # the update landed before the failure: this step stands
                job._commit()
            return True
        _report_error(job, exc)
        return False


def _report_error(job: Job, exc: BaseException) -> None:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        job.store.set(f"error/{job.worker_id}", json.dumps({"t": time.time(), "error": text}))
        job.store.add("errors", 1)
    except Exception:
        pass


class PlainJob:
    """The same loop API with no fault tolerance, for a script started by torchrun.

    It lets one training script run both ways: under the supervisor (recovering in-process) or
    under torchrun (a failure kills the job; torchrun restarts it and the script resumes from its
    last disk checkpoint), which is the baseline the benchmark measures against.
    """

    def __init__(self, backend: str, seed: int):
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        # torchrun keeps one rendezvous store across restarts; keys left by the previous
        # round (old gloo addresses) make a plain env:// init connect to dead peers and fail
        # again (pytorch#135712). A prefix per restart round keeps each round's keys apart.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=timedelta(seconds=300))
        prefix = f"plainjob/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank,
                                world_size=world)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.worker_id, self.gen, self.seed = self.rank, 0, seed
        self.backend = backend
        self.device_slot = int(os.environ.get("LOCAL_RANK", "0"))
        self.is_replacement = False
        self.grads_kept = False  # a failure ends the job: no step is ever redone in-process
        self.catching_up = 0
        self._completed = 0
        self._step_t0 = 0.0

    completed_steps = Job.completed_steps
    step_started_at = Job.step_started_at
    resume_at = Job.resume_at
    seed_step = Job.seed_step

    def all_reduce_grads(self, params, extra: torch.Tensor | None = None):
        from .grads import all_reduce_grads
        return all_reduce_grads(params, self.world_size, extra)

    def protect(self, **objects) -> None:
        pass  # nothing to protect: a failure ends the job

    def steps(self, max_steps: int):
        while self._completed < max_steps:
            self._step_t0 = time.time()
            self._scoped = False
            yield self._completed
            if not self._scoped:
                self._completed += 1

    def step(self):
        job = self

        class _Scope:
            def __enter__(self):
                job._scoped = True
                job.seed_step(job._completed)

            def __exit__(self, exc_type, exc, tb):
                if exc is None:
                    job._completed += 1
                return False

        return _Scope()

    def finish(self, result: dict | None = None) -> None:
        dist.barrier()
        dist.destroy_process_group()


def started_as_spare() -> bool:
    """True in a process the supervisor started as a hot spare, before `join()` returns.

    A spare has time while it waits: a loop can use it to run one forward and backward off the
    books (kernels chosen, memory pools grown), so the first step it trains after taking over a
    rank, which every other rank waits for, runs at full speed."""
    return os.environ.get("CL_SPARE") == "1"


def join(seed: int | None = None, backend: str | None = None):
    """Join the job; blocks until this worker holds a rank (a spare waits here, warm).

    Under the supervisor (`python -m checkpointless` or `python -m launcher train`) this returns a
    fault-tolerant Job; under torchrun, a PlainJob with the same API and no recovery.
    """
    host = os.environ.get("CL_STORE_HOST")
    if host is None:
        if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ:
            if backend is None:
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            return PlainJob(backend, 0 if seed is None else seed)
        raise RuntimeError("checkpointless.join(): not started by the supervisor. Launch with "
                           "`python -m checkpointless --nproc N --spares S script.py`.")
    port = int(os.environ["CL_STORE_PORT"])
    worker_id = int(os.environ["CL_WORKER_ID"])
    store = membership.connect(host, port)
    spec = json.loads(store.get("spec"))
    if seed is not None:
        spec["seed"] = seed
    job = Job(store, worker_id, spec, host, port)
    store.set(f"ready/{worker_id}", f"{time.time():.6f}")
    plan = job._wait_plan(-1, None)
    try:  # a refilled spare warmed up at low priority; training runs at normal priority
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:
        pass
    # Workers of the first generation all start from the same seeded state; a worker that joins
    # later is a spare and holds nothing until it receives the state.
    job._has_state = plan.gen == 0
    job._enter_generation(plan, sync=False)
    job._start_watch()
    return job


def _is_dtensor(t) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def _local(t):
    return t.to_local() if _is_dtensor(t) else t


def _like(local: torch.Tensor, ref):
    """`local` (a shard) as a DTensor placed like `ref`, or as is when `ref` is not sharded."""
    if not _is_dtensor(ref):
        return local
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local.to(ref.device), ref.device_mesh, ref.placements,
                              shape=ref.shape, stride=ref.stride(), run_check=False)


def _as_sharded(obj, value):
    if isinstance(obj, torch.nn.Module):
        live = obj.state_dict()
        return {k: _like(v, live[k]) if k in live else v for k, v in value.items()}
    if isinstance(obj, torch.optim.Optimizer):
        params = [p for g in obj.param_groups for p in g["params"]]
        order = [i for g in value["param_groups"] for i in g["params"]]
        by_id = dict(zip(order, params))
        state = {}
        for idx, st in value["state"].items():
            p = by_id[idx]
            state[idx] = {k: (_like(v, p) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                          for k, v in st.items()}
        return {"state": state, "param_groups": value["param_groups"]}
    return value
