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
import warnings
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

import checkpointless
from checkpointless.digest import state_sha256

from .data import to_device
from .evaluate import evaluate
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


def shard(model, cfg):
    """FSDP2: each decoder block and then the root becomes a sharded unit."""
    from torch.distributed.fsdp import fully_shard

    from models.lora import base_of
    blocks = None
    for attr in ("model.layers", "transformer.h"):
        obj = base_of(model)  # under LoRA the decoder blocks are inside peft's wrapper
        try:
            for part in attr.split("."):
                obj = getattr(obj, part)
            blocks = obj
            break
        except AttributeError:
            continue
    for block in blocks or []:
        fully_shard(block)
    fully_shard(model)
    return model


def full_state(model, strategy: str) -> dict:
    """The whole model state on every rank (a collective under fsdp)."""
    if strategy == "fsdp":
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                              get_model_state_dict)
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=False))
    return model.state_dict()


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


def setup(cfg):
    """(backend, device) of this worker; the thread count of a CPU worker is set here."""
    d = cfg.distributed
    on_gpu = d.device != "cpu" and torch.cuda.is_available()
    backend = d.backend if d.backend != "auto" else ("nccl" if on_gpu else "gloo")
    if backend == "nccl":
        # the supervisor's device slot, or torchrun's local rank (the off and restart modes)
        slot = int(os.environ.get("CL_DEVICE_SLOT", os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", slot % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(d.threads_per_worker or
                              max(1, (os.cpu_count() or 1) // d.num_processes))
    return backend, device


def build(cfg, device):
    """Tokenizer, model (seeded, on `device`, in train mode) and the step sampler: everything a
    worker builds before it holds a rank."""
    import datasets
    import transformers
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()  # save_pretrained's, at the end
    # peft asks transformers a question transformers now words differently: not the user's concern
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    from models import build_model, build_tokenizer

    from .data import StepSampler, prepare

    tokenizer = build_tokenizer(cfg.tokenizer.kind, cfg.tokenizer.id or cfg.model.id,
                                cfg.tokenizer.chat_template)
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model.name, cfg.model.init, cfg.model.id,
                        OmegaConf.to_container(cfg.model.config), vocab_size=len(tokenizer),
                        token_ids={"eos_token_id": tokenizer.eos_token_id,
                                   "bos_token_id": tokenizer.bos_token_id,
                                   "pad_token_id": tokenizer.pad_token_id})
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if cfg.peft.method == "lora":  # adapters drawn from the same seeded RNG on every worker
        from models.lora import apply_lora
        if cfg.model.gradient_checkpointing:  # frozen inputs would give checkpointing no grads
            model.enable_input_require_grads()
        p = cfg.peft
        model = apply_lora(model, p.r, p.alpha, p.dropout, list(p.target_modules))
    model.to(device).train()
    t = cfg.trainer
    sampler = StepSampler(prepare(cfg, tokenizer), cfg.run.seed, t.micro_batch_size,
                          t.grad_accum_steps)
    return tokenizer, model, sampler


def build_eval(cfg, tokenizer):
    """(validation rows, the fixed row set) when eval.every > 0, else None; built before join."""
    if cfg.eval.every <= 0:
        return None
    from .data import eval_rows, prepare
    ds = prepare(cfg, tokenizer, part="eval")
    return ds, eval_rows(ds, cfg.eval.max_batches, cfg.trainer.micro_batch_size)


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
              "full_params": sum(v.numel() for v in state.values()),
              "final_loss": loss_value, "steps": job.completed_steps, "eval": last_eval}
    (out_dir / "results").mkdir(exist_ok=True)
    (out_dir / "results" / f"rank{job.rank}.json").write_text(json.dumps(result))
    job.finish({"params_sha256": digest, "local_params": local,
                "full_params": sum(v.numel() for v in state.values()), "final_loss": loss_value,
                "tokens": tokens, "eval": last_eval,
                "steps": job.completed_steps, "worker_id": job.worker_id, "pid": os.getpid()})


def warm_up(model, sampler, cfg, device) -> int:
    """Forward and backward off the books, in a spare before it waits; returns the CPU threads
    its catch-up step may use.

    A fresh process runs its first step about a quarter slower (kernels picked, allocator pools
    grown). After a failure the other ranks wait on the replacement's first step, so it should
    run at full speed. On CPU the waiting ranks' cores are idle during that step: the spare may
    use them all if, on two batches of the recipe's shape, the gradients come out bit for bit
    the same as with its usual thread count (kernels that split a sum by thread would not).
    Nothing is kept: gradients are dropped and the random state is restored.
    """
    base, wide = torch.get_num_threads(), len(os.sched_getaffinity(0))

    def grads(step: int, threads: int) -> torch.Tensor:
        with cpu_threads(threads), torch.random.fork_rng(devices=[]):
            torch.manual_seed(step)
            batch = to_device(sampler.batch(step, 0, cfg.distributed.num_processes, 0), device)
            with torch.autocast(device.type, dtype=torch.bfloat16,
                                enabled=cfg.trainer.precision == "bf16"):
                loss = model(**batch).loss
            loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        return flat

    if device.type != "cpu" or wide <= base:
        grads(0, base)
        return base
    same = all(torch.equal(grads(s, base), grads(s, wide)) for s in (0, 1))
    return wide if same else base


class cpu_threads:
    """Run a block with `n` torch CPU threads (None: unchanged), then restore the count."""

    def __init__(self, n):
        self.n = n

    def __enter__(self):
        self.before = torch.get_num_threads()
        if self.n and self.n != self.before:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        if torch.get_num_threads() != self.before:
            torch.set_num_threads(self.before)
        return False


class DurableCheckpoints:
    """Every `checkpoint.interval` steps the full state goes to disk (rank 0 writes, async)."""

    def __init__(self, cfg, job, model, optimizer):
        from checkpointless.checkpoint import CheckpointWriter
        self.cfg, self.job, self.model, self.optimizer = cfg, job, model, optimizer
        self.writer = CheckpointWriter(cfg.checkpoint.dir, cfg.checkpoint.keep) \
            if job.rank == 0 else None

    def state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                              get_model_state_dict,
                                                              get_optimizer_state_dict)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {"model": get_model_state_dict(self.model, options=opts),
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=opts)}

    def save(self, step: int) -> None:
        state = self.state()  # a collective under fsdp: every rank takes part
        if self.writer:
            self.writer.save(step, state)

    def load(self, path) -> int:
        from checkpointless.checkpoint import load
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                              set_model_state_dict,
                                                              set_optimizer_state_dict)
        state = load(path)
        opts = StateDictOptions(full_state_dict=True)
        set_model_state_dict(self.model, state["model"], options=opts)
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"], options=opts)
        return int(state["step"])

    def newest_step(self):
        from checkpointless.checkpoint import latest
        if self.writer:
            self.writer.wait()  # a write in flight finishes first: it may be the newest
        found = latest(self.cfg.checkpoint.dir)
        return found[0] if found else None

    def load_step(self, step: int) -> int:
        return self.load(Path(self.cfg.checkpoint.dir) / f"step-{step:08d}.pt")

    def close(self) -> None:
        if self.writer:
            self.writer.wait()


