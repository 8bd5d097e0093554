"""The worker's handle on the job: the loop API a script uses, over the recovery parts.

    job = checkpointless.join()                  # a spare waits here until it is given a rank
    job.protect(model=model, optimizer=opt)      # what a spare must receive to take over a rank
    for step in job.steps(max_steps):            # after a recovery, resumes at the agreed step
        with job.step():                         # a peer failure in here is recovered, step redone
            ...forward, backward...
            job.all_reduce_grads(model.parameters())
            opt.step()
    job.finish({"loss": ...})

Loops are written on the step boundary (steploop.py), which asks the state machine (recovery.py)
for its transitions; docs/recovery.md follows a failure through the files."""
from __future__ import annotations

import gc
import json
import os

import torch
import torch.distributed as dist

from . import consistency
from .. import protocol
from .ddp import DistributedDataParallel
from .failures import report_error
from .audit_rank import RankAudits
from .injector import FaultInjector
from .grads import KeptGrads, stage_all_reduce, summed_extra
from .hosting import LogicalRanks
from .outside import OutsideSteps
from .recovery import Recovery
from .rehearsal import Rehearsal
from .reporter import Reporter
from .steploop import StepLoop
from .seeding import seed_all, step_seed
from .state import ProtectedState
from .turns import LoopTurns, StepScope


