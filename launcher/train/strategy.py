"""The step's strategy, chosen once per generation from the job's layout; the loop then runs
one straight path (loop.py train_step) whatever the parallelism.

Every strategy answers one call, `gradients_and_norm(run, step, max_norm)`: the step's
micro-batches forward and backward (micro.py, the one routine), the gradients averaged over
the data-parallel ranks and clipped to `max_norm`; it returns the step's loss summed over the
ranks and the gradients' norm. Which strategy:

    DataParallel     ddp: checkpointless DDP's fixed-order buckets during backward, or one
                     fixed-order all-reduce after it (distributed.grad_sync=flat)   (step.py)
    Sharded          fsdp / hsdp, tensor parallel composed: FSDP2's reduce-scatter  (step.py)
    Logical          ddp by logical rank (checkpointless.shrink=exact, or fast once shrunk)
    LogicalSharded   fsdp / hsdp by logical rank (shrink=exact)           (logical_step.py)
    Pipelined        pipeline stages over ddp or fsdp replicas            (pipeline.py)
"""
from __future__ import annotations

import checkpointless

from launcher.parallel.pipeline_split import layer_counts
from launcher.recipe.schema import SHARDED
from launcher.train import export, pipeline_export
from launcher.train.logical_step import Logical, LogicalSharded, shard_mesh_of
from launcher.train.model_setup import hand_over_init, shard
from launcher.train.pipeline import Pipeline, Pipelined
from launcher.train.step import DataParallel, Sharded


def place_model(cfg, job, model):
    """(model, wrapped, pipe): this rank's part of the model (its stage's under pp_size > 1),
    sharded (fsdp, hsdp; here, not by accelerate's plugin: train/accelerator.py start_line), or
    wrapped in checkpointless DDP's buckets; `wrapped` is what the forward runs through."""
    d, pipe = cfg.distributed, None
    if d.pp_size > 1:  # this rank keeps its stage's part of the model (pipeline.py)
        pipe = Pipeline(cfg, model, job, layer_counts(cfg, model.config))
        hand_over_init(model, pipe.part)
        model = pipe.part
    if d.strategy in SHARDED:
        shard(model, cfg, shard_mesh_of(cfg, job), receives_state=not job.builds_own_state,
              roots=pipe.views if pipe else None)
        return model, model, pipe
    if d.grad_sync == "buckets" and not pipe and job.spec.shrink != "exact":
        # averaged in fixed buckets during backward (under shrink=exact: by logical rank)
        return model, checkpointless.DistributedDataParallel(
            model, bucket_cap_mb=d.bucket_cap_mb), pipe
    return model, model, pipe  # flat: one fixed-order all-reduce after the whole backward


def digest_and_export(run, export_to):
    """The full state's digest on every rank, and the Hugging Face folder written one tensor
    gathered at a time, each file by its own rank (a pipeline's by stage)."""
    d, job = run.cfg.distributed, run.job
    if run.pipe is not None:
        return pipeline_export.digest_and_export(run.model, d.strategy, run.tokenizer, export_to,
                                                 job.rank, job.world_size, d.pp_size)
    return export.digest_and_export(run.model, d.strategy, run.tokenizer, export_to, job.rank,
                                    job.world_size)


def choose(cfg, job, pipelined: bool):
    """This generation's strategy: the same answer on every process of the job."""
    # checkpointless.shrink as the supervisor has it: the job's Spec, from the store
    d, shrink = cfg.distributed, job.spec.shrink
    if pipelined:
        return Pipelined()
    if d.strategy in SHARDED:
        return LogicalSharded() if shrink == "exact" else Sharded()
    if shrink == "exact" or (shrink == "fast" and job.shrunk):
        return Logical()
    return DataParallel()
