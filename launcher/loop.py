"""The training loop each worker runs (a spare runs it too, and waits in `join()`).

    python -m launcher.loop RUN_DIR/recipe.yaml      (started by `python -m launcher train`)

One readable loop on the public checkpointless API, the same one a custom PyTorch loop uses:
build everything (imports, tokenizer, model, data cache) *before* joining, so a spare is warm;
join; shard (fsdp) and build the optimizer; then step. Gradients of a ddp run are averaged in
fixed-order buckets overlapped with backward (checkpointless.DistributedDataParallel) or, with
distributed.grad_sync=flat, in one fixed-order all-reduce after it (checkpointless.grads); either
keeps a recovered run bit-identical to an uninterrupted one. fsdp reduce-scatters through FSDP2.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import checkpointless
from checkpointless.digest import state_sha256

from .checkpoints import durable_checkpoints
from .data import to_device
from .evaluate import evaluate
from .export import export, export_lora
from .model_setup import build, build_eval, cpu_threads, full_state, setup, shard, warm_up
from .schema import Recipe

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


class Metrics:
    """metrics.jsonl lines and the progress bar, written by rank 0 only."""

    def __init__(self, cfg, out_dir: Path, start_step: int):
        self.cfg = cfg
        self.file = open(out_dir / "metrics.jsonl", "a")
        self.bar = None
        if cfg.trainer.progress_bar:
            from tqdm import tqdm
            self.bar = tqdm(total=cfg.trainer.max_steps, initial=start_step, unit="step",
                            dynamic_ncols=True, mininterval=1.0, file=sys.stdout)
        self.tokens_per_step = (cfg.trainer.micro_batch_size * cfg.trainer.grad_accum_steps *
                                cfg.data.seq_len * cfg.distributed.num_processes)
        self.window_t, self.window_steps = time.time(), 0
        self.trackers = None
        if cfg.logging.trackers:
            from .trackers import Trackers
            self.trackers = Trackers(cfg)

    def step(self, step: int, loss: float, lr: float, grad_norm: float, t0: float, t1: float):
        self.window_steps += 1
        rec = {"step": step, "loss": round(loss, 6), "lr": lr, "grad_norm": round(grad_norm, 6),
               "t_start": round(t0, 6), "t_end": round(t1, 6)}
        if step % self.cfg.trainer.log_every == 0 or step == self.cfg.trainer.max_steps - 1:
            elapsed = time.time() - self.window_t
            rec["tokens_per_s"] = round(self.window_steps * self.tokens_per_step / elapsed, 1)
            self.window_t, self.window_steps = time.time(), 0
            if self.bar is None:
                print(f"step {step} loss {loss:.4f} lr {lr:.2e} "
                      f"tok/s {rec['tokens_per_s']:.0f}", flush=True)
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.trackers:
            self.trackers.log({k: rec[k] for k in ("loss", "lr", "grad_norm", "tokens_per_s")
                               if k in rec}, step)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{self.tokens_per_step / (t1 - t0):.0f}",
                                 refresh=False)

    def record(self, rec: dict) -> None:
        """A line that is not a step's (a validation result)."""
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.trackers:
            self.trackers.log({k: v for k, v in rec.items() if k != "eval_after_steps"},
                              rec["eval_after_steps"])
        line = (f"validation after {rec['eval_after_steps']} steps: loss {rec['eval_loss']:.4f}, "
                f"perplexity {rec['eval_ppl']:.2f} ({rec['eval_tokens']} tokens)")
        if self.bar is None:
            print(line, flush=True)
        else:
            self.bar.write(line)

    def close(self):
        if self.trackers:
            self.trackers.finish()
        if self.bar is not None:
            self.bar.close()
        self.file.close()


