"""The run's report (report.json) and the lines the launcher prints or appends as it goes."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from launcher.parallel.mesh import coordinates, mesh_sizes


def metrics_line(out: Path):
    """A straggler's entry, as it is found and as it is dealt with, as a line of metrics.jsonl
    (appended beside rank 0's step lines: one write of one line each)."""
    def write(entry: dict) -> None:
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"event": "straggler", "t": round(time.time(), 6), **entry}) +
                    "\n")
    return write


def log(message: str) -> None:
    # on a terminal, step off the progress bar's line first
    print(("\n" if sys.stdout.isatty() else "") + message, flush=True)


def recoveries_said(recoveries: list) -> str:
    """'3 recoveries', or with nodes lost '3 recoveries (2 ranks of lost nodes, 1 process)'."""
    nodes = sum(1 for r in recoveries if r.get("cause") == "node_lost")
    said = f"{len(recoveries)} recoveries"
    if nodes:
        said += f" ({nodes} ranks of lost nodes, {len(recoveries) - nodes} processes)"
    return said


def replay_said(replay: dict | None) -> str:
    """What the final line says of the bits: checked, not guaranteed (and why), or unchecked."""
    if not replay or replay.get("replayable") is None:
        why = (replay or {}).get("reason", "not checked")
        return f"bits as a run without failures not checked ({why.removeprefix('not checked: ')})"
    if replay["replayable"]:
        return f"replay check passed at step {replay['checked_at_step']}"
    return ("bits NOT guaranteed to equal a run without failures: a step run again from the same "
            f"state gave other bits ({replay['reason']})")


def placed(d, recoveries: list[dict]) -> list[dict]:
    """The recoveries with the mesh coordinates of the lost rank and of the rank that sent it,
    where the generation that failed ran the launch's mesh: after a shrink the ranks number
    fewer processes, which no coordinate of that mesh names (None then)."""
    out, processes = [], d.num_processes
    for e in recoveries:
        src, full = e.get("source"), processes == d.num_processes
        out.append({**e, "failed_coordinates": coordinates(d, e["failed_rank"]) if full else None,
                    "source_coordinates": None if src is None or not full else
                    coordinates(d, int(src))})
        processes = e.get("processes") or processes
    return out


def pipeline_summary(cfg) -> dict | None:
    """The schedule and split of a pipelined run (pipeline.py), None without stages."""
    if cfg.distributed.pp_size <= 1:
        return None
    from launcher.parallel.pipeline_split import summary
    from launcher.plan.model import hf_config
    return summary(cfg, hf_config(cfg)[0])


def build_report(cfg, run: dict, t0: float, **extra) -> dict:
    results = run["results_by_rank"]
    r0 = results.get(0, {})
    return {
        **extra,
        "recipe": cfg.run.name,
        "world_size": run["world_size"],
        "strategy": cfg.distributed.strategy,
        "parallelism": mesh_sizes(cfg.distributed),
        "pipeline": pipeline_summary(cfg),
        "steps_completed": r0.get("steps", run["steps_completed"]),
        "steps_this_launch": run["steps_completed"],
        "tokens": r0.get("tokens"),
        "wall_s": round(time.time() - t0, 3),
        "final_loss": r0.get("final_loss"),
        "eval": r0.get("eval"),
        "params_sha256": r0.get("params_sha256"),
        "params_sha256_by_rank": {str(r): v.get("params_sha256") for r, v in results.items()},
        # the rest of the training state: optimizer and data position (one for the job, as
        # rank 0 has them; by rank below), and each rank's random state
        "state_sha256": state_of(r0, results),
        "state_sha256_by_rank": {str(r): v.get("state_sha256") for r, v in results.items()},
        "goodput": run["goodput"],
        # stragglers (rank, node, factor, from_step, what was done) and what they cost
        "stragglers": run.get("stragglers", []),
        "slow_s": run.get("slow_s", 0.0),
        "healthy_step_s": run.get("healthy_step_s"),
        "straggler_check": run.get("straggler_check", {}),
        "recoveries": placed(cfg.distributed, run["recoveries"]),
        "failures": run["failures"],
        # workers killed once every result was in (on their way out): nothing was lost
        "killed_after_done": run.get("killed_after_done", []),
        "pids_at_start": {str(r): p for r, p in run["pids_at_start"].items()},
        "pids_at_end": {str(r): p for r, p in run["pids_at_end"].items()},
        "local_params_by_rank": {str(r): v.get("local_params") for r, v in results.items()},
        "full_params": r0.get("full_params"),
        "memory": memory_by_rank(results),
        # the replay rehearsal's verdict and the redo check's mismatches (rehearsal.py)
        "replay": run.get("replay"),
        # checkpointless.shrink on: its mode, the shrinks and grows, the processes at the end
        # (results_by_rank counts those) and the capacity lost while shrunk
        **{k: run[k] for k in ("shrink", "shrinks", "grows", "processes_at_end",
                               "shrunk_capacity_lost_s") if k in run},
    }


def state_of(r0: dict, results: dict) -> dict | None:
    """report.json's `state_sha256`: rank 0's parts, the random state by rank."""
    mine = r0.get("state_sha256")
    if not mine:
        return None
    return {**{k: v for k, v in mine.items() if k != "rng"},
            "rng_by_rank": {str(r): (v.get("state_sha256") or {}).get("rng")
                            for r, v in sorted(results.items())}}


def memory_by_rank(results: dict) -> dict | None:
    """report.json's `memory` from every rank's result: one dict per figure, by rank."""
    mem = {str(r): v["memory"] for r, v in results.items() if v.get("memory")}
    if not mem:
        return None
    return {f"{key}_by_rank": {r: m.get(key) for r, m in mem.items()}
            for key in ("baseline_rss_bytes", "peak_rss_bytes", "model_state_bytes",
                        "param_bytes", "optimizer_state_bytes", "replica_bytes",
                        "snapshot_bytes")}
