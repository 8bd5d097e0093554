"""Goodput benchmark: checkpointless against checkpoint-restart, side by side, in one run.

    make bench                                   (defaults: tiny-llama, 4 workers + 1 spare,
    python -m launcher bench bench.mtbf_s=60      one failure a minute, about 10 minutes)

Four modes train the same recipe, seed and step count:
  off             plain loop under torchrun, no fault tolerance, no failure (the reference speed)
  on              under the checkpointless supervisor with a spare, no failure (steady overhead)
  checkpointless  as `on`, with workers SIGKILLed on a seeded schedule
  restart         torchrun with --max-restarts: every failure restarts all workers, which resume
                  from the newest disk checkpoint, saved every tau steps (Young's optimum)

The steady-state overhead comes from one more pair, off and on run at the same time and taking
turns on the machine every `bench.turn_s` seconds (the other one stopped meanwhile): both see the
same machine, minute by minute, so its drifting speed (+-10% over tens of seconds on a small
shared box) does not land on one side only, as it does for runs one after the other.

Failures come from outside the workers, at seeded wall-clock times after the first step (mean
time between failures `bench.mtbf_s`, gaps uniform in 0.5-1.5 x MTBF), on a seeded random rank: they land at a
random point inside a step, as real failures do. Every figure is computed the same way for every
mode from the step records in each run's metrics.jsonl. `bench.*` keys set the benchmark; any
other key=value is a recipe override.
"""
from __future__ import annotations

import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from .recipes import RecipeError, load

MODES = ("off", "on", "checkpointless", "restart", "fsdp", "fsdp-replicated")


@dataclass
class BenchConfig:
    recipe: str = "tiny-llama"  # recipe every mode trains
    duration_s: float = 600.0  # rough wall budget of the whole benchmark; sizes `steps`
    steps: Optional[int] = None  # steps per mode (default: from duration_s and step_s_estimate)
    step_s_estimate: float = 0.55  # step time of tiny-llama, 4 workers on 2 cores (measured)
    mtbf_s: float = 60.0  # mean time between injected failures, seconds
    seed: int = 0  # seeds the failure schedule (times and ranks)
    workers: int = 4  # active workers in every mode
    spares: int = 1  # hot spares for the checkpointless modes
    max_restarts: int = 100  # torchrun --max-restarts for the restart mode
    output_dir: str = "bench_out"  # bench.json, timeline.png and one folder per mode
    modes: str = "off,on,checkpointless,restart"  # modes to run, comma-separated
    # steps of the off/on pair run side by side, taking turns every turn_s seconds, from which
    # the steady-state overhead is measured (0: overhead from the sequential off and on runs)
    paired_steps: int = 80
    turn_s: float = 3.0
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
        kind = type(getattr(cfg, key)) if getattr(cfg, key) is not None else int
        try:
            setattr(cfg, key, kind(value))
        except ValueError:
            raise RecipeError(f"bench.{key}={value!r}: expected {kind.__name__}") from None
    bad = [m for m in cfg.modes.split(",") if m not in MODES]
    if bad:
        raise RecipeError(f"bench.modes: {bad} not among {', '.join(MODES)}")
    if cfg.mtbf_s <= 0 or cfg.workers < 1:
        raise RecipeError("bench.mtbf_s must be > 0 and bench.workers >= 1")
    if cfg.steps is None:
        # off and on take ~1x each, the failure modes ~1.2x and ~2x, plus start-up per run and
        # the second on/off pair
        spare_s = 100 + (30 + 2 * cfg.paired_steps * cfg.step_s_estimate
                         if cfg.paired_steps else 0)
        cfg.steps = max(40, int((cfg.duration_s - spare_s) / (4.2 * cfg.step_s_estimate)))
        # a failure run lasts at least the longest first gap of the schedule (1.5 x MTBF), so
        # it sees at least one failure
        cfg.steps = max(cfg.steps, math.ceil(1.7 * cfg.mtbf_s / cfg.step_s_estimate))
    return cfg, overrides


# ---- step records and the figures derived from them -------------------------------------
def read_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:  # a worker killed mid-write can leave a torn line: skip it
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return out