def main(recipe_file: str) -> None:
    cfg = OmegaConf.merge(OmegaConf.structured(Recipe), OmegaConf.load(recipe_file))
    out_dir = Path(recipe_file).parent
    d, t = cfg.distributed, cfg.trainer
    _, device = setup(cfg)

    # --- warm-up: everything a worker needs before it holds a rank ---------------------------
    tokenizer, model, sampler = build(cfg, device)
    evalset = build_eval(cfg, tokenizer)
    if cfg.logging.trackers:  # imported while warm: a replacement rank 0 opens them at once
        import importlib
        importlib.import_module("accelerate.tracking")
        if "tensorboard" in cfg.logging.trackers:
            importlib.import_module("torch.utils.tensorboard")

    catch_up_threads = torch.get_num_threads()
    if checkpointless.started_as_spare() and d.strategy == "ddp":
        catch_up_threads = warm_up(model, sampler, cfg, device)

    # --- join: a spare blocks here until it is handed a failed rank -------------------------
    job = checkpointless.join(seed=cfg.run.seed)
    if dist.get_world_size() != d.num_processes:
        raise RuntimeError(f"torch.distributed reports world size {dist.get_world_size()} but "
                           f"distributed.num_processes={d.num_processes}: refusing to train a "
                           "silently different job")
    if d.strategy == "fsdp":
        shard(model, cfg)
        wrapped = model
    elif d.grad_sync == "buckets":  # averaged in fixed buckets during backward (no collective here)
        wrapped = checkpointless.DistributedDataParallel(model, bucket_cap_mb=d.bucket_cap_mb)
    else:  # flat: one fixed-order all-reduce of every gradient after the whole backward
        wrapped = model
    overlapped = d.strategy == "ddp" and d.grad_sync == "buckets"
    optimizer = build_optimizer(model, cfg)
    # under LoRA a replacement rebuilds the frozen base as every worker did: only the adapters
    # and their optimizer state are sent
    job.protect(model=wrapped, optimizer=optimizer, send_frozen=cfg.peft.method == "none")
    ckpt = durable_checkpoints(cfg, job, model, optimizer)
    metrics = Metrics(cfg, out_dir, job.completed_steps) if job.rank == 0 else None
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.precision == "bf16")
    tokens = 0
    loss_value = float("nan")
    validate = (lambda: evaluate(model, *evalset, job.rank, job.world_size, t.micro_batch_size,
                                 device, autocast)) if evalset else None
    last_eval = None

    for step in job.steps(t.max_steps):
        with job.step():
            # validation after `step` steps, inside the step: a failure in it is recovered and
            # the step redone, and a replacement starting at this step validates too
            pending = validate() if validate and step and step % cfg.eval.every == 0 else None
            lr = lr_at(step, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros(1, device=device)
            # a survivor redoing a step cut short by a peer's failure still holds its gradients;
            # the replacement they all wait on may use their idle cores (same bits, verified)
            with cpu_threads(catch_up_threads // job.catching_up if job.catching_up else None):
                for micro in range(0 if job.grads_kept else t.grad_accum_steps):
                    job.seed_step(step, micro)
                    batch = to_device(sampler.batch(step, job.rank, job.world_size, micro),
                                      device)
                    last = micro == t.grad_accum_steps - 1
                    if d.strategy == "fsdp" and t.grad_accum_steps > 1:
                        model.set_requires_gradient_sync(last)
                    with autocast:
                        loss = wrapped(**batch).loss
                    loss_sum += loss.detach().float()
                    if overlapped and last:  # summed with the last gradient bucket
                        wrapped.reduce_with(loss_sum)
                    # buckets: earlier micro-batches accumulate; the last backward reduces them all
                    with wrapped.no_sync() if overlapped and not last else nullcontext():
                        (loss / t.grad_accum_steps).backward()
            if d.strategy == "ddp":
                loss_total = job.all_reduce_grads(model.parameters(), extra=loss_sum)
            else:  # FSDP already averaged the gradients; the loss needs its own collective
                loss_total = loss_sum.clone()
                dist.all_reduce(loss_total)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf"))
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if ckpt and job.completed_steps == step + 1 and (step + 1) % cfg.checkpoint.interval == 0:
            ckpt.save(step + 1)
        if job.completed_steps == step + 1:  # committed (not rolled into a recovery)
            loss_value = loss_total.item() / (job.world_size * t.grad_accum_steps)
            tokens = job.completed_steps * (t.micro_batch_size * t.grad_accum_steps *
                                            cfg.data.seq_len * job.world_size)
            if metrics:
                metrics.step(step, loss_value, lr, float(grad_norm), job.step_started_at, time.time())
                if metrics.trackers:
                    metrics.trackers.recovery(job, step)
            if pending:
                last_eval = dict(pending, eval_after_steps=step)
                if metrics:
                    metrics.record(last_eval)

    if job.preempted:  # stopped early (SIGTERM, SIGINT): every rank at the same boundary
        if ckpt and job.completed_steps % cfg.checkpoint.interval:  # not just written
            job.between_steps(lambda: ckpt.save(job.completed_steps))
        if job.rank == 0:
            print(f"[launcher] preempted: stopped after step {job.completed_steps - 1}" +
                  (f", checkpoint written; resume with checkpoint.resume=auto" if ckpt else
                   " (checkpoint.interval=0: no durable checkpoint to resume from)"), flush=True)

    # --- the end: validation, digest of the full state on every rank, export on rank 0 -------
    if validate and not job.preempted:  # collectives after the loop: a failure here is recovered too
        last_eval = dict(job.between_steps(validate), eval_after_steps=job.completed_steps)
        if metrics:
            metrics.record(last_eval)
    if ckpt:
        ckpt.close()
    state = job.between_steps(lambda: full_state(model, d.strategy))
    digest = state_sha256(state)
    if job.rank == 0:
        if metrics:
            metrics.close()
        if job.preempted:
            pass  # an unfinished model is not exported; the checkpoint holds it
        elif t.save_model and cfg.peft.method == "lora":
            export_lora(cfg, model, state, tokenizer, out_dir)
        elif t.save_model:
            export(model, state, tokenizer, out_dir / "model")
    local = sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters())
    result = {"params_sha256": digest, "local_params": local, "rank": job.rank,
              "replica_host_bytes": getattr(job, "replica_host_bytes", lambda: None)(),
              "replica_timing": getattr(job, "replica_timing", lambda: None)(),
              "full_params": sum(v.numel() for v in state.values()),
              "final_loss": loss_value, "steps": job.completed_steps, "eval": last_eval}
    (out_dir / "results").mkdir(exist_ok=True)
    (out_dir / "results" / f"rank{job.rank}.json").write_text(json.dumps(result))
    job.finish({"params_sha256": digest, "local_params": local,
                "full_params": sum(v.numel() for v in state.values()), "final_loss": loss_value,
                "tokens": tokens, "eval": last_eval,
                "steps": job.completed_steps, "worker_id": job.worker_id, "pid": os.getpid()})


if __name__ == "__main__":
    main(sys.argv[1])
