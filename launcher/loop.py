"""The training loop each worker runs (a spare runs it too, and waits in `join()`).

    python -m launcher.loop RUN_DIR/recipe.yaml      (started by `python -m launcher train`)

One readable loop on the public checkpointless API and accelerate's Accelerator: build
everything (imports, tokenizer, model, data cache) *before* joining, so a spare is warm; join;
build the Accelerator (launcher/accelerator.py: it reads the rank join gave); shard (fsdp) and
build the optimizer; then step. The Accelerator gives the device, autocast for trainer.precision,
the loss scaling of gradient accumulation, the fp16 GradScaler (GPU), gradient clipping,
main-process printing and the trackers, and on a GPU backend the FSDP2 sharding. Gradients of a
ddp run are averaged in fixed-order buckets overlapped with backward
(checkpointless.DistributedDataParallel) or, with distributed.grad_sync=flat, in one fixed-order
all-reduce after it (checkpointless.worker.grads); either keeps a recovered run bit-identical to an
uninterrupted one. fsdp reduce-scatters through FSDP2.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import checkpointless
from checkpointless.worker import exact_clip_grad_norm_, full_tensor, local_tensor

from .audit_replay import LoopReplay
from .checkpoints import durable_checkpoints
from .data import to_device
from .evaluate import evaluate
from .hosted import eval_share, install, logical_step, shard_mesh_of, takes_logical_step
from .export import digest_and_export, export_lora
from .memory import held
from .metrics import Metrics
from .model_setup import (build, build_eval, cpu_threads, full_state, hand_over_init, setup,
                          shard, warm_up)
from . import pipeline_export
from .pipeline import Pipeline, ViewSet, layer_counts
from .schema import SHARDED, Recipe
from .tensor_parallel import clip_grad_norm_

__all__ = ["main", "lr_at", "build_optimizer", "Metrics"]


def lr_at(step: int, cfg) -> float:
    """Linear warm-up then cosine decay to lr * min_lr_ratio: a pure function of the step."""
    o, total = cfg.optim, cfg.trainer.max_steps
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    progress = (step - o.warmup_steps) / max(1, total - o.warmup_steps)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def build_optimizer(model, cfg):
    """AdamW, with weight decay on matrices only (not on norms, biases)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    o = cfg.optim
    return torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)


@dataclass
class Run:
    """Everything the loop holds once this worker has a rank."""
    cfg: object
    out_dir: Path
    job: object
    accelerator: object
    model: torch.nn.Module
    wrapped: torch.nn.Module  # what the forward runs through (checkpointless DDP under ddp)
    optimizer: torch.optim.Optimizer
    opt: object  # accelerate's wrapper around it (GradScaler under fp16)
    ckpt: object
    metrics: Metrics | None
    tokenizer: object
    sampler: object
    validate: object  # None, or a function returning the validation figures
    catch_up_threads: int
    overlapped: bool
    pipe: object = None  # pipeline.Pipeline under distributed.pp_size > 1
    logical_fsdp: object = None  # fsdp_logical.LogicalFSDP under fsdp with shrink=exact
    loss_value: float = float("nan")
    tokens: int = 0
    last_eval: dict | None = None


def _import_trackers(cfg) -> None:
    import importlib
    importlib.import_module(".accelerator", __package__)
    if cfg.logging.trackers:
        importlib.import_module("accelerate.tracking")
        for name, module in (("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb"),
                             ("mlflow", "mlflow")):
            if name in cfg.logging.trackers:
                importlib.import_module(module)


