"""A small fault-tolerant loop for the failure-path tests; environment variables break it.

    RAISE_AT=rank:step   that rank raises RuntimeError("timed out reading shard 7 ...") at that
                         step: once per job, or every time with RAISE_ALWAYS=1
    STALL_SPARES=1       spares never finish starting up (they sleep before join)
    CRASH_WORKER=wid     that worker id exits with code 3 before it joins
    CRASH_REPLACEMENTS=1 every replacement raises right after it is handed a rank
    WRAP_DDP=1           the model stays wrapped in torch's DistributedDataParallel (protected
                         wrapped); WRAP_DDP=after: the bare model is protected, then wrapped
    UNSEEDED=1           the model is built without a seed: each process its own init
    DDP_BUCKET_MB=x      gradients averaged by checkpointless.DistributedDataParallel in buckets
                         of x MB (several: more than one collective in flight per step)
    SKIP_FINISH=1        the script ends without job.finish(): its workers exit with code 0
    LOADER_WORKERS=n     a DataLoader with n worker processes, forked after join, is stepped
                         along (its children inherit the process group's sockets)
    KILL_BEFORE_FINISH=r that rank SIGKILLs itself after its loop, before job.finish() (once)
    KILL_AFTER_FINISH=r  that rank SIGKILLs itself once job.finish() returned (its result is in)
    WORK=n               each step also multiplies n 128x128 matrices (a fixed amount of compute,
                         so that a rank slowed from outside takes longer over it)
    WAIT_READY=w,w       every rank starts its loop once those workers (spares) are ready
    RANK0_EXTRA=f        rank 0 spends f x the time of that compute more in every step, waiting
                         (work that comes with the rank and waits on a disk or a tracker's
                         server, as a log or a save inside the step does; a sleep, so that on a
                         machine with fewer cores than workers it does not slow its peers too)
"""
import hashlib
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import checkpointless

STEPS = int(os.environ.get("MAX_STEPS", "16"))
WORK = int(os.environ.get("WORK", "0"))
RANK0_EXTRA = float(os.environ.get("RANK0_EXTRA", "0"))
busy = torch.ones(128, 128)
wid = os.environ.get("CL_WORKER_ID")
if wid is not None and os.environ.get("CRASH_WORKER") == wid:
    print(f"worker {wid}: crashing before join", flush=True)
    sys.exit(3)
if os.environ.get("STALL_SPARES") and checkpointless.started_as_spare():
    time.sleep(3600)

torch.manual_seed(int.from_bytes(os.urandom(4), "little") if os.environ.get("UNSEEDED") else 0)
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
job = checkpointless.join()
if os.environ.get("CRASH_REPLACEMENTS") and job.is_replacement:
    raise RuntimeError("this replacement cannot start: broken device")
if os.environ.get("WRAP_DDP") == "1":
    model = torch.nn.parallel.DistributedDataParallel(model)
dropin = None
if os.environ.get("DDP_BUCKET_MB"):
    dropin = checkpointless.DistributedDataParallel(
        model, bucket_cap_mb=float(os.environ["DDP_BUCKET_MB"]))
job.protect(model=dropin or model, optimizer=opt)
if os.environ.get("WRAP_DDP") == "after":  # as most DDP scripts do, once the state is protected
    model = torch.nn.parallel.DistributedDataParallel(model)
if os.environ.get("WAIT_READY"):  # a test's failure must find these spares warm
    from checkpointless import protocol
    keys = [protocol.ready_key(int(w)) for w in os.environ["WAIT_READY"].split(",")]
    while not job._rec.store.check(keys):
        time.sleep(0.05)
raise_at = os.environ.get("RAISE_AT")
loader = None
if os.environ.get("LOADER_WORKERS"):
    from torch.utils.data import DataLoader
    loader = iter(DataLoader(range(10 ** 6), batch_size=4,
                             num_workers=int(os.environ["LOADER_WORKERS"])))
for step in job.steps(STEPS):
    with job.step():
        if raise_at == f"{job.rank}:{step}":
            marker = f"{os.environ['MARKER_DIR']}/raised-{raise_at}"
            if os.environ.get("RAISE_ALWAYS") or not os.path.exists(marker):
                open(marker, "w").close()
                raise RuntimeError("timed out reading shard 7 of my own dataset")
        if loader is not None:
            next(loader)  # the data below stays a function of (step, rank)
        t_work = time.perf_counter()
        for _ in range(WORK):  # compute that touches no state
            torch.mm(busy, busy)
        if RANK0_EXTRA and job.rank == 0:
            time.sleep(RANK0_EXTRA * (time.perf_counter() - t_work))
        g = torch.Generator().manual_seed(step * 1000 + job.rank)
        x = torch.randn(32, 16, generator=g)
        if dropin is not None and job.grads_kept:  # a survivor redoing the step: no recompute
            job.all_reduce_grads(model.parameters())
        else:
            loss = F.mse_loss((dropin or model)(x), x[:, :1] ** 2)
            opt.zero_grad()
            if dropin is not None:
                dropin.reduce_with(loss.detach())
            loss.backward()
            job.all_reduce_grads(model.parameters())
        opt.step()
h = hashlib.sha256()
for name, t in sorted(model.state_dict().items()):
    h.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())


def kill_self_once(what: str) -> None:
    if os.environ.get(what) != str(job.rank):
        return
    marker = f"{os.environ['MARKER_DIR']}/{what}"
    if not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), 9)
        time.sleep(5)


kill_self_once("KILL_BEFORE_FINISH")
if not os.environ.get("SKIP_FINISH"):
    job.finish({"params_sha256": h.hexdigest(), "steps": job.completed_steps})
kill_self_once("KILL_AFTER_FINISH")
