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
all-reduce after it (checkpointless.grads); either keeps a recovered run bit-identical to an
uninterrupted one. fsdp reduce-scatters through FSDP2.
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

from .checkpoints import durable_checkpoints
from .data import to_device
from .evaluate import evaluate
from .export import digest_and_export, export_lora
from .memory import held
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
    """metrics.jsonl lines and the progress bar, written by rank 0 only. Given the loop's
    Accelerator, lines are printed and figures logged to the trackers through it; without one
    (the torch-only baseline, launcher/bench/plain_loop.py) lines are printed, nothing tracked."""

    def __init__(self, cfg, out_dir: Path, start_step: int, accelerator=None):
        self.cfg = cfg
        self.print = accelerator.print if accelerator is not None else print
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
        if cfg.logging.trackers and accelerator is not None:
            from .trackers import Trackers
            self.trackers = Trackers(cfg, accelerator)

    def step(self, step: int, loss: float, lr: float, grad_norm: float, t0: float, t1: float):
        self.window_steps += 1
        rec = {"step": step, "loss": round(loss, 6), "lr": lr, "grad_norm": round(grad_norm, 6),
               "t_start": round(t0, 6), "t_end": round(t1, 6)}
        if step % self.cfg.trainer.log_every == 0 or step == self.cfg.trainer.max_steps - 1:
            elapsed = time.time() - self.window_t
            rec["tokens_per_s"] = round(self.window_steps * self.tokens_per_step / elapsed, 1)
            self.window_t, self.window_steps = time.time(), 0
            if self.bar is None:
                self.print(f"step {step} loss {loss:.4f} lr {lr:.2e} "
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
            self.print(line, flush=True)
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
    # accelerate imported while warm; so are the trackers a replacement rank 0 opens at once
    from .accelerator import Autocast, build_accelerator, start_line
    if cfg.logging.trackers:
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
    # built after join: accelerate reads this worker's rank once, and a spare has none before
    accelerator = build_accelerator(cfg, job, device)
    if d.strategy == "fsdp":  # sharded here, not by accelerate's plugin (see start_line)
        shard(model, cfg)
        wrapped = model
    elif d.grad_sync == "buckets":  # averaged in fixed buckets during backward
        wrapped = checkpointless.DistributedDataParallel(model, bucket_cap_mb=d.bucket_cap_mb)
    else:  # flat: one fixed-order all-reduce of every gradient after the whole backward
        wrapped = model
    # the model is not given to accelerate: under ddp it would wrap it in torch's DDP; the
    # optimizer is (accelerate's wrapper steps it through the GradScaler under fp16)
    opt = accelerator.prepare_optimizer(optimizer := build_optimizer(model, cfg))
    overlapped = d.strategy == "ddp" and d.grad_sync == "buckets"
    # under LoRA a replacement rebuilds the frozen base as every worker did: only the adapters
    # and their optimizer state are sent. Under fp16 the GradScaler's scale travels too: a
    # replacement must scale its loss as the survivors do
    scaler = {"grad_scaler": accelerator.scaler} if accelerator.scaler is not None else {}
    job.protect(model=wrapped, optimizer=optimizer, send_frozen=cfg.peft.method == "none",
                **scaler)
    ckpt = durable_checkpoints(cfg, job, model, optimizer, accelerator.scaler)
    if not job.is_replacement:
        accelerator.print(start_line(cfg, accelerator), flush=True)
    metrics = (Metrics(cfg, out_dir, job.completed_steps, accelerator)
               if accelerator.is_main_process else None)
    device = accelerator.device
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    tokens = 0
    loss_value = float("nan")
    validate = (lambda: evaluate(model, *evalset, job.rank, job.world_size, t.micro_batch_size,
                                 device, Autocast(accelerator))) if evalset else None
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
                        if overlapped and last:  # summed with the last gradient bucket
                            wrapped.reduce_with(loss_sum)
                        # loss / grad_accum_steps, through the GradScaler under fp16
                        accelerator.backward(loss)
            if d.strategy == "ddp":
                loss_total = job.all_reduce_grads(model.parameters(), extra=loss_sum)
            else:  # FSDP already averaged the gradients; the loss needs its own collective
                loss_total = loss_sum.clone()
                dist.all_reduce(loss_total)
            # unscaled first under fp16; torch's clip_grad_norm_ otherwise (the same bits)
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            opt.step()  # under fp16 the GradScaler skips an update with inf/nan gradients
            opt.zero_grad(set_to_none=True)
            if ckpt and (step + 1) % cfg.checkpoint.interval == 0:
                # inside the step: planned with the peers on this generation's group (a peer's
                # failure here is recovered like any in the step); each rank's files are then
                # written by a thread while training goes on
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
        if accelerator.is_main_process:
            accelerator.print(
                f"[launcher] preempted: stopped after step {job.completed_steps - 1}" +
                (", checkpoint written; resume with checkpoint.resume=auto" if ckpt else
                 " (checkpoint.interval=0: no durable checkpoint to resume from)"), flush=True)

    # what this rank's memory held, read before the end-of-run digest and export (report.json)
    memory = held(model, optimizer, job.replica_host_bytes())
    # --- the end: validation; the digest of the full state on every rank and the sharded export,
    # one tensor gathered at a time, each file written by its own rank ---------------------------
    if validate and not job.preempted:  # collectives after the loop: a failure here is recovered too
        last_eval = dict(job.between_steps(validate), eval_after_steps=job.completed_steps)
        if metrics:
            metrics.record(last_eval)
    lora = cfg.peft.method == "lora"
    # an unfinished (preempted) model is not exported: the checkpoint holds it
    export_to = out_dir / "model" if t.save_model and not job.preempted and not lora else None
    digest, full_params = job.between_steps(lambda: digest_and_export(
        model, d.strategy, tokenizer, export_to, job.rank, job.world_size))
    if lora and t.save_model and not job.preempted:  # adapters are small; the base goes to
        state = job.between_steps(lambda: full_state(model, d.strategy))  # rank 0's host
        if job.rank == 0:
            export_lora(cfg, model, state, tokenizer, out_dir)
    if ckpt:
        ckpt.close()  # the last write overlapped the export; it is on disk before we finish
    if metrics:
        metrics.close()
    local = sum(getattr(p, "_local_tensor", p).numel() for p in model.parameters())
    result = {"params_sha256": digest, "local_params": local, "rank": job.rank,
              "accelerator": {"device": str(accelerator.device),
                              "mixed_precision": accelerator.mixed_precision,
                              "grad_scaler": accelerator.scaler is not None,
                              "gradient_accumulation_steps":
                                  accelerator.gradient_accumulation_steps,
                              "distributed_type": str(accelerator.distributed_type),
                              "torch_threads": torch.get_num_threads()},
              "replica_host_bytes": job.replica_host_bytes(),
              "replica_timing": job.replica_timing(),
              "full_params": full_params,
              "final_loss": loss_value, "steps": job.completed_steps, "eval": last_eval}
    (out_dir / "results").mkdir(exist_ok=True)
    (out_dir / "results" / f"rank{job.rank}.json").write_text(json.dumps(result))
    job.finish({"params_sha256": digest, "local_params": local,
                "full_params": full_params, "final_loss": loss_value,
                "tokens": tokens, "eval": last_eval,
                "steps": job.completed_steps, "worker_id": job.worker_id, "pid": os.getpid(),
                "memory": memory})


if __name__ == "__main__":
    main(sys.argv[1])
