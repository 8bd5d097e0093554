"""`python -m launcher train`: write the resolved recipe, supervise the workers, write the report."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from checkpointless.supervisor import JobFailed, Supervisor, SupervisorConfig


def supervisor_config(cfg) -> SupervisorConfig:
    d, c = cfg.distributed, cfg.checkpointless
    backend = d.backend
    if backend == "auto":
        import torch
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    return SupervisorConfig(
        nproc=d.num_processes, spares=c.spares if c.enabled else 0, refill=c.refill,
        heartbeat_timeout_s=c.heartbeat_timeout_s, backend=backend, host=d.master_addr,
        port=d.master_port, seed=cfg.run.seed, pg_timeout_s=c.pg_timeout_s,
        spare_wait_s=c.spare_wait_s, enabled=c.enabled,
        replication={"factor": c.replication.factor, "interval": c.replication.interval,
                     "offset": 1},  # one launcher per node today: the ring is within the node
        faults=[dict(f) for f in OmegaConf.to_container(cfg.faults)])


def _log(message: str) -> None:
    # on a terminal, step off the progress bar's line first
    print(("\n" if sys.stdout.isatty() else "") + message, flush=True)


def train(cfg, on_start=None) -> dict | None:
    """Run a resolved recipe under the supervisor; `on_start(supervisor)` is called once the
    workers are spawned (the benchmark uses it to inject failures from outside)."""
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    recipe_file = out / "recipe.yaml"
    recipe_file.write_text(OmegaConf.to_yaml(cfg))
    if cfg.checkpoint.resume != "auto":
        (out / "metrics.jsonl").write_text("")  # a new run starts a new metrics file
    print(f"[launcher] {cfg.run.name}: {cfg.distributed.num_processes} workers + "
          f"{cfg.checkpointless.spares if cfg.checkpointless.enabled else 0} spares, "
          f"strategy {cfg.distributed.strategy}, {cfg.trainer.max_steps} steps -> {out}",
          flush=True)
    sup = Supervisor([sys.executable, "-m", "launcher.loop", str(recipe_file)],
                     supervisor_config(cfg),
                     log=_log, on_start=on_start)
    t0 = time.time()
    try:
        run = sup.run()
    except JobFailed as exc:
        print(f"[launcher] run failed: {exc}", file=sys.stderr, flush=True)
        return None
    results = run["results_by_rank"]
    r0 = results.get(0, {})
    report = {
        "recipe": cfg.run.name,
        "world_size": run["world_size"],
        "strategy": cfg.distributed.strategy,
        "steps_completed": r0.get("steps", run["steps_completed"]),
        "steps_this_launch": run["steps_completed"],
        "tokens": r0.get("tokens"),
        "wall_s": round(time.time() - t0, 3),
        "final_loss": r0.get("final_loss"),
        "params_sha256": r0.get("params_sha256"),
        "params_sha256_by_rank": {str(r): v.get("params_sha256") for r, v in results.items()},
        "goodput": run["goodput"],
        "recoveries": run["recoveries"],
        "pids_at_start": {str(r): p for r, p in run["pids_at_start"].items()},
        "pids_at_end": {str(r): p for r, p in run["pids_at_end"].items()},
        "local_params_by_rank": {str(r): v.get("local_params") for r, v in results.items()},
        "full_params": r0.get("full_params"),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    agree = len(set(report["params_sha256_by_rank"].values())) == 1
    loss, good = report["final_loss"], report["goodput"]
    print(f"[launcher] done: {report['steps_completed']} steps, final loss "
          f"{'-' if loss is None else f'{loss:.4f}'}, "
          f"goodput {'-' if good is None else f'{good:.1%}'}, "
          f"{len(report['recoveries'])} recoveries, replicas "
          f"{'agree' if agree else 'DISAGREE'} (params_sha256 {str(report['params_sha256'])[:16]}), "
          f"report {out / 'report.json'}", flush=True)
    if not agree:
        print("[launcher] ERROR: ranks ended with different parameters", file=sys.stderr)
        return None
    return report
