"""The `plain` mode's worker: what a user would run instead of the recipe loop.

    torchrun --nproc_per_node N -m launcher.bench.plain_loop RUN_DIR/recipe.yaml

The same model, tokenizer, data order, threads, precision, AdamW groups and lr schedule as
launcher/train/loop.py (imported from it, so the two cannot drift apart), but the step is torch alone:
`torch.nn.parallel.DistributedDataParallel` with its default settings for ddp, FSDP2's
`fully_shard` for fsdp, no supervisor, no join, nothing of checkpointless in the step (only the
final digest is checkpointless.worker.digest's, so equal bits show equal digests, and the count of local
parameters is checkpointless.worker.tensors'). It writes the recipe loop's metrics.jsonl records and
results/rank<r>.json, so the benchmark reads both the same way.

`launcher.train.loop` imports checkpointless at module level, so the package is loaded here, but nothing
in it runs: the step below calls torch only.
"""
from __future__ import annotations

import json
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from checkpointless.worker.digest import state_sha256
from checkpointless.worker.tensors import local_tensor

from launcher.data.sampler import to_device
from launcher.train.metrics import Metrics
from launcher.train.optim import build_optimizer, lr_at
from launcher.train.export import local_state
from launcher.train.model_setup import build, setup, shard
from launcher.recipe.schema import Recipe


def main(recipe_file: str) -> None:
    cfg = OmegaConf.merge(OmegaConf.structured(Recipe), OmegaConf.load(recipe_file))
    out_dir = Path(recipe_file).parent
    d, t = cfg.distributed, cfg.trainer
    backend, device = setup(cfg)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    _, model, sampler = build(cfg, device)  # the recipe loop's model, weights and data

    if d.strategy == "fsdp":
        shard(model, cfg)
        wrapped = model
    else:  # torch's defaults but the bucket size, which the recipe loop takes from the recipe
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None,
            bucket_cap_mb=d.bucket_cap_mb)
    optimizer = build_optimizer(model, cfg)
    metrics = Metrics(cfg, out_dir, 0) if rank == 0 else None
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.precision == "bf16")
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    loss_value = float("nan")

    for step in range(t.max_steps):
        t0 = time.time()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros(1, device=device)
        for micro in range(t.grad_accum_steps):
            batch = to_device(sampler.batch(step, rank, world, micro), device)
            last = micro == t.grad_accum_steps - 1
            if d.strategy == "fsdp" and t.grad_accum_steps > 1:
                model.set_requires_gradient_sync(last)
            # torch's DDP decides at forward whether the next backward reduces, so no_sync must
            # hold the forward too (around the backward alone, every micro-batch is reduced)
            with nullcontext() if last or d.strategy == "fsdp" else wrapped.no_sync():
                with autocast:
                    loss = wrapped(**batch).loss
                (loss / t.grad_accum_steps).backward()
            loss_sum += loss.detach().float()
        dist.all_reduce(loss_sum)  # the logged loss is the mean over ranks, as in the recipe loop
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss_sum.item() / (world * t.grad_accum_steps)
        if metrics:
            metrics.step(step, loss_value, lr, float(grad_norm), t0, time.time())

    state = local_state(model, d.strategy)  # DTensors under fsdp, gathered one at a time by
    sha = state_sha256(state)  # the digest (every rank takes part), after training: the step
    # itself runs no project code
    if metrics:
        metrics.close()
    trainable = [p for p in model.parameters() if p.requires_grad]
    result = {"params_sha256": sha, "rank": rank, "final_loss": loss_value, "steps": t.max_steps,
              "local_params": sum(local_tensor(p).numel() for p in trainable),
              "full_params": sum(v.numel() for v in state.values())}
    (out_dir / "results").mkdir(exist_ok=True)
    (out_dir / "results" / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
