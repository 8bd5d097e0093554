"""A step by logical ranks (checkpointless.shrink; the library's side is
checkpointless/worker/hosting.py, and fsdp_logical.py under fsdp).

Under `shrink=exact` every step takes this path, the failure-free one too: each logical rank's
micro-batches run with its data share and its random streams, its gradients are kept apart, and
the reduction sums the job's logical ranks in one fixed order, so a process hosting two of them
after a shrink computes what two processes did. Under `shrink=fast` only a shrunk generation
takes it (with today's collective); the others run the usual step. Under fsdp (`exact` only)
FSDP2's reduce-scatter is the logical one: each logical rank's gradients reach it whole, once
its micro-batches are done.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from checkpointless.worker import logical_all_reduce

from .data import to_device
from .model_setup import cpu_threads
from .schema import SHARDED


def shard_mesh_of(cfg, job):
    """The mesh the model is sharded over: the job's, except under hsdp with shrink=exact,
    where it is the shard group's alone (1-D): the logical reduce-scatter then hands each chunk
    to its twins itself (fsdp_logical.py), and FSDP2 adds no replica all-reduce of its own."""
    mesh = job.device_mesh()
    names = mesh.mesh_dim_names or ()
    if cfg.checkpointless.shrink == "exact" and "dp_replicate" in names:
        return mesh["dp_shard"]
    return mesh


def takes_logical_step(run) -> bool:
    """This generation's steps go by logical rank: the same answer on every process."""
    d, shrink = run.cfg.distributed, run.cfg.checkpointless.shrink
    if d.strategy in SHARDED:
        return shrink == "exact"
    return d.strategy == "ddp" and not run.pipe and (
        shrink == "exact" or (shrink == "fast" and run.job.shrunk))


def logical_step(run, step: int) -> torch.Tensor:
    """Forward and backward for each hosted logical rank, then the gradients averaged over the
    logical world (written into the `.grad`s); the step's loss summed over every logical rank.
    A redone step reuses the contributions this process computed before a peer's failure cut it
    short: only a rank new here (a replacement's, or one a shrink moved) is computed again."""
    job, accelerator, t = run.job, run.accelerator, run.cfg.trainer
    if run.logical_fsdp is not None:
        return _fsdp_step(run, step)
    params = [p for p in run.model.parameters() if p.requires_grad]
    contributions = {}
    # a replacement the survivors wait on (they redo the step from what they kept) may use
    # their idle cores, as in the usual step
    threads = run.catch_up_threads // job.catching_up if job.catching_up else None
    for share in job.logical_ranks:
        kept = job.kept_contribution(step, share)
        if kept is not None:
            contributions[share] = kept
            continue
        loss_sum = torch.zeros(1, device=accelerator.device)
        for p in params:  # a redone step (or the last hosted rank) leaves nothing behind
            p.grad = None
        # no reduction inside backward: the buckets would sum this rank's gradients alone
        with accelerator.no_sync(run.wrapped) if run.overlapped else nullcontext(), \
                cpu_threads(threads):
            for micro in range(t.grad_accum_steps):
                job.seed_step(step, micro, share=share)
                batch = to_device(run.sampler.batch(step, share, job.logical_world, micro),
                                  accelerator.device)
                with accelerator.autocast():
                    loss = run.model(**batch).loss
                loss_sum += loss.detach().float()
                accelerator.backward(loss)  # loss / grad_accum_steps, as in the usual step
        contributions[share] = job.flat_grads(params, extra=loss_sum, keep=(step, share))
    return job.reduce_logical(params, contributions,
                              exact=run.cfg.checkpointless.shrink == "exact")


def _fsdp_step(run, step: int) -> torch.Tensor:
    """Micro-batch by micro-batch, each hosted logical rank's forward and backward; the last
    one's reduce-scatter sums the micro-batch over the logical ranks in logical order
    (fsdp_logical.py). The loss summed the same way."""
    job, accelerator, t, lf = run.job, run.accelerator, run.cfg.trainer, run.logical_fsdp
    hosted = job.logical_ranks
    losses = {share: torch.zeros(1, device=accelerator.device) for share in hosted}
    # under hsdp with replica groups this generation, each chunk's sum goes to its twins
    lf.begin_step(job.placement, job.shrunk, job.mesh_group("dp_replicate"))
    for micro in range(t.grad_accum_steps):
        for i, share in enumerate(hosted):
            lf.begin_pass(share, last_share=i == len(hosted) - 1)
            job.seed_step(step, micro, share=share)
            batch = to_device(run.sampler.batch(step, share, job.logical_world, micro),
                              accelerator.device)
            with accelerator.autocast():
                loss = run.model(**batch).loss
            losses[share] += loss.detach().float()
            accelerator.backward(loss)  # loss / grad_accum_steps, as in the usual step
    lf.end_step()
    return logical_all_reduce(losses, job.placement)


def install(run) -> None:
    """Under fsdp or hsdp with shrink=exact: the logical reduce-scatter on the model, and the
    rebuild a shrink or grow calls (launcher/rebuild.py)."""
    if run.cfg.distributed.strategy not in SHARDED or run.cfg.checkpointless.shrink != "exact":
        return
    from checkpointless.worker import LogicalFSDP

    from .rebuild import rebuild
    run.logical_fsdp = LogicalFSDP(run.model, run.job.logical_world)
    run.job.protect(rebuild=lambda: rebuild(run))


def eval_share(cfg, job) -> tuple[int, int]:
    """(share, shares) of the validation rows this process computes: by process where the job
    may shrink (each row is summed once, whoever computes it), else by data-parallel rank."""
    if cfg.checkpointless.shrink != "off" and cfg.distributed.strategy in ("ddp", *SHARDED):
        return job.rank, job.world_size
    return job.data_rank, job.data_world
