"""`python -m launcher train`: write the resolved recipe, supervise the workers, write the report."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from checkpointless import protocol
from checkpointless.protocol import replica_offset
from checkpointless.control import JobFailed, Supervisor, SupervisorConfig

from .memory import by_rank as memory_by_rank
from .preflight import preflight
from .recipes import RecipeError
from .schema import SHARDED
from .tensor_parallel import coordinates, mesh_sizes


def health_settings(cfg) -> dict:
    """The node checks (checkpointless/worker/health.py), their disk where checkpoints go."""
    h = OmegaConf.to_container(cfg.checkpointless.health)
    h["disk_path"] = str(cfg.checkpoint.dir if cfg.checkpoint.interval else cfg.run.output_dir)
    if cfg.distributed.device == "cpu":
        h["gpu"] = False  # said once, as the launcher starts
    return h


def check_node_health(cfg) -> None:
    """As a launcher starts: its node is checked; an unhealthy one is refused with its reasons."""
    from checkpointless.worker import health
    problems, notes = health.check(health_settings(cfg))
    if cfg.checkpointless.health.gpu and cfg.distributed.device == "cpu":
        notes.append("health: a CPU run: the GPU checks (ECC, XID, throttling, device memory) "
                     "are skipped")
    for n in notes:
        print(f"[launcher] {n}", flush=True)
    if problems:
        raise RecipeError(f"node {cfg.distributed.node_rank} is unhealthy: " +
                          "; ".join(problems) + ". Fix the node (or the checkpointless.health.* "
                          "settings) and launch again")


def shrink_max_hosted(cfg) -> int:
    """checkpointless.shrink_max_hosted, or where unset on a device, what the memory plan leaves
    room for (plan/fit.py: max_hosted); 0 (no limit) on CPU, where the plan is not made."""
    c, d = cfg.checkpointless, cfg.distributed
    if c.shrink_max_hosted or c.shrink == "off" or d.device == "cpu":
        return c.shrink_max_hosted
    from .plan.fit import check_fits, max_hosted
    return max_hosted(check_fits(cfg))


def shrink_min_processes(cfg) -> int:
    """The fewest processes a shrink may leave: 1 under ddp; under fsdp and hsdp 2 (one
    process would not reduce-scatter: fsdp_logical.py), and on a device what the memory plan
    leaves room for, each of fewer processes holding a larger chunk (plan/fit.py)."""
    c, d = cfg.checkpointless, cfg.distributed
    if d.strategy not in SHARDED:
        return 1
    if c.shrink == "off" or d.device == "cpu":
        return 2
    from .plan.fit import min_shrunk_processes
    return max(2, min_shrunk_processes(cfg))


def supervisor_config(cfg) -> SupervisorConfig:
    d, c = cfg.distributed, cfg.checkpointless
    backend = d.backend
    if backend == "auto":
        import torch
        backend = "nccl" if d.device != "cpu" and torch.cuda.is_available() else "gloo"
    per_node = d.num_processes // d.num_nodes
    placement = c.replication.placement
    if placement == "auto":  # across nodes, copies a node apart: a lost node keeps no slice
        placement = "nodes" if d.num_nodes > 1 else "ring"
    if placement == "nodes" and d.num_nodes == 1:
        # every worker of this run lives on this machine: copies a node apart cannot exist
        raise RecipeError("checkpointless.replication.placement=nodes puts each shard's copies "
                          "on another node, but this run has one node (all "
                          f"{d.num_processes} workers here). Use placement=ring")
    groups = d.num_processes // d.shard_size if d.strategy == "hsdp" else 1
    if placement == "nodes" and d.strategy in SHARDED and groups < 2 and c.enabled and not \
            2 <= c.replication.factor <= d.num_nodes:
        raise RecipeError(
            f"checkpointless.replication.factor={c.replication.factor} with placement=nodes on "
            f"{d.num_nodes} nodes cannot survive the loss of a node: a slice needs at least one "
            f"copy on another node (factor >= 2) and its copies on distinct nodes (factor <= "
            f"{d.num_nodes}). Use checkpointless.replication.factor=2")
    # every knob of the recipe's checkpointless section under its own name; the rest here
    return SupervisorConfig.of(
        c, nproc=d.num_processes, spares=c.spares if c.enabled else 0, backend=backend,
        host=d.master_addr, port=d.master_port, seed=cfg.run.seed, nodes=d.num_nodes,
        standalone=d.standalone_coordinator,
        replication={"factor": max(1, c.replication.factor),
                     "interval": c.replication.interval,
                     "offset": replica_offset(placement, per_node)},
        # under ddp every rank of a pipeline stage is a replica group of its own (mesh.py)
        shard_size=d.shard_size if d.strategy == "hsdp" else
        (1 if d.strategy == "ddp" and d.pp_size > 1 else 0),
        tp_size=d.tp_size, pp_size=d.pp_size,
        straggler_factor=c.straggler.factor, straggler_window=c.straggler.window,
        audit_every=c.audit.every if c.enabled else 0,
        shrink_max_hosted=shrink_max_hosted(cfg),
        shrink_min_processes=shrink_min_processes(cfg),
        health=health_settings(cfg),
        tokens_per_step=cfg.trainer.micro_batch_size * cfg.trainer.grad_accum_steps *
        cfg.data.seq_len * (d.num_processes // d.tp_size),  # pp keeps the batch (pipeline.py)
        straggler_action=c.straggler.action if c.enabled else "report",
        faults=[dict(f) for f in OmegaConf.to_container(cfg.faults)])


def _metrics_line(out: Path):
    """A straggler's entry, as it is found and as it is dealt with, as a line of metrics.jsonl
    (appended beside rank 0's step lines: one write of one line each)."""
    def write(entry: dict) -> None:
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"event": "straggler", "t": round(time.time(), 6), **entry}) +
                    "\n")
    return write


