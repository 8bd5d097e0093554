"""The pipeline keys (`distributed.pp_*`) against the rest of the recipe, before any worker starts.

What the model itself allows (its pipeline plan, its layer count) needs its config and is checked
in preflight.py (pipeline.refusal).
"""
from __future__ import annotations

from omegaconf import DictConfig

from launcher.recipe.rules import need


def check_pipeline(cfg: DictConfig) -> None:
    """Stages divide the workers; each stage's state survives a lost rank; the step's rows
    split into whole microbatches; the loop's other features that a stage cannot run are
    refused with the fix."""
    d, t = cfg.distributed, cfg.trainer
    pp, n = d.pp_size, d.num_processes
    if pp == 1:
        need(not d.pp_layers, "distributed.pp_layers", d.pp_layers,
             "applies with distributed.pp_size > 1 only. Fix: set distributed.pp_size, or drop "
             "distributed.pp_layers")
        need(d.pp_microbatches == 0, "distributed.pp_microbatches", d.pp_microbatches,
             "applies with distributed.pp_size > 1 only. Fix: set distributed.pp_size, or drop "
             "distributed.pp_microbatches")
        return
    key = "distributed.pp_size"
    need(n % pp == 0 and n >= pp, key, pp,
         f"must divide distributed.num_processes={n} into stages of equal size. Fix: a "
         f"divisor of {n}, or distributed.num_processes={pp * max(1, n // pp)}")
    stage = n // pp
    need(d.strategy != "ddp" or stage >= 2 or not cfg.checkpointless.enabled, key, pp,
         f"leaves each stage one worker under ddp ({n} workers / {pp} stages): a lost stage "
         "would have no twin to take its state from. Fix: distributed.num_processes="
         f"{2 * n} (two data-parallel replicas), or distributed.strategy=fsdp (peer copies "
         "keep each stage's slices)")
    if d.strategy == "hsdp" and d.shard_size:
        need(stage % d.shard_size == 0, "distributed.shard_size", d.shard_size,
             f"counts the workers of a replica group inside one pipeline stage ({stage} "
             f"workers each) and must divide it. Fix: a divisor of {stage}")
    need(stage % d.tp_size == 0, "distributed.tp_size", d.tp_size,
         f"must divide the workers of a pipeline stage ({stage}). Fix: a divisor of {stage}")
    rows = pp * t.micro_batch_size * t.grad_accum_steps
    micro = d.pp_microbatches or pp * t.grad_accum_steps
    need(rows % micro == 0, "distributed.pp_microbatches", micro,
         f"must divide the {rows} rows a pipeline trains on per step (pp_size x "
         "trainer.micro_batch_size x grad_accum_steps) into equal microbatches. Fix: "
         "distributed.pp_microbatches="
         f"{max(m for m in range(1, rows + 1) if rows % m == 0 and m <= max(micro, 1))}, or "
         "raise trainer.micro_batch_size")
    if d.pp_schedule == "interleaved-1f1b":
        need(micro % pp == 0, "distributed.pp_microbatches", micro,
             f"interleaved-1f1b runs microbatches in rounds of pp_size={pp}. Fix: "
             f"distributed.pp_microbatches={pp * max(1, micro // pp)}")
    refuse = [(t.precision == "fp16", "trainer.precision", t.precision,
               "fp16's GradScaler is not pipelined. Fix: trainer.precision=bf16 or fp32"),
              (cfg.eval.every > 0, "eval.every", cfg.eval.every,
               "validation is not pipelined yet. Fix: eval.every=0 with distributed.pp_size"),
              (cfg.peft.method != "none", "peft.method", cfg.peft.method,
               "LoRA is not pipelined yet. Fix: peft.method=none, or distributed.pp_size=1"),
              (cfg.checkpointless.audit.every > 0, "checkpointless.audit.every",
               cfg.checkpointless.audit.every, "audits replay a whole rank's step, which a "
               "stage cannot alone. Fix: checkpointless.audit.every=0"),
              (cfg.data.format != "text", "data.format", cfg.data.format,
               "packed or padded examples (positions restart, masked tokens) are not "
               "pipelined yet. Fix: data.format=text, or distributed.pp_size=1")]
    for bad, k, v, fix in refuse:
        need(not bad, k, v, f"with {key}={pp}: {fix}")
