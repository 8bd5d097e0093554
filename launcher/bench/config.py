"""What the benchmark runs: `bench.*` keys into a BenchConfig, every other key a recipe override."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

from launcher.recipe.load import RecipeError

# plain: the recipe's model, data and optimizer in a torch-only loop (torch's DDP, or FSDP2 under
# distributed.strategy=fsdp) under torchrun, the speed a user would get without this project
# flat: off with distributed.grad_sync=flat (one all-reduce after backward, no overlap)
# slow-evict and slow-report: on with a straggler (rank slow_rank slow_factor times as slow from
# step slow_step on), evicted to a spare or only reported; beside on, the failure-free run
# audit-off, audit: the recipe with a spare and durable checkpoints, audits off and every step
# (checkpointless.audit.every=1); their failure-free step times are taken side by side
# tp: fsdp x tensor parallel 2 (distributed.tp_size=2) with spares, killed on the failure
# schedule like checkpointless; its failure-free step time is taken beside fsdp-replicated's
# pp: 2 pipeline stages x 2 replicas (distributed.pp_size=2) with spares, killed on the failure
# schedule like checkpointless; its failure-free step time is taken beside on's (the same workers)
# shrink-exact, shrink-fast, shrink-off: no spare at the start (refills on), killed on the failure
# schedule; exact's failure-free step time is taken beside on's (shrink.py)
# fsdp-exact: fsdp-replicated under checkpointless.shrink=exact (FSDP's reduce-scatter in logical
# order), killed like fsdp-replicated; its failure-free step is taken beside fsdp-replicated's
# hsdp-exact: hsdp under checkpointless.shrink=exact (each chunk summed over the world in logical
# order, then handed to its twins), killed like hsdp; its failure-free step is taken beside hsdp's
MODES = ("off", "on", "plain", "flat", "checkpointless", "restart", "fsdp", "fsdp-replicated",
         "hsdp", "tp", "slow-evict", "slow-report", "audit-off", "audit", "pp",
         "shrink-exact", "shrink-fast", "shrink-off", "fsdp-exact", "hsdp-exact")


@dataclass
class BenchConfig:
    recipe: str = "tiny-llama"  # recipe every mode trains
    duration_s: float = 600.0  # rough wall budget of the whole benchmark; sizes `steps`
    steps: Optional[int] = None  # steps per mode (default: from duration_s and step_s_estimate)
    step_s_estimate: float = 0.25  # step time of tiny-llama, 4 workers on 2 cores (measured)
    mtbf_s: float = 60.0  # mean time between injected failures, seconds
    seed: int = 0  # seeds the failure schedule (times and ranks)
    workers: int = 4  # active workers in every mode
    spares: int = 1  # hot spares for the checkpointless modes
    max_restarts: int = 100  # torchrun --max-restarts for the restart mode
    output_dir: str = "bench_out"  # bench.json, timeline.png and one folder per mode
    # modes to run, comma-separated; add plain for its own run and row (bench.modes=off,on,plain)
    modes: str = "off,on,checkpointless,restart,slow-evict,slow-report"
    # steps of the off/on pair run side by side, taking turns every turn_s seconds, from which
    # the steady-state overhead is measured (0: overhead from the sequential off and on runs)
    paired_steps: int = 80
    # plain (torch's own DDP loop) takes turns in that run too, even when not among bench.modes:
    # on this noisy box only turns make a 5% comparison readable, and it costs paired_steps steps
    paired_plain: bool = True
    # flat (the recipe loop with one all-reduce after backward) takes turns too, beside off's
    # overlapped buckets (ddp only)
    paired_flat: bool = True
    turn_s: float = 3.0
    slow_rank: int = 1  # the straggler of the slow-* modes
    slow_step: int = 20  # the step it slows down from
    slow_factor: float = 3.0  # how many times as long its steps take
    mode_timeout_s: float = 900.0  # a mode still running after this is stopped and reported


def parse(args: list[str]) -> tuple[BenchConfig, list[str]]:
    cfg, overrides = BenchConfig(), []
    names = {f.name: f for f in fields(BenchConfig)}
    for a in args:
        if not a.startswith("bench."):
            overrides.append(a)
            continue
        key, _, value = a[len("bench."):].partition("=")
        if key not in names:
            import difflib
            near = difflib.get_close_matches(key, names, n=1)
            raise RecipeError(f"unknown benchmark key 'bench.{key}'." +
                              (f" Did you mean 'bench.{near[0]}'?" if near else ""))
        # `steps` defaults to None, so its type is not in its default
        kind = type(getattr(cfg, key)) if getattr(cfg, key) is not None else int
        try:
            setattr(cfg, key, as_bool(value) if kind is bool else kind(value))
        except ValueError:
            raise RecipeError(f"bench.{key}={value!r}: expected {kind.__name__}") from None
    bad = [m for m in cfg.modes.split(",") if m not in MODES]
    if bad:
        raise RecipeError(f"bench.modes: {bad} not among {', '.join(MODES)}")
    if cfg.mtbf_s <= 0 or cfg.workers < 1:
        raise RecipeError("bench.mtbf_s must be > 0 and bench.workers >= 1")
    if not (0 <= cfg.slow_rank < cfg.workers and cfg.slow_step >= 0 and cfg.slow_factor > 1):
        raise RecipeError(f"bench.slow_rank={cfg.slow_rank}, bench.slow_step={cfg.slow_step}, "
                          f"bench.slow_factor={cfg.slow_factor:g}: the rank must be below "
                          f"bench.workers={cfg.workers}, the step >= 0 and the factor > 1")
    if cfg.steps is None:
        # off and on take ~1x each, the failure modes ~1.2x and ~2x, the slow ones ~1.3x and
        # ~2x, plus start-up per run and the paired run (off, on and plain taking turns)
        jobs = 2 + cfg.paired_plain + cfg.paired_flat
        spare_s = 100 + (30 + jobs * cfg.paired_steps * cfg.step_s_estimate
                         if cfg.paired_steps else 0)
        runs = 4.2 + sum(x for m, x in (("slow-evict", 1.3), ("slow-report", 2.0))
                         if m in cfg.modes.split(","))
        cfg.steps = max(40, int((cfg.duration_s - spare_s) / (runs * cfg.step_s_estimate)))
        # a failure run lasts at least the longest first gap of the schedule (1.5 x MTBF), so
        # it sees at least one failure
        cfg.steps = max(cfg.steps, math.ceil(1.7 * cfg.mtbf_s / cfg.step_s_estimate))
    return cfg, overrides


def as_bool(value: str) -> bool:
    """`bench.paired_plain=false` must read as False (bool("false") is True)."""
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(value)
