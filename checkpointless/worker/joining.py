"""How a worker process becomes part of a job: `join()` under the supervisor, or a PlainJob with
the same surface under torchrun."""
from __future__ import annotations

import gc
import os
import time

import torch

from . import health
from ..protocol import membership
from .. import protocol
from .failures import report_uncaught
from .job import Job
from .plain import PlainJob
from .state import refuse_torch_ddp_construction


def started_as_spare() -> bool:
    """True in a process the supervisor started as a hot spare, before `join()` returns.

    A spare has time while it waits: a loop can use it to run one forward and backward off the
    books (kernels chosen, memory pools grown), so the first step it trains after taking over a
    rank, which every other rank waits for, runs at full speed."""
    return protocol.started_as_spare()


_FORKS_FREEZE_GC = []


def _freeze_gc_across_forks() -> None:
    """A process this worker forks (a DataLoader's workers, every epoch) does not collect the
    objects it inherits: gc.freeze() before the fork, undone in the parent after it.

    A worker holds the process groups and store connections of every generation it lived
    through, some in reference cycles. Collected in a forked child, their C++ destructors run
    against threads and sockets that exist only in the parent: DataLoader workers died of
    SIGSEGV after a recovery (examples/train_ddp_checkpointless.py with LOADER_WORKERS=1, three
    or four of them a run, once a new module shifted when the collector ran). Frozen objects
    are never collected in the child, as CPython's docs advise for a process that forks."""
    if not _FORKS_FREEZE_GC:
        os.register_at_fork(before=gc.freeze, after_in_parent=gc.unfreeze)
        _FORKS_FREEZE_GC.append(True)


def join(seed: int | None = None, backend: str | None = None, replay=None,
         unsupervised: protocol.Spec | None = None):
    """Join the job; blocks until this worker holds a rank (a spare waits here, warm).

    Under the supervisor (`python -m checkpointless` or `python -m launcher train`) this returns a
    fault-tolerant Job; under torchrun, a PlainJob with the same API and no recovery.

    `replay`: how this process recomputes a rank's step, for audits while it waits as a spare
    (checkpointless.audit.every; auditor.AuditServer says what it must offer). Without it a
    spare does not audit.

    `unsupervised`: the settings a run under torchrun follows (`job.spec`), where no supervisor
    writes the job's Spec to the store (a launcher gives its recipe's, so that both runs reduce
    alike); the defaults otherwise. Under the supervisor the store's Spec is the one read.
    """
    if not protocol.supervised():
        if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ:
            if backend is None:
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            return PlainJob(backend, 0 if seed is None else seed, unsupervised)
        raise RuntimeError("checkpointless.join(): not started by the supervisor. Launch with "
                           "`python -m checkpointless --nproc N --spares S script.py`.")
    _freeze_gc_across_forks()
    host = os.environ[protocol.ENV_STORE_HOST]
    port = int(os.environ[protocol.ENV_STORE_PORT])
    worker_id = int(os.environ[protocol.ENV_WORKER_ID])
    store = membership.connect(host, port)
    spec = protocol.Spec.from_json(store.get(protocol.SPEC))
    if seed is not None:
        spec.seed = seed
    job = Job(store, worker_id, spec, host, port)
    report_uncaught(store, worker_id, printed_by_supervisor=lambda: job.rank >= 0)
    refuse_torch_ddp_construction()
    watch = None
    if protocol.started_as_spare() and health.enabled(spec.health):
        # checked before it says it is ready, and again while it waits: the supervisor hands a
        # rank only to a spare whose newest check passed
        watch = health.HealthWatch(lambda: membership.connect(host, port), worker_id,
                                   spec.health, int(os.environ.get(protocol.ENV_DEVICE_SLOT, 0)))
        watch.first(store)
    if not protocol.started_as_spare():  # rehearse a loss at start-up (launched as rank wid)
        job._injector.at("init", worker_id, 0, kinds=("kill", "hang"))
    store.set(protocol.ready_key(worker_id), f"{time.time():.6f}")
    if job._rec.node_store is not store:  # its node's agent says so to a coordinator taking over
        job._rec.node_store.set(protocol.ready_key(worker_id), f"{time.time():.6f}")
    server = None
    if protocol.started_as_spare() and replay is not None and int(spec.audit_every) > 0:
        from .auditor import AuditServer
        server = AuditServer(lambda: membership.connect(host, port), host, port, worker_id,
                             replay)
        server.start()
    try:
        job.take_rank()
    finally:
        if server is not None:
            server.stop()  # an audit replaying finishes first: the model is the loop's again
    if watch is not None:
        watch.stop()
    return job
