"""`make bench` / `python -m launcher bench [key=value ...]`: run the modes one after the other,
then the paired run of the failure-free modes (off, on, plain, flat), then report."""
from __future__ import annotations

import json
import os
from pathlib import Path

from launcher.recipe.load import load
from launcher.bench.baseline import (PLAIN_LOOP, checkpoint_every, measure_consistency, measure_grad_copy,
                       measure_save_cost, run_torchrun)
from launcher.bench.config import parse
from launcher.bench.plot import plot_skipped
from launcher.bench.failures import schedule
from launcher.bench.modes import mode_recipe, run_supervised
from launcher.bench.paired import paired_modes, run_paired, run_paired_launchers
from launcher.bench.records import read_records, run_digest, summarize
from launcher.bench.shrink import MODES as SHRINK_MODES
from launcher.bench.report import report


def bench(args: list[str]) -> int:
    cfg, overrides = parse(args)
    modes = cfg.modes.split(",")
    out_root = Path(cfg.output_dir)
    out_root.mkdir(parents=True, exist_ok=True)
    base = load(cfg.recipe, overrides + [f"distributed.num_processes={cfg.workers}", "~faults"])
    print(f"[bench] {cfg.recipe}: {cfg.workers} workers, {cfg.steps} steps per mode, "
          f"MTBF {cfg.mtbf_s:.0f} s, seed {cfg.seed}, modes {', '.join(modes)}", flush=True)
    if (note := plot_skipped()) is not None:  # said before minutes of training, not after
        print(note, flush=True)
    # long enough for the slowest mode (restarts included) never to run out of failures
    plan = schedule(cfg, horizon_s=20 * cfg.steps * cfg.step_s_estimate + 600)
    save_cost = measure_save_cost(base)
    grad_copy = consistency = None
    threads = base.distributed.threads_per_worker or (os.cpu_count() or 1) // cfg.workers
    if base.distributed.strategy == "ddp":  # what the buckets' views save over the flat copy
        grad_copy = measure_grad_copy(base, threads)
        consistency = measure_consistency(base, threads)  # replicas compared (ddp only)
    step_s = cfg.step_s_estimate
    results: dict = {}
    for mode in modes:
        tau_steps = 0
        if mode == "restart":  # the interval in steps needs the step time measured so far
            ref = results.get("off") or results.get("on")
            if ref:
                step_s = ref["summary"]["step_s_median"]
            tau_steps = checkpoint_every(save_cost, cfg.mtbf_s, step_s)
        rc_cfg, out = mode_recipe(cfg, overrides, mode, tau_steps)
        print(f"[bench] mode {mode} -> {out}", flush=True)
        killer_plan = plan if mode in ("checkpointless", "restart", "tp", "pp", *SHRINK_MODES) \
            else None
        if mode in ("off", "restart", "flat"):
            rc, kills, elapsed = run_torchrun(cfg, out, killer_plan, cfg.steps)
        elif mode == "plain":
            rc, kills, elapsed = run_torchrun(cfg, out, None, cfg.steps, module=PLAIN_LOOP)
        else:
            rc, kills, elapsed, run = run_supervised(rc_cfg, out, cfg, killer_plan, cfg.steps)
        records = read_records(out)
        summary = summarize(records, kills)
        if mode.startswith("slow-"):
            summary.update(slow_figures(run, records))
        summary["replica_host_bytes"] = replica_host_bytes(out)
        summary["replica_critical_ms"] = replica_critical_ms(out)
        summary.update(params_sha256=run_digest(out), exit_code=rc,
                       total_s_with_startup=round(elapsed, 1))
        if mode == "restart":
            summary.update(checkpoint_every_steps=tau_steps, checkpoint_save_s=round(save_cost, 4))
        results[mode] = {"summary": summary, "records": records, "kills": kills}
        shown = {k: v for k, v in summary.items() if k not in ("t0", "recovery_s_all")}
        print(f"[bench] {mode}: {json.dumps(shown)}", flush=True)
    paired = side_by_side(cfg, overrides, modes, base.distributed.strategy)
    return report(cfg, results, save_cost, out_root, paired, grad_copy, consistency)


def side_by_side(cfg, overrides: list[str], modes: list[str], strategy: str) -> dict:
    """The failure-free modes' step times, measured taking turns on the machine (paired.py)."""
    paired = {}
    # flat is the ddp recipe loop without overlap: nothing to compare under fsdp
    pair = [m for m in paired_modes(cfg) if m != "flat" or strategy == "ddp"]
    if pair:
        print(f"[bench] {' and '.join(pair)} side by side, taking turns every {cfg.turn_s:g} s "
              f"({cfg.paired_steps} steps each)", flush=True)
        paired = run_paired(cfg, overrides, pair)
        print(f"[bench] paired: {json.dumps(paired)}", flush=True)
    groups = [("fsdp", [m for m in ("fsdp", "fsdp-replicated", "hsdp", "tp", "fsdp-exact",
                                    "hsdp-exact") if m in modes]),
              ("audits", [m for m in ("audit-off", "audit") if m in modes]),
              # pp beside the same recipe's ddp on the same workers ("ddp": on's recipe, its
              # own name so that on's figure from the off/on pair stays its own)
              ("pipeline", ["ddp", "pp"] if "pp" in modes else []),
              # exact's price on a failure-free step: every reduction in logical order
              ("shrink", ["ddp", "shrink-exact"] if "shrink-exact" in modes else [])]
    for what, group in groups:
        if len(group) >= 2 and cfg.paired_steps:
            print(f"[bench] {' and '.join(group)} side by side, taking turns every "
                  f"{cfg.turn_s:g} s ({cfg.paired_steps} steps each)", flush=True)
            got = run_paired_launchers(cfg, overrides, tuple(group))
            print(f"[bench] paired {what}: {json.dumps(got)}", flush=True)
            paired = dict(paired, **got)
    return paired


def slow_figures(run: dict | None, records: list[dict]) -> dict:
    """A slow-* mode's figures: goodput counting the straggler's cost (the supervisor's, from
    the step records and the straggler's steps), what was done and when, the median step time
    after it was dealt with."""
    if not run:
        return {}
    s = (run.get("stragglers") or [{}])[0]
    until = s.get("until_step")
    after = [r["t_end"] - r["t_start"] for r in records
             if until is not None and r["step"] >= until + 3]
    import statistics
    return {"goodput": run["goodput"], "slow_s": run.get("slow_s"),
            "straggler_action": s.get("action"), "straggler_from_step": s.get("from_step"),
            "straggler_until_step": until, "straggler_factor": s.get("factor"),
            "step_s_median_after": round(statistics.median(after), 5) if after else None}


def replica_host_bytes(out: Path):
    """The most host memory any rank's peer replicas took (fsdp-replicated), None if none."""
    hosts = [json.loads(f.read_text()).get("replica_host_bytes") for f in
             sorted((out / "results").glob("rank*.json"))] if (out / "results").exists() else []
    return max([h for h in hosts if h] or [0]) or None


def replica_critical_ms(out: Path):
    """Per exchange, the slowest rank's mean milliseconds of replication on the training thread
    itself ({snapshot, wait}: the host copy, and waiting for the previous exchange); None
    without replicas."""
    found = []
    for f in sorted((out / "results").glob("rank*.json")) if (out / "results").exists() else []:
        t = json.loads(f.read_text()).get("replica_timing")
        if t and t.get("exchanges"):
            found.append({k: 1000 * t[f"{k}_s"] / t["exchanges"] for k in ("snapshot", "wait")})
    if not found:
        return None
    return {k: round(max(x[k] for x in found), 3) for k in ("snapshot", "wait")}