def preload(args) -> None:
    """What a fork server (checkpointless/control/forkserver.py) imports once for the workers it forks:
    the loop's libraries and the recipe's model classes; no torch operation runs here."""
    import importlib
    import importlib.util
    import datasets  # noqa: F401
    import transformers
    from .model_setup import build  # noqa: F401
    cfg = OmegaConf.merge(OmegaConf.structured(Recipe), OmegaConf.load(args[0]))
    _import_trackers(cfg)  # accelerate, and the trackers the recipe names
    model_type = cfg.model.name.replace("-", "_")
    for name in (f"transformers.models.{model_type}.modeling_{model_type}",
                 "peft" if cfg.peft.method != "none" else None):
        if name and importlib.util.find_spec(name.split(".", 1)[0]):
            try:
                importlib.import_module(name)
            except ImportError:  # a model_type transformers names otherwise: built by name later
                pass
    transformers.AutoModelForCausalLM  # noqa: B018  (its lazy module, loaded)


def warm(cfg):
    """Everything a worker needs before it holds a rank: a spare is warm when it takes one."""
    _, device = setup(cfg)
    tokenizer, model, sampler = build(cfg, device)
    evalset = build_eval(cfg, tokenizer)
    # accelerate imported while warm; so are the trackers a replacement rank 0 opens at once
    _import_trackers(cfg)
    catch_up_threads = torch.get_num_threads()
    if checkpointless.started_as_spare() and cfg.distributed.strategy == "ddp":
        catch_up_threads = warm_up(model, sampler, cfg, device)
    return tokenizer, model, sampler, evalset, device, catch_up_threads


def join(cfg, out_dir: Path) -> Run:
    """Join (a spare blocks here until it is handed a failed rank), then build what needs the
    rank: the Accelerator, the sharding or gradient wrapper, the optimizer, the protected state,
    the checkpoints and the metrics."""
    from .accelerator import Autocast, build_accelerator, start_line
    d, t = cfg.distributed, cfg.trainer
    tokenizer, model, sampler, evalset, device, catch_up_threads = warm(cfg)
    # a spare replays sampled ranks' steps while it waits, when audits are on (audit_replay.py)
    replay = LoopReplay(cfg, model, sampler, device) if cfg.checkpointless.audit.every else None
    job = checkpointless.join(seed=cfg.run.seed, replay=replay)
    if job.logical_world != d.num_processes or dist.get_world_size() != job.world_size:
        raise RuntimeError(f"torch.distributed reports world size {dist.get_world_size()} "
                           f"(logical {job.logical_world}) but distributed.num_processes="
                           f"{d.num_processes}: refusing to train a silently different job")
    # built after join: accelerate reads this worker's rank once, and a spare has none before
    accelerator = build_accelerator(cfg, job, device)
    pipe = None
    if d.pp_size > 1:  # this rank keeps its stage's part of the model (pipeline.py)
        pipe = Pipeline(cfg, model, job, layer_counts(cfg, model.config))
        hand_over_init(model, pipe.part)
        model = pipe.part
    if d.strategy in SHARDED:  # sharded here, not by accelerate's plugin (see start_line)
        shard(model, cfg, shard_mesh_of(cfg, job), receives_state=not job.builds_own_state,
              roots=pipe.views if pipe else None)
        wrapped = model
    elif d.grad_sync == "buckets" and not pipe and cfg.checkpointless.shrink != "exact":
        # averaged in fixed buckets during backward (under shrink=exact: by logical rank)
        wrapped = checkpointless.DistributedDataParallel(model, bucket_cap_mb=d.bucket_cap_mb)
    else:  # flat: one fixed-order all-reduce of every gradient after the whole backward
        wrapped = model
    # the model is not given to accelerate: under ddp it would wrap it in torch's DDP; the
    # optimizer is (accelerate's wrapper steps it through the GradScaler under fp16)
    opt = accelerator.prepare_optimizer(optimizer := build_optimizer(model, cfg))
    # under LoRA a replacement rebuilds the frozen base as every worker did: only the adapters
    # and their optimizer state are sent. Under fp16 the GradScaler's scale travels too: a
    # replacement must scale its loss as the survivors do
    scaler = {"grad_scaler": accelerator.scaler} if accelerator.scaler is not None else {}
    views = {"stage_views": ViewSet(pipe.views)} if pipe else {}  # their FSDP handles follow
    job.protect(model=wrapped, optimizer=optimizer, send_frozen=cfg.peft.method == "none",
                **scaler, **views)
    ckpt = durable_checkpoints(cfg, job, model, optimizer, accelerator.scaler)
    if not job.is_replacement:
        accelerator.print(start_line(cfg, accelerator), flush=True)
        if pipe:  # which layers each stage holds (by parameter count, or distributed.pp_layers)
            accelerator.print(f"[launcher] pipeline split: {pipe.split}", flush=True)
    metrics = (Metrics(cfg, out_dir, job.completed_steps, accelerator, job.is_replacement)
               if accelerator.is_main_process else None)
    device = accelerator.device
    # a tp group's ranks evaluate the same rows together; its first rank's figures count
    validate = (lambda: evaluate(run.model, *evalset, *eval_share(cfg, job),
                                 t.micro_batch_size, device, Autocast(accelerator),
                                 adds=job.rank % d.tp_size == 0)) if evalset else None
    run = Run(cfg, out_dir, job, accelerator, model, wrapped, optimizer, opt, ckpt, metrics,
              tokenizer, sampler, validate, catch_up_threads,
              overlapped=isinstance(wrapped, checkpointless.DistributedDataParallel), pipe=pipe)
    install(run)  # fsdp under shrink=exact: the logical reduce-scatter, the rebuild (hosted.py)
    return run


