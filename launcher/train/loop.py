"""The training loop each worker runs (a spare runs it too, and waits in `join()`).

    python -m launcher.train.loop RUN_DIR/recipe.yaml      (started by `python -m launcher train`)

One readable loop on the public checkpointless API and accelerate's Accelerator: build
everything (imports, tokenizer, model, data cache) *before* joining, so a spare is warm; join;
build the Accelerator (launcher/train/accelerator.py: it reads the rank join gave); shard (fsdp) and
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
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import checkpointless
from checkpointless import protocol
from checkpointless.worker import local_tensor

from launcher.recipe.schema import Recipe
from launcher.train.audit_replay import LoopReplay
from launcher.train.checkpoints import durable_checkpoints
from launcher.train.evaluate import evaluate
from launcher.train.export import export_lora
from launcher.train.logical_step import eval_share, install
from launcher.train.memory import held
from launcher.train.metrics import Metrics
from launcher.train.micro import MicroBatch
from launcher.train.model_setup import build, build_eval, full_state, setup, warm_up
from launcher.train.optim import build_optimizer, lr_at
from launcher.train.pipeline import ViewSet
from launcher.train.state_digest import state_digests
from launcher.train.strategy import choose, digest_and_export, place_model

__all__ = ["main", "Metrics"]


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
    micro: MicroBatch  # one micro-batch's forward and backward (micro.py)
    evaluate: object  # None, or a function returning the validation figures
    catch_up_threads: int
    overlapped: bool
    pipe: object = None  # pipeline.Pipeline under distributed.pp_size > 1
    logical_fsdp: object = None  # fsdp_logical.LogicalFSDP under fsdp with shrink=exact
    loss_value: float = float("nan")
    tokens: int = 0
    last_eval: dict | None = None
    replay_said: bool = False  # the replay check's verdict went to metrics.jsonl and trackers
    chosen: tuple = (None, None)  # (generation, the step strategy chosen for it)

    def strategy(self):
        """This generation's step strategy (strategy.py), chosen at its first step."""
        if self.chosen[0] != self.job.gen:
            self.chosen = (self.job.gen, choose(self.cfg, self.job, self.pipe is not None))
        return self.chosen[1]


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
    from launcher.train.model_setup import build  # noqa: F401
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
    from launcher.train.accelerator import Autocast, build_accelerator, start_line
    d, t = cfg.distributed, cfg.trainer
    tokenizer, model, sampler, evalset, device, catch_up_threads = warm(cfg)
    # a spare replays sampled ranks' steps while it waits, when audits are on (audit_replay.py)
    replay = LoopReplay(cfg, model, sampler, device)  # used if the job audits (its Spec says)
    # under the supervisor the worker's settings are the job's Spec, from the store (the
    # supervisor's own record); under torchrun, where none is written, the recipe's
    job = checkpointless.join(seed=cfg.run.seed, replay=replay, unsupervised=protocol.Spec(
        seed=cfg.run.seed, shrink=cfg.checkpointless.shrink))
    if job.logical_world != d.num_processes or dist.get_world_size() != job.world_size:
        raise RuntimeError(f"torch.distributed reports world size {dist.get_world_size()} "
                           f"(logical {job.logical_world}) but distributed.num_processes="
                           f"{d.num_processes}: refusing to train a silently different job")
    # built after join: accelerate reads this worker's rank once, and a spare has none before
    accelerator = build_accelerator(cfg, job, device)
    model, wrapped, pipe = place_model(cfg, job, model)
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
    evaluate_now = (lambda: evaluate(run.model, *evalset, *eval_share(cfg, job),
                                 t.micro_batch_size, device, Autocast(accelerator),
                                 adds=job.rank % d.tp_size == 0)) if evalset else None
    run = Run(cfg, out_dir, job, accelerator, model, wrapped, optimizer, opt, ckpt, metrics,
              tokenizer, MicroBatch.of_loop(job, accelerator, sampler), evaluate_now,
              catch_up_threads, overlapped=isinstance(wrapped, checkpointless.DistributedDataParallel),
              pipe=pipe)
    install(run)  # fsdp under shrink=exact: the logical reduce-scatter, the rebuild (logical_step.py)
    return run


def train_step(run: Run, step: int):
    """One step's body: validation when due, the learning rate, the step's strategy (forward
    and backward, the gradients averaged and clipped: strategy.py), the update, a checkpoint
    when due."""
    cfg = run.cfg
    # validation after `step` steps, inside the step: a failure in it is recovered and
    # the step redone, and a replacement starting at this step validates too
    pending = (run.evaluate() if run.evaluate and step and step % cfg.eval.every == 0
               else None)
    lr = lr_at(step, cfg)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    if step == 0 and run.ckpt and int(run.job.spec.audit_every):
        # the launch's state on disk: a rank found computing wrong before any audit of it
        # passed is undone by going back here (audit.rewind_bound)
        run.ckpt.save(0)
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    loss_total, grad_norm = run.strategy().gradients_and_norm(run, step, clip)
    run.opt.step()  # under fp16 the GradScaler skips an update with inf/nan gradients
    run.opt.zero_grad(set_to_none=True)
    if run.ckpt and (step + 1) % cfg.checkpoint.interval == 0 and not run.job.rehearsing:
        # (not in the replay rehearsal's first attempt: the step is run again at once)
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
                if job.replay and not run.replay_said:  # rank 0's, once the rehearsal ended
                    metrics.replay(job.replay, step)
                    run.replay_said = True
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
    if run.evaluate and not job.preempted:  # collectives after the loop: recovered too
        run.last_eval = dict(job.between_steps(run.evaluate), eval_after_steps=job.completed_steps)
        if metrics:
            metrics.record(run.last_eval)
    lora = cfg.peft.method == "lora"
    # an unfinished (preempted) model is not exported: the checkpoint holds it
    export_to = out_dir / "model" if t.save_model and not job.preempted and not lora else None
    digest, full_params = job.between_steps(lambda: digest_and_export(run, export_to))
    digests = state_digests(run, digest)  # optimizer, data position, random state beside it
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
    job.finish({"params_sha256": digest, "state_sha256": digests, "local_params": local,
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
