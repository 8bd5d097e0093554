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

from checkpointless.worker import exact_clip_grad_norm_, logical_all_reduce

from launcher.recipe.schema import SHARDED
from launcher.train.model_setup import cpu_threads
from launcher.train.step import DataParallel, catch_up_threads


def shard_mesh_of(cfg, job):
    """The mesh the model is sharded over: the job's, except under hsdp with shrink=exact,
    where it is the shard group's alone (1-D): the logical reduce-scatter then hands each chunk
    to its twins itself (fsdp_logical.py), and FSDP2 adds no replica all-reduce of its own."""
    mesh = job.device_mesh()
    names = mesh.mesh_dim_names or ()
    if job.spec.shrink == "exact" and "dp_replicate" in names:
        return mesh["dp_shard"]
    return mesh


class Logical(DataParallel):
    """ddp by logical rank: each hosted logical rank's gradients kept apart, then summed over
    the logical world in one fixed order."""

    def gradients(self, run, step: int) -> torch.Tensor:
        """Forward and backward for each hosted logical rank, then the gradients averaged over
        the logical world (written into the `.grad`s); the step's loss summed over every logical
        rank. A redone step reuses the contributions this process computed before a peer's
        failure cut it short: only a rank new here (a replacement's, or one a shrink moved) is
        computed again."""
        job, accum = run.job, run.cfg.trainer.grad_accum_steps

        def compute(share: int) -> torch.Tensor:
            loss_sum = torch.zeros(1, device=run.accelerator.device)
            # no reduction inside backward: the buckets would sum this rank's gradients alone
            with run.accelerator.no_sync(run.wrapped) if run.overlapped else nullcontext(), \
                    cpu_threads(catch_up_threads(run)):
                for micro in range(accum):
                    run.micro(run.model, step, share, job.logical_world, micro, loss_sum)
            return loss_sum
        return job.reduce_by_logical_rank(run.model.parameters(), step, compute,
                                          exact=job.spec.shrink == "exact")


class LogicalSharded(DataParallel):
    """fsdp / hsdp by logical rank: FSDP2's reduce-scatter is the logical one
    (checkpointless/worker/fsdp_logical.py)."""

    def gradients(self, run, step: int) -> torch.Tensor:
        """Micro-batch by micro-batch, each hosted logical rank's forward and backward; the last
        one's reduce-scatter sums the micro-batch over the logical ranks in logical order. The
        loss summed the same way."""
        job, lf = run.job, run.logical_fsdp
        hosted = job.logical_ranks
        losses = {share: torch.zeros(1, device=run.accelerator.device) for share in hosted}
        # under hsdp with replica groups this generation, each chunk's sum goes to its twins
        lf.begin_step(job.placement, job.shrunk, job.mesh_group("dp_replicate"))
        for micro in range(run.cfg.trainer.grad_accum_steps):
            for i, share in enumerate(hosted):
                lf.begin_pass(share, last_share=i == len(hosted) - 1)
                run.micro(run.model, step, share, job.logical_world, micro, losses[share])
        lf.end_step()
        return logical_all_reduce(losses, job.placement)

    def clip(self, run, max_norm: float):
        """The norm of each gradient gathered whole: the same for any number of processes."""
        return exact_clip_grad_norm_(run.model.parameters(), max_norm)


def install(run) -> None:
    """Under fsdp or hsdp with shrink=exact: the logical reduce-scatter on the model, and the
    rebuild a shrink or grow calls (launcher/train/rebuild.py)."""
    if run.cfg.distributed.strategy not in SHARDED or run.job.spec.shrink != "exact":
        return
    from checkpointless.worker import LogicalFSDP

    from launcher.train.rebuild import rebuild
    run.logical_fsdp = LogicalFSDP(run.model, run.job.logical_world)
    run.job.protect(rebuild=lambda: rebuild(run))


def eval_share(cfg, job) -> tuple[int, int]:
    """(share, shares) of the validation rows this process computes: by process where the job
    may shrink (each row is summed once, whoever computes it), else by data-parallel rank."""
    if job.spec.shrink != "off" and cfg.distributed.strategy in ("ddp", *SHARDED):
        return job.rank, job.world_size
    return job.data_rank, job.data_world
