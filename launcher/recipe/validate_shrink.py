"""`checkpointless.shrink` against the rest of the recipe, before any worker starts: where a
shrink is built, stated once (derive.py's `auto` asks the same rules)."""
from __future__ import annotations

from omegaconf import DictConfig

from launcher.recipe.rules import need
from launcher.recipe.schema import RecipeError


def check_shrink(cfg: DictConfig) -> None:
    """A shrink moves a lost rank's logical rank onto a survivor: under ddp, and under fsdp and
    hsdp with exact (their slices cut anew for the processes left); not tp or pp yet. Under
    audits the supervisor does not shrink (an audit replays one process's step), but the
    reduction is the logical one all the same."""
    c = cfg.checkpointless
    if c.shrink in ("off", "auto"):  # auto: derive.py chose what is built here
        need(c.shrink_max_hosted == 0, "checkpointless.shrink_max_hosted", c.shrink_max_hosted,
             "applies with checkpointless.shrink=exact or fast only. Fix: set "
             "checkpointless.shrink, or drop checkpointless.shrink_max_hosted")
        return
    check_built(cfg, c.shrink)


def refusal(cfg: DictConfig, mode: str) -> str | None:
    """Why checkpointless.shrink=`mode` is not built for this recipe; None where it is."""
    try:
        check_built(cfg, mode)
    except RecipeError as exc:
        return str(exc)
    return None


def check_built(cfg: DictConfig, mode: str) -> None:
    """Refuse `mode` (exact or fast) where no shrink is built, naming the key and the fix."""
    d, key = cfg.distributed, "checkpointless.shrink"
    need(d.strategy in ("ddp", "fsdp", "hsdp"), key, mode,
         f"is built for distributed.strategy=ddp, fsdp and hsdp, not {d.strategy}. Fix: "
         "checkpointless.shrink=off (a lost rank then waits for a spare)")
    if d.strategy in ("fsdp", "hsdp"):
        s = d.strategy
        need(mode == "exact", key, mode,
             f"under {s} is built as exact only (FSDP's reduce-scatter in logical order). Fix: "
             "checkpointless.shrink=exact, or off")
        need(cfg.trainer.precision != "fp16", key, mode,
             f"under {s} is not built with trainer.precision=fp16 (its GradScaler unscales "
             "before the exact clipping). Fix: trainer.precision=bf16 or fp32, or "
             "checkpointless.shrink=off")
        need(cfg.peft.method == "none", key, mode,
             f"under {s} is built for full training (a LoRA model's frozen base would be "
             "rebuilt at a shrink, untested so far). Fix: checkpointless.shrink=off, or "
             "distributed.strategy=ddp")
        need(d.num_processes >= 3, key, mode,
             f"under {s} needs distributed.num_processes >= 3: it shrinks to 2 processes at "
             "the least (one process would not reduce-scatter). Fix: checkpointless.shrink=off")
    need(d.tp_size == 1 and d.pp_size == 1, key, mode,
         f"needs one process per data-parallel rank (distributed.tp_size={d.tp_size}, "
         f"pp_size={d.pp_size}). Fix: checkpointless.shrink=off, or tp_size=1 and pp_size=1")
    need(d.num_processes >= 2, key, mode,
         "needs distributed.num_processes >= 2: one process has no survivor to host it. Fix: "
         "checkpointless.shrink=off")
