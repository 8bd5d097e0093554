"""`python -m launcher train`: write the resolved recipe, supervise the workers, write the report."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf

from checkpointless import protocol
from checkpointless.control import JobFailed, Supervisor

from launcher.run.exits import node_exit_said
from launcher.run.preflight import preflight
from launcher.run.report import build_report, log, metrics_line, recoveries_said, replay_said
from launcher.run.supervise import check_node_health, supervisor_config


def quiet_openmp(cfg) -> bool:
    """On CPU with more of this node's processes (workers and spares) than cores, OpenMP's
    threads wait asleep rather than spinning (OMP_WAIT_POLICY=PASSIVE, unless set): a spare's
    warm-up runs two threads (model_setup.warm_up), which spun at every barrier while the ranks
    held the cores, and took 20-40 s to be ready instead of about 5 (4 processes of 2 cores
    each on a 2-core machine; docs/journal/log.md). Read when the fork server imports torch."""
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
    os.environ.setdefault(protocol.ENV_PRELOAD, "launcher.train.loop:preload")
    quiet_openmp(cfg)
    preflight(cfg)  # devices, model, tokenizer, data, memory: once, here, not in every worker
    if not coordinator:
        check_node_health(cfg)  # this node trains: is it fit to?
    if not coordinator:  # this node's workers and spares will only memory-map the data cache
        from launcher.data.prepare import prepare_node
        prepare_node(cfg)
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    d = cfg.distributed
    if cfg.checkpointless.coordinator == "etcd":  # every node alike: an agent and a candidate
        recipe_file = out / f"recipe.node{d.node_rank}.yaml"
        recipe_file.write_text(OmegaConf.to_yaml(cfg))
        from launcher.run.etcd_node import run_node
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
    sup = Supervisor([sys.executable, "-m", "launcher.train.loop", str(recipe_file)], sup_cfg,
                     log=log, on_start=on_start, on_straggler=metrics_line(out))
    t0 = time.time()
    before = _stop_on_signals(sup)
    try:
        run = sup.run()
    except JobFailed as exc:
        print(f"[launcher] run failed: {exc}", file=sys.stderr, flush=True)
        if exc.report is not None:  # what was done, and why it stopped, stays on record
            report = build_report(cfg, exc.report, t0, status="failed", error=str(exc))
            (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
            print(f"[launcher] report {out / 'report.json'}", file=sys.stderr, flush=True)
        return None
    finally:
        import signal
        for sig, handler in before.items():
            signal.signal(sig, handler)
    preempted = sup.preempted_at is not None
    report = build_report(cfg, run, t0, status="preempted" if preempted else "ok")
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
          f"{recoveries_said(report['recoveries'])}, replicas "
          f"{'agree' if agree else 'DISAGREE'} (params_sha256 {str(report['params_sha256'])[:16]}), "
          f"{replay_said(report['replay'])}, report {out / 'report.json'}", flush=True)
    if not agree:
        print("[launcher] ERROR: ranks ended with different parameters", file=sys.stderr)
        return None
    if preempted:
        print(f"[launcher] preempted ({sup.stop_asked}): every worker and spare stopped after "
              f"step {report['steps_completed'] - 1}; continue with checkpoint.resume=auto",
              flush=True)
    return report


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
    rc = run_agent(d.node_rank, [sys.executable, "-m", "launcher.train.loop", str(recipe_file)],
                   d.master_addr, d.master_port, c.node_timeout_s, here)
    why = node_exit_said(rc, "the coordinator is gone")
    print(f"[launcher] node {d.node_rank}: {why}", flush=True)
    # The agent's threads stay blocked in the coordinator's store (its next plan, its next
    # command); one of those calls returning while the interpreter shuts down aborts the
    # process (c10d unwinding a thread that can no longer take the GIL). Nothing is left to do
    # here: leave at once, with the exit code `launcher train` gives (0 done, 1 otherwise).
    sys.stderr.flush()
    os._exit(0 if rc == 0 else 1)