def forward_backward(run: Run, step: int) -> torch.Tensor:
    """The step's micro-batches, forward and backward; their summed loss (on this rank)."""
    cfg, job, accelerator, wrapped = run.cfg, run.job, run.accelerator, run.wrapped
    t = cfg.trainer
    if run.pipe:  # the schedule runs the microbatches through the stages
        return run.pipe.forward_backward(run, step)
    loss_sum = torch.zeros(1, device=accelerator.device)
    # a survivor redoing a step cut short by a peer's failure still holds its gradients;
    # the replacement they all wait on may use their idle cores (same bits, verified)
    with cpu_threads(run.catch_up_threads // job.catching_up if job.catching_up else None):
        for micro in range(0 if job.grads_kept else t.grad_accum_steps):
            job.seed_step(step, micro)
            batch = to_device(run.sampler.batch(step, job.data_rank, job.data_world, micro),
                              accelerator.device)
            last = micro == t.grad_accum_steps - 1
            # fsdp reduce-scatters every micro-batch into the sharded gradients (FSDP2
            # modules have no no_sync): turning sync off until the last would keep
            # whole-model unsharded gradients.
            # earlier micro-batches accumulate locally, the last backward reduces them
            # all (accelerate's no_sync: our buckets' own switch under ddp). The last one
            # is known by its index: accelerate's accumulate() would count micro-batches
            # in the Accelerator, and a redone step or a replacement's first step would
            # find that count mid-step
            with nullcontext() if last else accelerator.no_sync(wrapped):
                with accelerator.autocast():
                    loss = wrapped(**batch).loss
                loss_sum += loss.detach().float()
                if run.overlapped and last:  # summed with the last gradient bucket
                    wrapped.reduce_with(loss_sum)
                # loss / grad_accum_steps, through the GradScaler under fp16
                accelerator.backward(loss)
    return loss_sum


def train_step(run: Run, step: int):
    """One step's body: validation when due, the learning rate, forward and backward, the
    gradients averaged and clipped, the update, a checkpoint when due."""
    cfg, job, accelerator, model = run.cfg, run.job, run.accelerator, run.model
    # validation after `step` steps, inside the step: a failure in it is recovered and
    # the step redone, and a replacement starting at this step validates too
    pending = (run.validate() if run.validate and step and step % cfg.eval.every == 0
               else None)
    lr = lr_at(step, cfg)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    if step == 0 and run.ckpt and cfg.checkpointless.audit.every:
        # the launch's state on disk: a rank found computing wrong before any audit of it
        # passed is undone by going back here (audit.rewind_bound)
        run.ckpt.save(0)
    logical = takes_logical_step(run)  # by logical rank: shrink=exact, or a shrunk job
    loss_sum = logical_step(run, step) if logical else forward_backward(run, step)
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    if logical:  # averaged over the logical world already
        loss_total = loss_sum
    elif run.pipe:  # averaged over the stage's replicas; loss and norm over the whole pipeline
        if cfg.distributed.strategy == "ddp":
            job.all_reduce_grads(model.parameters())
        loss_total, grad_norm = run.pipe.loss_and_clip(model.parameters(), loss_sum, clip)
    elif cfg.distributed.strategy == "ddp":
        loss_total = job.all_reduce_grads(model.parameters(), extra=loss_sum)
    else:  # FSDP already averaged the gradients; the loss needs its own collective
        loss_total = loss_sum.clone()
        dist.all_reduce(loss_total)
    # unscaled first under fp16; torch's clip_grad_norm_ otherwise (the same bits); under
    # tensor parallel over gradients on two meshes (tensor_parallel.py)
    if run.logical_fsdp:  # the norm of each gradient gathered whole: the same for any P
        grad_norm = exact_clip_grad_norm_(model.parameters(), clip)
    elif not run.pipe:
        grad_norm = clip_grad_norm_(model.parameters(), clip) if cfg.distributed.tp_size > 1 \
            else accelerator.clip_grad_norm_(model.parameters(), clip)
        grad_norm = full_tensor(grad_norm)
    run.opt.step()  # under fp16 the GradScaler skips an update with inf/nan gradients
    run.opt.zero_grad(set_to_none=True)
    if run.ckpt and (step + 1) % cfg.checkpoint.interval == 0:
        # inside the step: planned with the peers on this generation's group (a peer's
        # failure here is recovered like any in the step); each rank's files are then
        # written by a thread while training goes on
        run.ckpt.save(step + 1)
    return loss_total, grad_norm, lr, pending


def train(run: Run) -> None:
    """The loop: each step committed, or redone after a recovery; figures for committed ones."""
    job, t, metrics = run.job, run.cfg.trainer, run.metrics
    for step in job.steps(t.max_steps):
        loss_total = None
        with job.step():
            loss_total, grad_norm, lr, pending = train_step(run, step)
        # committed (not rolled into a recovery); a recovery may also have brought this rank
        # the state after `step` from its peers (a member behind them): nothing of its own
        if loss_total is not None and job.completed_steps == step + 1:
            # every rank's loss counted (a tp group's alike); under pp the last stage's
            run.loss_value = loss_total.item() / (
                job.logical_world // run.cfg.distributed.pp_size * t.grad_accum_steps)
            run.tokens = job.completed_steps * (t.micro_batch_size * t.grad_accum_steps *
                                                run.cfg.distributed.pp_size *
                                                run.cfg.data.seq_len * job.data_world)
            if metrics is None and job.rank == 0:  # a shrink made this survivor process 0
                metrics = run.metrics = Metrics(run.cfg, run.out_dir, step, None, True)
            if metrics:
                metrics.step(step, run.loss_value, lr, float(grad_norm), job.step_started_at,
                             time.time())
                if metrics.trackers:
                    metrics.trackers.recovery(job, step)
            if pending:
                run.last_eval = dict(pending, eval_after_steps=step)
                if metrics:
                    metrics.record(run.last_eval)


def stop_early(run: Run) -> None:
    """Stopped early (SIGTERM, SIGINT): every rank at the same boundary; a checkpoint to resume."""
    job, ckpt, cfg = run.job, run.ckpt, run.cfg
    if ckpt and job.completed_steps % cfg.checkpoint.interval:  # not just written
        job.between_steps(lambda: ckpt.save(job.completed_steps))
    if run.accelerator.is_main_process:
        run.accelerator.print(
            f"[launcher] preempted: stopped after step {job.completed_steps - 1}" +
            (", checkpoint written; resume with checkpoint.resume=auto" if ckpt else
             " (checkpoint.interval=0: no durable checkpoint to resume from)"), flush=True)


def finish_run(run: Run) -> None:
    """The end: validation; the digest of the full state on every rank and the sharded export,
    one tensor gathered at a time, each file written by its own rank; the results."""
    cfg, job, model, metrics, out_dir = run.cfg, run.job, run.model, run.metrics, run.out_dir
    d, t = cfg.distributed, cfg.trainer
    # what this rank's memory held, read before the end-of-run digest and export (report.json)
    memory = held(model, run.optimizer, job.replica_host_bytes(), job.replica_host_bytes("own"))
    if run.validate and not job.preempted:  # collectives after the loop: recovered too
        run.last_eval = dict(job.between_steps(run.validate), eval_after_steps=job.completed_steps)
        if metrics:
            metrics.record(run.last_eval)
    lora = cfg.peft.method == "lora"
    # an unfinished (preempted) model is not exported: the checkpoint holds it
    export_to = out_dir / "model" if t.save_model and not job.preempted and not lora else None
    digest, full_params = job.between_steps(lambda: digest_and_export(
        model, d.strategy, run.tokenizer, export_to, job.rank, job.world_size) if not run.pipe
        else pipeline_export.digest_and_export(model, d.strategy, run.tokenizer, export_to,
                                               job.rank, job.world_size, d.pp_size))
    if lora and t.save_model and not job.preempted:  # adapters are small; the base goes to
        state = job.between_steps(lambda: full_state(model, d.strategy))  # rank 0's host
        if job.rank == 0:
            export_lora(cfg, model, state, run.tokenizer, out_dir)
    if run.ckpt:
        run.ckpt.close()  # the last write overlapped the export; it is on disk before we finish
    if metrics:
        metrics.close()
    local = sum(local_tensor(p).numel() for p in model.parameters())
    write_results(run, digest, local, full_params)
    job.finish({"params_sha256": digest, "local_params": local,
                "full_params": full_params, "final_loss": run.loss_value,
                "tokens": run.tokens, "eval": run.last_eval,
                "steps": job.completed_steps, "worker_id": job.worker_id, "pid": os.getpid(),
                "memory": memory})


def write_results(run: Run, digest: str, local: int, full_params: int) -> None:
    """results/rank{R}.json: this rank's digest, figures and how accelerate ran it."""
    job, accelerator = run.job, run.accelerator
    result = {"params_sha256": digest, "local_params": local, "rank": job.rank,
              "accelerator": {"device": str(accelerator.device),
                              "mixed_precision": accelerator.mixed_precision,
                              "grad_scaler": accelerator.scaler is not None,
                              "gradient_accumulation_steps":
                                  accelerator.gradient_accumulation_steps,
                              "distributed_type": str(accelerator.distributed_type),
                              "torch_threads": torch.get_num_threads()},
              # what redundancy holds in host memory: peers' copies and this rank's snapshots
              "replica_host_bytes": job.replica_host_bytes("all"),
              "replica_timing": job.replica_timing(),
              "full_params": full_params,
              "final_loss": run.loss_value, "steps": job.completed_steps, "eval": run.last_eval}
    (run.out_dir / "results").mkdir(exist_ok=True)
    (run.out_dir / "results" / f"rank{job.rank}.json").write_text(json.dumps(result))


def main(recipe_file: str) -> None:
    cfg = OmegaConf.merge(OmegaConf.structured(Recipe), OmegaConf.load(recipe_file))
    run = join(cfg, Path(recipe_file).parent)
    train(run)
    if run.job.preempted:
        stop_early(run)
    finish_run(run)


if __name__ == "__main__":
    main(sys.argv[1])