def _log(message: str) -> None:
    # on a terminal, step off the progress bar's line first
    print(("\n" if sys.stdout.isatty() else "") + message, flush=True)


def quiet_openmp(cfg) -> bool:
    """On CPU with more of this node's processes (workers and spares) than cores, OpenMP's
    threads wait asleep rather than spinning (OMP_WAIT_POLICY=PASSIVE, unless set): a spare's
    warm-up runs two threads (model_setup.warm_up), which spun at every barrier while the ranks
    held the cores, and took 20-40 s to be ready instead of about 5 (4 processes of 2 cores
    each on a 2-core machine; docs/log.md). Read when the fork server imports torch."""
    import torch
    d = cfg.distributed
    if "OMP_WAIT_POLICY" in os.environ or (d.device != "cpu" and torch.cuda.is_available()):
        return False
    local = (d.nproc_per_node or d.num_processes // max(1, d.num_nodes)) + \
        cfg.checkpointless.spares
    if local <= len(os.sched_getaffinity(0)):
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def train(cfg, on_start=None, coordinator: bool = False) -> dict | None:
    """Run a resolved recipe under the supervisor; `on_start(supervisor)` is called once the
    workers are spawned (the benchmark uses it to inject failures from outside). With a
    stand-alone coordinator, `coordinator=True` is that process, and every node's launcher is an
    agent."""
    sup_cfg = supervisor_config(cfg)  # refuses bad settings before anything is written
    # workers forked from a server that imported the loop's libraries once (6 s of a core each
    # here); CHECKPOINTLESS_FORKSERVER=0 starts each as a fresh interpreter
    os.environ.setdefault(protocol.ENV_PRELOAD, "launcher.loop:preload")
    quiet_openmp(cfg)
    preflight(cfg)  # devices, model, tokenizer, data, memory: once, here, not in every worker
    if not coordinator:
        check_node_health(cfg)  # this node trains: is it fit to?
    if not coordinator:  # this node's workers and spares will only memory-map the data cache
        from .data import prepare_node
        prepare_node(cfg)
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    d = cfg.distributed
    if cfg.checkpointless.coordinator == "etcd":  # every node alike: an agent and a candidate
        recipe_file = out / f"recipe.node{d.node_rank}.yaml"
        recipe_file.write_text(OmegaConf.to_yaml(cfg))
        from .etcd_node import run_node
        return run_node(cfg, recipe_file, out)
    if d.node_rank > 0 or (d.standalone_coordinator and not coordinator):
        # this node's agent, with its own copy of the recipe (output folders may be shared)
        recipe_file = out / f"recipe.node{d.node_rank}.yaml"
        recipe_file.write_text(OmegaConf.to_yaml(cfg))
        return _node_agent(cfg, recipe_file)
    recipe_file = out / "recipe.yaml"
    recipe_file.write_text(OmegaConf.to_yaml(cfg))
    if cfg.checkpoint.resume != "auto":
        (out / "metrics.jsonl").write_text("")  # a new run starts a new metrics file
    print(f"[launcher] {cfg.run.name}: {cfg.distributed.num_processes} workers + "
          f"{cfg.checkpointless.spares if cfg.checkpointless.enabled else 0} spares, "
          f"strategy {cfg.distributed.strategy}, {cfg.trainer.max_steps} steps -> {out}",
          flush=True)
    if d.num_nodes > 1 or cfg.checkpointless.spare_nodes > 0:
        print(f"[launcher] node 0 of {d.num_nodes} (+{cfg.checkpointless.spare_nodes} spare): "
              f"coordinator on {d.master_addr}:{d.master_port}", flush=True)
    sup = Supervisor([sys.executable, "-m", "launcher.loop", str(recipe_file)], sup_cfg,
                     log=_log, on_start=on_start, on_straggler=_metrics_line(out))
    t0 = time.time()
    before = _stop_on_signals(sup)
    try:
        run = sup.run()
    except JobFailed as exc:
        print(f"[launcher] run failed: {exc}", file=sys.stderr, flush=True)
        if exc.report is not None:  # what was done, and why it stopped, stays on record
            report = _report(cfg, exc.report, t0, status="failed", error=str(exc))
            (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
            print(f"[launcher] report {out / 'report.json'}", file=sys.stderr, flush=True)
        return None
    finally:
        import signal
        for sig, handler in before.items():
            signal.signal(sig, handler)
    preempted = sup.preempted_at is not None
    report = _report(cfg, run, t0, status="preempted" if preempted else "ok")
    if preempted:
        report["preempted"] = {"why": sup.stop_asked, "stopped_before_step": sup.preempted_at}
    agree = len(set(report["params_sha256_by_rank"].values())) == 1
    if not agree:  # replicas that drifted apart are never a success
        report.update(status="failed", error="ranks ended with different params_sha256")
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    loss, good = report["final_loss"], report["goodput"]
    print(f"[launcher] done: {report['steps_completed']} steps, final loss "
          f"{'-' if loss is None else f'{loss:.4f}'}, "
          f"goodput {'-' if good is None else f'{good:.1%}'}, "
          f"{_recoveries_said(report['recoveries'])}, replicas "
          f"{'agree' if agree else 'DISAGREE'} (params_sha256 {str(report['params_sha256'])[:16]}), "
          f"report {out / 'report.json'}", flush=True)
    if not agree:
        print("[launcher] ERROR: ranks ended with different parameters", file=sys.stderr)
        return None
    if preempted:
        print(f"[launcher] preempted ({sup.stop_asked}): every worker and spare stopped after "
              f"step {report['steps_completed'] - 1}; continue with checkpoint.resume=auto",
              flush=True)
    return report


def _recoveries_said(recoveries: list) -> str:
    """'3 recoveries', or with nodes lost '3 recoveries (2 ranks of lost nodes, 1 process)'."""
    nodes = sum(1 for r in recoveries if r.get("cause") == "node_lost")
    said = f"{len(recoveries)} recoveries"
    if nodes:
        said += f" ({nodes} ranks of lost nodes, {len(recoveries) - nodes} processes)"
    return said


def _stop_on_signals(sup) -> None:
    """SIGTERM or SIGINT (Slurm preemption, Ctrl-C) stops the whole job at the next step
    boundary; a second one stops this launcher at once."""
    import signal

    def handler(sig, _frame):
        name = signal.Signals(sig).name
        if sup.stop_asked:
            raise KeyboardInterrupt(f"{name} again: stopping at once")
        sup.request_stop(f"{name} on node 0")

    import threading
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}


def _node_agent(cfg, recipe_file: Path) -> dict | None:
    """Serve the coordinator as node `node_rank`; a report of this node's exit."""
    from checkpointless.control import run_agent
    d, c = cfg.distributed, cfg.checkpointless
    per_node = d.num_processes // d.num_nodes
    spare_node = d.node_rank >= d.num_nodes
    here = per_node + (0 if spare_node else c.spares)
    print(f"[launcher] {cfg.run.name}: node {d.node_rank} ({'spare node' if spare_node else 'active'}"
          f", {here} processes) joining the coordinator at {d.master_addr}:{d.master_port}",
          flush=True)
    rc = run_agent(d.node_rank, [sys.executable, "-m", "launcher.loop", str(recipe_file)],
                   d.master_addr, d.master_port, c.node_timeout_s, here)
    why = {0: "the job is over", 3: "this node was fenced (declared lost)",
           4: "the coordinator is gone"}.get(rc, f"exit {rc}")
    print(f"[launcher] node {d.node_rank}: {why}", flush=True)
    # The agent's threads stay blocked in the coordinator's store (its next plan, its next
    # command); one of those calls returning while the interpreter shuts down aborts the
    # process (c10d unwinding a thread that can no longer take the GIL). Nothing is left to do
    # here: leave at once, with the exit code `launcher train` gives (0 done, 1 otherwise).
    sys.stderr.flush()
    os._exit(0 if rc == 0 else 1)


def _placed(d, recoveries: list[dict]) -> list[dict]:
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
    from .pipeline import summary
    from .plan.model import hf_config
    return summary(cfg, hf_config(cfg)[0])


def _report(cfg, run: dict, t0: float, **extra) -> dict:
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
        "goodput": run["goodput"],
        # stragglers (rank, node, factor, from_step, what was done) and what they cost
        "stragglers": run.get("stragglers", []),
        "slow_s": run.get("slow_s", 0.0),
        "healthy_step_s": run.get("healthy_step_s"),
        "straggler_check": run.get("straggler_check", {}),
        "recoveries": _placed(cfg.distributed, run["recoveries"]),
        "failures": run["failures"],
        # workers killed once every result was in (on their way out): nothing was lost
        "killed_after_done": run.get("killed_after_done", []),
        "pids_at_start": {str(r): p for r, p in run["pids_at_start"].items()},
        "pids_at_end": {str(r): p for r, p in run["pids_at_end"].items()},
        "local_params_by_rank": {str(r): v.get("local_params") for r, v in results.items()},
        "full_params": r0.get("full_params"),
        "memory": memory_by_rank(results),
        # checkpointless.shrink on: its mode, the shrinks and grows, the processes at the end
        # (results_by_rank counts those) and the capacity lost while shrunk
        **{k: run[k] for k in ("shrink", "shrinks", "grows", "processes_at_end",
                               "shrunk_capacity_lost_s") if k in run},
    }