def summarize(records: list[dict], kills: list[dict]) -> dict:
    if not records:
        return {"wall_s": None, "steps": 0, "goodput": None}
    final = {}
    for r in sorted(records, key=lambda r: r["t_end"]):
        final[r["step"]] = r  # the last attempt of each step is the one that counts
    t0 = min(r["t_start"] for r in records)
    t1 = max(r["t_end"] for r in records)
    useful = sum(r["t_end"] - r["t_start"] for r in final.values())
    recov = []
    for k in kills:
        after = [r for r in records if r["t_start"] >= k["t"]]
        if after:
            first = min(after, key=lambda r: r["t_end"])
            recov.append(first["t_end"] - k["t"])
    durations = [r["t_end"] - r["t_start"] for r in records]
    return {
        "wall_s": round(t1 - t0, 3), "steps": len(final),
        "goodput": round(useful / (t1 - t0), 4) if t1 > t0 else None,
        "recoveries": len(kills),
        "recovery_s_median": round(statistics.median(recov), 3) if recov else None,
        "recovery_s_max": round(max(recov), 3) if recov else None,
        "recovery_s_all": [round(x, 3) for x in recov],
        "steps_redone": len(records) - len(final),
        "step_s_median": round(statistics.median(durations), 5),
        "t0": t0,
    }


def run_digest(run_dir: Path) -> Optional[str]:
    files = sorted((run_dir / "results").glob("rank*.json")) if (run_dir / "results").exists() \
        else []
    digests = {json.loads(f.read_text())["params_sha256"] for f in files}
    return digests.pop() if len(digests) == 1 else (None if not digests else "DISAGREE")


# ---- failure injection from outside ------------------------------------------------------
def schedule(cfg: BenchConfig, horizon_s: float) -> list[tuple[float, float]]:
    """(offset after the first step, rank draw in [0,1)) pairs, the same for every mode.

    Gaps are drawn uniformly in [0.5, 1.5] x MTBF: the mean is the MTBF, as with exponential
    gaps, but a short benchmark cannot draw zero failures (or five) by luck of the seed."""
    rng = random.Random(cfg.seed)
    out, t = [], 0.0
    while True:
        t += cfg.mtbf_s * rng.uniform(0.5, 1.5)
        if t > horizon_s:
            return out
        out.append((t, rng.random()))


class Killer(threading.Thread):
    """SIGKILLs the worker of a drawn rank at each scheduled time, until training ends."""

    def __init__(self, run_dir: Path, targets, plan, max_steps: int):
        super().__init__(daemon=True)
        self.run_dir, self.targets, self.plan, self.max_steps = run_dir, targets, plan, max_steps
        self.kills: list[dict] = []
        self.stop = threading.Event()

    def run(self):
        t0 = None
        while t0 is None and not self.stop.wait(0.05):
            recs = read_records(self.run_dir)
            t0 = recs[0]["t_start"] if recs else None
        for offset, draw in self.plan:
            while time.time() < t0 + offset:
                if self.stop.wait(min(0.05, t0 + offset - time.time())):
                    return
            recs = read_records(self.run_dir)
            if recs and max(r["step"] for r in recs) >= self.max_steps - 3:
                return  # the end is near: a kill now would hit the export, not training
            targets = self.targets()
            if len(targets) < 1:
                continue
            ranks = sorted(targets)
            rank = ranks[int(draw * len(ranks))]
            try:
                os.kill(targets[rank], signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append({"t": time.time(), "offset_s": round(offset, 3), "rank": rank})
            print(f"[bench] killed rank {rank} (pid {targets[rank]}) at +{offset:.1f} s",
                  flush=True)


def tree_pids(root: int) -> list[int]:
    """`root` and every process below it."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            for t in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{t}/children") as f:
                    todo += [int(x) for x in f.read().split()]
        except OSError:
            continue
    return out


def torchrun_workers(agent_pid: int) -> dict[int, int]:
    """rank -> pid of the training workers torchrun's agent is running now."""
    out = {}
    for pid in tree_pids(agent_pid)[1:]:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"launcher.loop" in cmd:
            for e in env:
                if e.startswith(b"RANK="):
                    out[int(e[5:])] = pid
    return out


# ---- the modes ---------------------------------------------------------------------------
def mode_recipe(cfg: BenchConfig, overrides: list[str], mode: str, tau_steps: int = 0,
                name: str | None = None, steps: int | None = None):
    out = Path(cfg.output_dir) / (name or mode)
    extra = [f"run.output_dir={out}", f"trainer.max_steps={steps or cfg.steps}",
             f"distributed.num_processes={cfg.workers}", "trainer.progress_bar=false",
             "trainer.save_model=false", "~faults", "trainer.log_every=50"]
    if mode in ("off", "restart"):
        extra += ["checkpointless.enabled=false", "checkpointless.spares=0"]
    elif mode.startswith("fsdp"):  # sharded: replication off (factor 1) against the recipe's
        extra += ["distributed.strategy=fsdp", "checkpointless.spares=0"]
        if mode == "fsdp":
            extra += ["checkpointless.replication.factor=1"]
    else:
        extra += [f"checkpointless.spares={cfg.spares}"]
    if mode == "restart":
        extra += [f"checkpoint.interval={tau_steps}", "checkpoint.resume=auto",
                  "checkpoint.keep=2"]
    rc = load(cfg.recipe, overrides + extra)
    import shutil
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "recipe.yaml").write_text(OmegaConf.to_yaml(rc))
    return rc, out


