"""checkpointless: keep training through worker failures without reloading a checkpoint.

Depends on torch only. The public API:
    join()                    -> Job: join a job started by the supervisor (spares wait here)
    started_as_spare()        True in a hot spare before it takes a rank (time to warm up)
    Job.protect(**objects)    register model, optimizer, ... that a replacement must receive
    Job.steps(max_steps)      iterate over step numbers, resuming after a recovery
    Job.epochs(n), Job.batches(loader)  or iterate a protected DataLoader, resuming at its batch
    Job.step()                context manager around one step; a peer failure inside is recovered
    Job.all_reduce_grads(...) average gradients in one fixed layout (bit-exact across recoveries)
    DistributedDataParallel   drop-in for torch's wrapper: overlapped, fixed buckets (ddp.py)
    Job.between_steps(fn)     run fn (collectives allowed) after the loop; a peer failure in it is recovered
    Job.finish(result)        report this rank's result and leave
    Job.steploop              the step boundary itself, for a loop of another shape (steploop.py)
    PeerFailure               what a collective raises when a peer was lost (failures.py)
    Supervisor                start workers and spares, detect failures, hand ranks to spares
Run a script under it with `python -m checkpointless --nproc N --spares S script.py`.
"""
from .protocol.faults import Fault, parse_faults
from .worker.ddp import DistributedDataParallel
from .worker.digest import model_sha256, state_sha256
from .worker.failures import Evicted, PeerFailure
from .worker.injector import InjectedFault
from .worker.job import Job
from .worker.joining import join, started_as_spare
from .worker.seeding import step_seed

_CONTROL = ("Supervisor", "SupervisorConfig", "JobFailed")


def __getattr__(name):
    # PEP 562: a training script never loads the control plane; it loads when a name of it is asked
    if name in _CONTROL:
        from . import control
        return getattr(control, name)
    raise AttributeError(f"module 'checkpointless' has no attribute {name!r}")


__all__ = ["DistributedDataParallel", "join", "started_as_spare", "Job", "Evicted", "PeerFailure", "step_seed",
           "Supervisor", "SupervisorConfig", "JobFailed", "Fault", "InjectedFault",
           "parse_faults", "model_sha256", "state_sha256"]
