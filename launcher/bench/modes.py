"""The recipe each mode trains, and a run under the checkpointless supervisor."""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from omegaconf import OmegaConf

from launcher.recipe.load import load
from launcher.bench.failures import Killer
from launcher.bench.shrink import overrides as shrink_overrides


def mode_recipe(cfg, overrides: list[str], mode: str, tau_steps: int = 0,
                name: str | None = None, steps: int | None = None):
    """Resolve the recipe for `mode` and write it to a fresh run folder; returns (recipe, folder)."""
    out = Path(cfg.output_dir) / (name or mode)
    extra = [f"run.output_dir={out}", f"trainer.max_steps={steps or cfg.steps}",
             f"distributed.num_processes={cfg.workers}", "trainer.progress_bar=false",
             "trainer.save_model=false", "~faults", "trainer.log_every=50"]
    if mode in ("off", "restart", "plain", "flat"):  # torchrun runs: no supervisor, no spare
        # flat: one all-reduce after backward, against buckets (shrink=exact reduces by logical
        # rank, which would make both the same)
        extra += ["checkpointless.enabled=false", "checkpointless.spares=0"] + (
            ["distributed.grad_sync=flat", "checkpointless.shrink=off"] if mode == "flat" else [])
    elif mode.startswith("fsdp"):  # sharded: replication off (factor 1) against the recipe's
        extra += ["distributed.strategy=fsdp", "checkpointless.spares=0"]
        if mode == "fsdp":
            extra += ["checkpointless.replication.factor=1"]
        # fsdp-exact: its reduce-scatter by logical rank (fsdp_logical.py), beside the others'
        # FSDP collectives (shrink=off: the numbers before exact became fsdp's default)
        extra += [f"checkpointless.shrink={'exact' if mode == 'fsdp-exact' else 'off'}"]
    elif mode.startswith("hsdp"):  # two replica groups: they are the copies, none for peers
        extra += ["distributed.strategy=hsdp", f"distributed.shard_size={max(1, cfg.workers // 2)}",
                  "checkpointless.spares=0", "~checkpointless.replication.factor",
                  # hsdp-exact: the reduce-scatter over the world in logical order, beside hsdp
                  f"checkpointless.shrink={'exact' if mode == 'hsdp-exact' else 'off'}"]
    elif mode == "tp":  # 2 shards x tp 2 on 4 workers; peer copies as fsdp-replicated keeps
        extra += ["distributed.strategy=fsdp", "distributed.tp_size=2",
                  f"checkpointless.spares={cfg.spares}"]
    elif mode == "pp":  # 2 pipeline stages x 2 ddp replicas (1f1b), killed like checkpointless
        extra += ["distributed.pp_size=2", f"checkpointless.spares={cfg.spares}"]
    elif mode.startswith("shrink-"):  # no spare ready at a kill (bench/shrink.py)
        extra += shrink_overrides(mode)
    elif mode.startswith("audit"):  # the same job, audited every step or not at all
        extra += [f"checkpointless.spares={max(1, cfg.spares)}", "checkpoint.interval=10",
                  f"checkpointless.audit.every={1 if mode == 'audit' else 0}"]
    elif mode == "ddp":  # today's buckets, beside pp and shrink-exact (no shrink: the numbers
        extra += [f"checkpointless.spares={cfg.spares}", "checkpointless.shrink=off"]  # before)
    else:
        extra += [f"checkpointless.spares={cfg.spares}"]
    if mode.startswith("slow-"):  # a straggler (in place of any other fault), evicted or not
        extra[extra.index("~faults")] = \
            f"faults=[slow:{cfg.slow_rank}:{cfg.slow_step}:{cfg.slow_factor:g}]"
        # no refill: a new spare's start-up beside the workers on a small machine would slow
        # the very steps that show the run back at speed (the checkpointless mode has refills)
        extra += [f"checkpointless.straggler.action={mode[len('slow-'):]}",
                  "checkpointless.refill=false"]
    if mode == "restart":
        extra += [f"checkpoint.interval={tau_steps}", "checkpoint.resume=auto",
                  "checkpoint.keep=2"]
    rc = load(cfg.recipe, overrides + extra)
    shutil.rmtree(out, ignore_errors=True)  # old records would mix into this run's figures
    out.mkdir(parents=True)
    (out / "recipe.yaml").write_text(OmegaConf.to_yaml(rc))
    return rc, out


def run_supervised(rc_cfg, out: Path, cfg, killer_plan=None, steps: int = 0):
    """Train under the supervisor, killing workers on `killer_plan` if given;
    returns (exit code, kills, seconds, report)."""
    from launcher.run.launch import train  # imported late: it pulls in torch
    killer = None

    def on_start(sup):
        nonlocal killer
        if killer_plan:
            killer = Killer(out, sup.active_pids, killer_plan, steps or cfg.steps)
            killer.start()

    t0 = time.time()
    report = train(rc_cfg, on_start=on_start)
    if killer:
        killer.stop.set()
        killer.join()
    return (0 if report else 1), (killer.kills if killer else []), time.time() - t0, report