def durable_checkpoints(cfg, job, model, optimizer):
    """Set up checkpoints and, with checkpoint.resume=auto, continue from the newest one.

    The newest checkpoint is also the job's fallback when a lost slice has no copy in any
    peer's memory (a rank and all its replica holders lost together)."""
    c = cfg.checkpoint
    if c.interval <= 0 and c.resume == "never":
        return None
    ckpt = DurableCheckpoints(cfg, job, model, optimizer)
    if hasattr(job, "set_fallback"):
        job.set_fallback(ckpt.newest_step, ckpt.load_step)
    if c.resume == "auto" and not job.is_replacement:
        from checkpointless.checkpoint import latest
        found = latest(c.dir)
        if found:
            step = ckpt.load(found[1])
            job.resume_at(step)
            if job.rank == 0:
                print(f"[launcher] resumed from checkpoint {found[1]} at step {step}", flush=True)
    return ckpt if c.interval > 0 else None


def export(model, state: dict, tokenizer, path: Path) -> None:
    """save_pretrained with the full (gathered) state, loadable by AutoModelForCausalLM."""
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
             for k, v in state.items()}
    model.save_pretrained(str(path), state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(str(path))


def export_lora(cfg, model, state: dict, tokenizer, out_dir: Path) -> None:
    """The adapter in `adapter/` (save_pretrained: loadable with PeftModel.from_pretrained on its
    base); the base in `base/` when it came from a seeded init rather than a model id (nothing
    else could rebuild it); with peft.merge=true the merged model in `model/`.

    The live model is left untouched (merging or unloading it would change this rank's
    parameters before the replicas are compared): copies are built on the CPU from `state`."""
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
             for k, v in state.items()}

    def copy():
        _, fresh, _ = build(cfg, torch.device("cpu"))
        fresh.load_state_dict(state)
        return fresh

    adapter_dir, base_dir = out_dir / "adapter", None if cfg.model.id else out_dir / "base"
    local = copy()
    local.save_pretrained(str(adapter_dir))
    tokenizer.save_pretrained(str(adapter_dir))
    if base_dir:  # the base beside the adapter, which points at it
        local.unload().save_pretrained(str(base_dir), safe_serialization=True)
        tokenizer.save_pretrained(str(base_dir))
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = str(base_dir.resolve())
        (adapter_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    if cfg.peft.merge:
        merged = (copy() if base_dir else local).merge_and_unload()
        merged.save_pretrained(str(out_dir / "model"), safe_serialization=True)
        tokenizer.save_pretrained(str(out_dir / "model"))


if __name__ == "__main__":
    main(sys.argv[1])