def torchrun_cmd(cfg: BenchConfig, out: Path, max_restarts: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(cfg.workers), "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
            "-m", "launcher.loop", str(out / "recipe.yaml")]


def run_torchrun(cfg: BenchConfig, out: Path, killer_plan=None,
                 steps: int = 0) -> tuple[int, list[dict], float]:
    cmd = torchrun_cmd(cfg, out, cfg.max_restarts if killer_plan else 0)
    t0 = time.time()
    with open(out / "torchrun.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        killer = None
        if killer_plan:
            killer = Killer(out, lambda: torchrun_workers(proc.pid), killer_plan,
                            steps or cfg.steps)
            killer.start()
        try:
            rc = proc.wait(timeout=cfg.mode_timeout_s)
        except subprocess.TimeoutExpired:  # failures outpaced restarts: report what was done
            print(f"[bench] stopping after {cfg.mode_timeout_s:.0f} s: restarts cannot keep "
                  "up with the failures", flush=True)
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
        if killer:
            killer.stop.set()
            killer.join()
    return rc, (killer.kills if killer else []), time.time() - t0


def run_supervised(rc_cfg, out: Path, cfg: BenchConfig, killer_plan=None, steps: int = 0):
    from .launch import train
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


class Turns(threading.Thread):
    """Two jobs take turns on the machine: each runs alone for `turn_s` while the other's
    processes are stopped (SIGSTOP), until one of them ends. `windows` records (job, start, end)
    of every turn; a step counts for its job only if it ran entirely inside one of its turns."""

    def __init__(self, jobs, turn_s: float):
        super().__init__(daemon=True)
        self.jobs, self.turn_s = jobs, turn_s  # [(run_dir, pids(), finished()), ...]
        self.windows: list[tuple[int, float, float]] = []
        self.stop = threading.Event()

    @staticmethod
    def _signal(pids, sig) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def run(self):
        try:  # both start together; the first to log a step waits (stopped) for the other
            while True:
                started = [bool(read_records(d)) for d, _, _ in self.jobs]
                if all(started):
                    break
                for (_, pids, _), go in zip(self.jobs, started):
                    if go:
                        self._signal(pids(), signal.SIGSTOP)
                if self.stop.wait(0.2) or any(done() for _, _, done in self.jobs):
                    return
            turn = 0
            while not self.stop.is_set() and not any(done() for _, _, done in self.jobs):
                me, other = turn % 2, 1 - turn % 2
                self._signal(self.jobs[other][1](), signal.SIGSTOP)
                self._signal(self.jobs[me][1](), signal.SIGCONT)
                t0 = time.time()
                self.stop.wait(self.turn_s)
                self.windows.append((me, t0, time.time()))
                turn += 1
        finally:
            for _, pids, _ in self.jobs:
                self._signal(pids(), signal.SIGCONT)


def steps_in_turns(records: list[dict], windows, job: int) -> list[float]:
    """Durations of the steps that ran entirely inside one of `job`'s turns."""
    spans = [(a, b) for j, a, b in windows if j == job]
    return [r["t_end"] - r["t_start"] for r in records
            if any(a <= r["t_start"] and r["t_end"] <= b for a, b in spans)]


def run_paired(cfg: BenchConfig, overrides: list[str]) -> dict:
    """off (torchrun) and on (supervisor + spare) at the same time, taking turns on the machine;
    returns the median step time of each over the steps that ran inside its own turns."""
    from .launch import train
    steps = cfg.paired_steps
    _, out_off = mode_recipe(cfg, overrides, "off", name="paired-off", steps=steps)
    # a stopped turn is a silence of turn_s: the hang detector must not take it for a hang
    rc_on, out_on = mode_recipe(cfg, overrides + [
        f"checkpointless.heartbeat_timeout_s={max(120.0, 10 * cfg.turn_s)}"], "on",
        name="paired-on", steps=steps)
    cmd = torchrun_cmd(cfg, out_off, 0)
    turns = None
    with open(out_off / "torchrun.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

        def on_start(sup):
            nonlocal turns
            turns = Turns([(out_off, lambda: tree_pids(proc.pid), lambda: proc.poll() is not None),
                           (out_on, lambda: [w.proc.pid for w in list(sup.workers.values())],
                            lambda: len(read_records(out_on)) >= steps)], cfg.turn_s)
            turns.start()

        try:
            train(rc_on, on_start=on_start)
        finally:
            if turns:
                turns.stop.set()
                turns.join()
            proc.wait(timeout=cfg.mode_timeout_s)
    off = steps_in_turns(read_records(out_off), turns.windows, 0)
    on = steps_in_turns(read_records(out_on), turns.windows, 1)
    if len(off) < 5 or len(on) < 5:
        return {}
    return {"turns": len(turns.windows), "turn_s": cfg.turn_s, "steps_counted_off": len(off),
            "steps_counted_on": len(on), "step_s_median_off": round(statistics.median(off), 5),
            "step_s_median_on": round(statistics.median(on), 5),
            "same_bits": run_digest(out_off) == run_digest(out_on) is not None}


def measure_save_cost(rc_cfg, repeats: int = 5) -> float:
    """Seconds one synchronous checkpoint of this recipe's full state takes (model + AdamW)."""
    import tempfile

    import torch

    from checkpointless.checkpoint import CheckpointWriter
    from models import build_model, build_tokenizer
    tok = build_tokenizer(rc_cfg.tokenizer.kind, rc_cfg.tokenizer.id or rc_cfg.model.id)
    model = build_model(rc_cfg.model.name, rc_cfg.model.init, rc_cfg.model.id,
                        OmegaConf.to_container(rc_cfg.model.config), vocab_size=len(tok))
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, len(tok), (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    costs = []
    with tempfile.TemporaryDirectory() as d:
        w = CheckpointWriter(d, keep=1)
        for i in range(repeats):
            t = time.time()
            w.save(i, {"model": model.state_dict(), "optimizer": opt.state_dict()},
                   blocking=True)
            costs.append(time.time() - t)
    return statistics.median(costs)


# ---- report ------------------------------------------------------------------------------
def table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [["-" if v is None else str(v) for v in r] for r in rows]
    w = [max(len(c[i]) for c in cells) for i in range(len(header))]
    lines = ["  ".join(c[i].rjust(w[i]) if i else c[i].ljust(w[i]) for i in range(len(header)))
             for c in cells]
    lines.insert(1, "  ".join("-" * x for x in w))
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.8))
    colors = {"off": "#888888", "on": "#bbbbbb", "checkpointless": "#1f77b4",
              "restart": "#d62728"}
    for mode in ("off", "checkpointless", "restart"):
        r = results.get(mode)
        if not r or not r["records"]:
            continue
        t0 = r["summary"]["t0"]
        recs = sorted(r["records"], key=lambda x: x["t_end"])
        ax.plot([x["t_end"] - t0 for x in recs], [x["step"] + 1 for x in recs], ".",
                ms=2.5, color=colors[mode],
                label=f"{mode} (goodput {r['summary']['goodput']:.1%})")
        for i, k in enumerate(r["kills"]):
            ax.axvline(k["t"] - t0, color=colors[mode], ls="--", lw=0.8, alpha=0.7,
                       label=f"{mode}: failures" if i == 0 else None)
    ax.set_xlabel("wall time since the first step (s)")
    ax.set_ylabel("step completed")
    ax.set_title("Steps completed over time, same failure schedule")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench(args: list[str]) -> int:
    cfg, overrides = parse(args)
    modes = cfg.modes.split(",")
    out_root = Path(cfg.output_dir)
    out_root.mkdir(parents=True, exist_ok=True)
    base = load(cfg.recipe, overrides + [f"distributed.num_processes={cfg.workers}", "~faults"])
    print(f"[bench] {cfg.recipe}: {cfg.workers} workers, {cfg.steps} steps per mode, "
          f"MTBF {cfg.mtbf_s:.0f} s, seed {cfg.seed}, modes {', '.join(modes)}", flush=True)
    plan = schedule(cfg, horizon_s=20 * cfg.steps * cfg.step_s_estimate + 600)
    save_cost = measure_save_cost(base)
    step_s = cfg.step_s_estimate
    results: dict = {}
    runs = [(m, m, cfg.steps) for m in modes]
    for mode, name, steps in runs:
        tau_steps = 0
        if mode == "restart":
            ref = results.get("off") or results.get("on")
            if ref:
                step_s = ref["summary"]["step_s_median"]
            tau_s = math.sqrt(2 * save_cost * cfg.mtbf_s)  # Young's optimal interval
            tau_steps = max(1, round(tau_s / step_s))
        rc_cfg, out = mode_recipe(cfg, overrides, mode, tau_steps, name=name, steps=steps)
        print(f"[bench] mode {name} -> {out}", flush=True)
        killer_plan = plan if mode in ("checkpointless", "restart") else None
        if mode in ("off", "restart"):
            rc, kills, elapsed = run_torchrun(cfg, out, killer_plan, steps)
        else:
            rc, kills, elapsed, _ = run_supervised(rc_cfg, out, cfg, killer_plan, steps)
        records = read_records(out)
        summary = summarize(records, kills)
        hosts = [json.loads(f.read_text()).get("replica_host_bytes") for f in
                 sorted((out / "results").glob("rank*.json"))] if (out / "results").exists() else []
        summary["replica_host_bytes"] = max([h for h in hosts if h] or [0]) or None
        summary.update(params_sha256=run_digest(out), exit_code=rc,
                       total_s_with_startup=round(elapsed, 1))
        if mode == "restart":
            summary.update(checkpoint_every_steps=tau_steps, checkpoint_save_s=round(save_cost, 4))
        results[name] = {"summary": summary, "records": records, "kills": kills}
        print(f"[bench] {name}: {json.dumps({k: v for k, v in summary.items() if k not in ('t0', 'recovery_s_all')})}",
              flush=True)
    paired = {}
    if cfg.paired_steps and "off" in modes and "on" in modes:
        print(f"[bench] off and on side by side, taking turns every {cfg.turn_s:g} s "
              f"({cfg.paired_steps} steps each)", flush=True)
        paired = run_paired(cfg, overrides)
        print(f"[bench] paired: {json.dumps(paired)}", flush=True)
    return report(cfg, results, save_cost, out_root, paired)


def report(cfg: BenchConfig, results: dict, save_cost: float, out_root: Path,
           paired: Optional[dict] = None) -> int:
    from .goodput_model import model_table
    s = {m: r["summary"] for m, r in results.items()}
    sequential = None
    if "on" in s and "off" in s:
        sequential = round(s["on"]["step_s_median"] / s["off"]["step_s_median"] - 1, 4)
    overhead = sequential
    if paired:
        overhead = round(paired["step_s_median_on"] / paired["step_s_median_off"] - 1, 4)
    speedup = None
    if s.get("checkpointless", {}).get("recovery_s_median") and \
            s.get("restart", {}).get("recovery_s_median"):
        speedup = round(s["restart"]["recovery_s_median"] / s["checkpointless"]["recovery_s_median"], 1)
    rows = []
    for m in MODES:
        if m in s:
            x = s[m]
            rows.append([m, x["wall_s"], x["steps"],
                         None if x["goodput"] is None else f"{x['goodput']:.1%}",
                         x["recoveries"], x["recovery_s_median"], x["recovery_s_max"],
                         x["steps_redone"], f"{x['step_s_median'] * 1000:.0f}",
                         (x["params_sha256"] or "-")[:12]])
    print()
    print(table(rows, ["mode", "wall_s", "steps", "goodput", "failures", "recov_med_s",
                       "recov_max_s", "redone", "step_ms", "params_sha256"]))
    if paired:
        print(f"steady-state overhead of checkpointless (on vs off, median step time, the two "
              f"taking turns on the machine, {paired['steps_counted_on']} and "
              f"{paired['steps_counted_off']} steps counted): {overhead:+.1%} "
              f"(runs one after the other: {sequential:+.1%})")
    elif overhead is not None:
        print(f"steady-state overhead of checkpointless (on vs off, median step time): "
              f"{overhead:+.1%}")
    if speedup is not None:
        print(f"median recovery: restart {s['restart']['recovery_s_median']:.2f} s vs "
              f"checkpointless {s['checkpointless']['recovery_s_median']:.2f} s "
              f"-> {speedup}x faster (every failure, s: checkpointless "
              f"{s['checkpointless']['recovery_s_all']}, restart {s['restart']['recovery_s_all']})")
    if "checkpointless" in s and "restart" in s and s["restart"]["goodput"]:
        print(f"goodput: checkpointless {s['checkpointless']['goodput']:.1%} vs restart "
              f"{s['restart']['goodput']:.1%}")
    same = None
    if "fsdp" in s and "fsdp-replicated" in s:
        rep_over = round(s["fsdp-replicated"]["step_s_median"] / s["fsdp"]["step_s_median"] - 1, 4)
        s["fsdp-replicated"]["replication_overhead"] = rep_over
        print(f"fsdp peer replication (factor and interval from the recipe) per-step overhead: "
              f"{rep_over:+.1%}; replica host memory per worker: "
              f"{(s['fsdp-replicated'].get('replica_host_bytes') or 0) / 1e6:.1f} MB")
    if "checkpointless" in s and "off" in s:
        same = s["checkpointless"]["params_sha256"] == s["off"]["params_sha256"] is not None
        print(f"final bits: checkpointless {'EQUAL to' if same else 'DIFFER from'} the "
              f"failure-free run (params_sha256 {str(s['off']['params_sha256'])[:16]})")
    model_rows, model_text = model_table(s, overhead, save_cost)
    print()
    print(model_text)
    bench_json = {
        "machine": f"{os.cpu_count()} CPU cores, {sys.platform}",
        "config": asdict(cfg),
        "modes": {m: {k: v for k, v in x.items() if k != "t0"} for m, x in s.items()},
        "overhead": overhead, "overhead_sequential": sequential, "overhead_paired": paired,
        "recovery_speedup": speedup,
        "same_bits_as_off": same,
        "failures": {m: r["kills"] for m, r in results.items() if r["kills"]},
        "checkpoint_save_s": round(save_cost, 4),
        "model": model_rows,
    }
    (out_root / "bench.json").write_text(json.dumps(bench_json, indent=2) + "\n")
    plot(results, out_root / "timeline.png")
    print(f"\n[bench] wrote {out_root / 'bench.json'} and {out_root / 'timeline.png'}")
    return 0 if same in (None, True) else 1
