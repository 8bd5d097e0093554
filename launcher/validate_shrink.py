"""`checkpointless.shrink` against the rest of the recipe, before any worker starts."""
from __future__ import annotations

from omegaconf import DictConfig

from .validate import need


def check_shrink(cfg: DictConfig) -> None:
    """A shrink moves a lost rank's logical rank onto a survivor: under ddp only for now (a
    sharded or split model would be resharded onto fewer processes). Under audits the
    supervisor does not shrink (an audit replays one process's step), but the reduction is
    the logical one all the same."""
    c, d = cfg.checkpointless, cfg.distributed
    key = "checkpointless.shrink"
    if c.shrink in ("off", "auto"):  # auto: derive.py chose what is built here
        need(c.shrink_max_hosted == 0, "checkpointless.shrink_max_hosted", c.shrink_max_hosted,
             "applies with checkpointless.shrink=exact or fast only. Fix: set "
             "checkpointless.shrink, or drop checkpointless.shrink_max_hosted")
        return
    need(d.strategy == "ddp", key, c.shrink,
         f"is built for distributed.strategy=ddp so far; {d.strategy} would reshard its state "
         "onto fewer processes. Fix: checkpointless.shrink=off (a lost rank then waits for a "
         "spare), or distributed.strategy=ddp")
    need(d.tp_size == 1 and d.pp_size == 1, key, c.shrink,
         f"needs one process per data-parallel rank (distributed.tp_size={d.tp_size}, "
         f"pp_size={d.pp_size}). Fix: checkpointless.shrink=off, or tp_size=1 and pp_size=1")
    need(d.num_processes >= 2, key, c.shrink,
         "needs distributed.num_processes >= 2: one process has no survivor to host it. Fix: "
         "checkpointless.shrink=off")