class Job(LogicalRanks):
    """A worker's handle on the job: the public loop API over the recovery parts (and the
    logical ranks it hosts after a shrink: hosting.py)."""

    def __init__(self, store, worker_id: int, spec: protocol.Spec, host: str, port: int):
        self.store = store
        self.worker_id = worker_id
        self.spec = spec
        self.backend = spec.backend
        self.seed = int(spec.seed)
        self.device_slot = protocol.device_slot()
        self._state = ProtectedState(spec)
        self._kept = KeptGrads()
        self._injector = FaultInjector(protocol.parse_faults(spec.faults), store, worker_id)
        self._injector.corrupt = lambda: consistency.flip_a_bit(self._state.modules())
        self._injector.connect = lambda: protocol.membership.connect(host, port)
        # heartbeats and step records leave the loop's critical path, to the node's own store
        node_port = protocol.node_store_port()
        self.reporter = Reporter(worker_id, host, port, node_port)
        self._rec = Recovery(store, worker_id, spec, host, port, self._state, self._kept,
                             self._injector, self.reporter, node_port, protocol.node_id())
        self._injector.where = lambda: (self._rec.rank, self._rec.completed)
        self._audits = RankAudits(store, worker_id, int(spec.audit_every),  # audit.py
                                  lambda: protocol.membership.connect(host, port))
        # the replay rehearsal and the redo check: a step run twice is compared (rehearsal.py)
        self._rehearsal = Rehearsal(getattr(spec, "replay_check", "warn"), self._state,
                                    self._kept, store)
        self._kept.on_redo_mismatch = lambda step, what: self._rehearsal.redo_mismatch(
            step, self._rec.rank, what)
        # the step boundary, the public API the drop-in Accelerator drives too (steploop.py)
        self.steploop = StepLoop(store, worker_id, spec, self._rec, self._state, self._injector,
                                 self._audits, self._rehearsal)
        self._ddp: DistributedDataParallel | None = None
        self._outside = OutsideSteps(self.steploop, self._rec, store, worker_id)
        self._turns = LoopTurns(self.steploop, self._rec, self._state, self._outside)  # turns.py

    @property
    def on_recovered(self):
        """Called after a recovery outside a step with the committed step before it (the drop-in
        Accelerator agrees on its loop's position there, as its replacement does on start);
        it returns False when a peer failed meanwhile."""
        return self._outside.on_recovered

    @on_recovered.setter
    def on_recovered(self, fn) -> None:
        self._outside.on_recovered = fn

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
    def is_replacement(self) -> bool:  # a spare that took over a rank: its state from peers
        return not self._rec.holds_state

    @property
    def builds_own_state(self) -> bool:
        """Its own build is a state the job may start from: a worker of the launch, or a spare
        that took its rank before any step was committed (a loop builds it all then)."""
        return self._rec.own_build

    @property
    def last_recovery(self) -> dict | None:
        return self._rec.last

    @property
    def rehearsing(self) -> bool:
        """The step's body in flight is the replay rehearsal's first attempt (rehearsal.py): it
        is run again from the same state right after, so skip effects outside the protected
        state (a checkpoint written, a line logged); the second attempt makes them."""
        return self.steploop.rehearsing

    @property
    def replay(self) -> dict | None:
        """The replay check's verdict, on rank 0 once the rehearsal ended (protocol/replay.py:
        checked_at_step, replayable, mismatches, reason), and the redo mismatches this rank saw."""
        r = self._rehearsal
        if r.verdict is None and not r.redo_seen:
            return None
        return {**(r.verdict or {}), "redo_mismatches_here": r.redo_seen}

    @property
    def step_started_at(self) -> float:  # wall time at which the current (or last) step began
        return self.steploop.step_started_at

    def device_mesh(self):
        """The job's DeviceMesh: the default group's, or (dp_replicate, dp_shard, tp): mesh.py."""
        return self._rec.group.device_mesh()

    def mesh_group(self, dim: str):
        """This generation's group of mesh dimension `dim` holding this rank, or None (mesh.py)."""
        return (self._rec.group.subgroups or {}).get(dim)

    @property
    def data_rank(self) -> int:  # this rank's share of a step's batch: one per tp group
        per = self.logical_world // int(self.spec.pp_size)  # and one per pipeline; after a
        return self.logical_ranks[0] % per // int(self.spec.tp_size)  # shrink its first hosted

    @property
    def data_world(self) -> int:  # how many shares a step's batch has (data-parallel size)
        return self.logical_world // int(self.spec.pp_size) // int(self.spec.tp_size)

    def replica_host_bytes(self, part: str = "held") -> int | None:
        """Host bytes of peers' shard copies ("held"), own rollback snapshots ("own"), or "all"."""
        return self._state.replicas.host_bytes(part) if self._state.replicas else None

    def replica_timing(self) -> dict | None:  # exchanges, training-thread seconds (copy, waits)
        return dict(self._state.replicas.timing) if self._state.replicas is not None else None

    # ---- state ---------------------------------------------------------------------------------
    def protect(self, send_frozen: bool = True, rebuild=None, **objects) -> None:
        """Register what a replacement needs: anything with state_dict() / load_state_dict(),
        and a DataLoader (its position, see data.py). send_frozen=False: parameters with
        requires_grad=False (a frozen base under LoRA) are not sent to a replacement, which
        builds them itself as every worker did (pretrained files or seeded init): a recovery
        moves the adapters and their optimizer state only; replicas are compared whole. Sharded,
        `rebuild()` builds and protects them for a new number of processes."""
        st, st.send_frozen = self._state, send_frozen
        st.rebuild, st.layout = rebuild or st.rebuild, st.layout_for(self.world_size, self.rank)
        self._state.protect(**objects)
        self._audits.install(objects.values(), self._injector.faults)  # taps the model's grads
        for obj in objects.values():
            self._injector.install(obj)  # faults scheduled @backward or @optimizer
            if isinstance(obj, DistributedDataParallel):  # it keeps our gradients for a redo
                self._ddp = obj
                obj.on_local_grads = lambda grads, extra: self._kept.remember(
                    self._rec.completed, self.rank, self.world_size, grads, extra)

    def take_rank(self) -> None:
        """Block until a plan gives a rank (a spare waits here, warm); build its group."""
        plan = self._rec.wait_plan(-1, None)
        try:  # a refilled spare warmed up at low priority; training runs at normal priority
            if os.getpriority(os.PRIO_PROCESS, 0) > 0:
                os.setpriority(os.PRIO_PROCESS, 0, 0)
        except OSError:
            pass
        self._rec.join(plan)

    def set_fallback(self, newest_step, load_step, drop_after=None) -> None:
        """Durable checkpoints for a lost slice no peer holds, and for a rewind (audit.py):
        `newest_step(at_most=None)` (a write in flight finishes first), `load_step(step)` into
        the live objects, `drop_after(step)` to remove the ones written after `step`."""
        self._state.fallback = tuple(f for f in (newest_step, load_step, drop_after) if f)

    def resume_at(self, step: int) -> None:  # counting from `step` (a checkpoint was loaded)
        self._rec.resume_at(step)

    def process_env(self) -> dict[str, str]:
        """RANK, WORLD_SIZE, LOCAL_RANK, ... as this job places the process (protocol.keys)."""
        return protocol.placement_env(self.spec, self.rank, self.world_size)

    # ---- the loop ------------------------------------------------------------------------------
    @property
    def preempted(self) -> bool:
        """The job was asked to stop (SIGTERM, SIGINT) and this loop ended at the agreed step:
        write a durable checkpoint now, then finish()."""
        return self._turns.preempted

    def steps(self, max_steps: int):
        """Yield step numbers until `max_steps` steps are committed, recovering on failure."""
        return self._turns.steps(max_steps)

    def epochs(self, num_epochs: int, max_steps: int | None = None, loader=None):
        """Yield epoch numbers of the protected loader's position (data.py), from the agreed
        one after a recovery, until `num_epochs` epochs (or `max_steps` steps) are done."""
        return self._turns.epochs(num_epochs, max_steps, loader)

    def batches(self, loader, max_steps: int | None = None):
        """Yield the protected `loader`'s batches of the current epoch, one per step, like
        `steps()`: a step redone after a recovery gets the same batch again, and a replacement
        starts at the batch after the last committed one (data.py)."""
        return self._turns.batches(loader, max_steps)

    def between_steps(self, fn):
        """Run `fn()`, which may use collectives, outside any step (a final evaluation, a
        gather for export) and return its result. A peer's failure inside it is recovered like
        one in a step: every member runs again, on the new group, the between_steps() calls it
        completed since the last step (results dropped), as the replacement runs them for the
        first time; so `fn` must give the same result when run again. Under sharded state the
        state here is first copied whole to peers, so a failure here restores exactly it."""
        return self._outside.run(fn)

    def step(self):
        """The scope of one step: it commits when the body ends without error; a peer's failure
        inside it is recovered (the step is redone); any other error is reported and raised."""
        return StepScope(self._turns)

    def seed_step(self, step: int, micro: int = 0, share: int | None = None) -> int:
        """Seed every generator for (step, micro, data share): a tensor-parallel group's ranks
        draw alike, so their replicated activations (dropout outside split layers) agree.
        `share`: a hosted logical rank's (hosting.py); this rank's own by default."""
        return seed_all(step_seed(self.seed, step, self.data_rank if share is None else share,
                                  micro))

    @property
    def grads_kept(self) -> bool:
        """True when this rank redoes a step whose all-reduce a peer's failure cut short and it
        still holds its own gradients of that step (same state, rank and world size): the loop
        may skip forward and backward (and zero_grad), `all_reduce_grads` puts them back with
        their `extra`. Only the replacement computes; a loop that recomputes gets the same bits."""
        return self._kept.usable(self._rec.completed, self.rank, self.world_size)

    @property
    def catching_up(self) -> int:
        """How many ranks compute this step while every other rank waits on them, if this rank
        is one of them, else 0: a replacement's first step when the survivors redo it from kept
        gradients (on CPU it may use the idle cores: launcher/train/loop.py)."""
        return self._rec.catching_up

    def all_reduce_grads(self, params, extra: torch.Tensor | None = None):
        """Average the gradients of `params` over the ranks in one fixed-order collective; return
        `extra` summed (grads.all_reduce_grads). A protected checkpointless.DistributedDataParallel
        averaged them during backward with its `reduce_with()` extra: that sum is returned. After
        a skipped compute (`grads_kept`) the kept gradients are averaged in its buckets."""
        if int(self.spec.pp_size) > 1:  # over the stage's replicas: pipelines keep nothing
            return stage_all_reduce(params, self.mesh_group("dp_replicate"), extra)
        ddp = self._ddp
        if ddp is None:
            return self._kept.all_reduce(params, self._rec.completed, self.rank,
                                         self.world_size, extra)
        params = list(params)
        if self.grads_kept and all(p.grad is None for p in params):
            ddp.reduce_now(self._kept.restore())
            return ddp.extra_sum
        return summed_extra(ddp, extra)

    def finish(self, result: dict | None = None) -> None:
        """Check the replicas agree, report this rank's result and leave the job cleanly.

        Replicas that disagree at the end are an error on every rank, never a quiet success.
        The ranks leave together, at a barrier after every result is reported: a peer lost
        before its result was in is recovered like a failure between steps (this rank runs
        again what the replacement runs on its way here); a peer lost after it (on its way
        out) loses nothing, and the run stands."""
        if self._state.modules():
            try:
                self._state.check_at_end(self.world_size, self.between_steps)
            except consistency.NoMajority as exc:
                report_error(self.store, self.worker_id, exc)
                raise
        complete = self._outside.leave(json.dumps(result or {}))
        if self._state.replicas is not None:  # the last copy is worth nothing now: stop it
            self._state.replicas.close(lambda: self._rec.watch.moved(self.gen), timeout_s=10.0)
        self.reporter.beat(self._rec.completed, self.gen, "done")
        self.reporter.flush()
        self.store.set(protocol.done_key(self.worker_id), "1")
        self.store.add(protocol.DONE, 1)
        self._rec.watch.stop()
        if complete:
            self._rec.group.teardown()  # its sockets are shut; a peer may still hold its end
        elif dist.is_initialized():
            dist.destroy_process_group()
        # The process is about to end, and the job with it (the supervisor waits for every
        # rank's exit): Python's last collection at exit walks every object the imports made,
        # 3 s of a core here with torch, transformers and datasets. Frozen, they are skipped;
        # objects made from now on are collected as usual.
        gc.freeze()
