"""SIGKILL a run's workers from outside, at seeded moments: not through `faults`, which fire at
chosen points of the library's own code, but wherever the victim happens to be (in forward, in a
collective, in the optimizer step, in the export after the last step).

A moment is (n, delay): once rank 0 has logged n distinct steps in metrics.jsonl, wait `delay`
seconds, then kill one worker (by default worker 1, then 2, ...: the first ranks' own). Steps take
about 0.2-0.5 s here, so a delay drawn from [0, 0.5) lands anywhere in the next step.
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

from tests.conftest import ROOT, launcher_cmd


def worker_pids(run_dir: Path, worker_id: int) -> list[int]:
    """The live training processes of `run_dir` started as worker `worker_id` (the ids a
    first generation's ranks have: rank r is worker r until it is replaced)."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().decode(errors="replace")
            if "launcher.train.loop" not in cmd or str(run_dir) not in cmd:
                continue
            env = (p / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if is_worker(p, env, worker_id):
            found.append(int(p.name))
    return found


def is_worker(proc: Path, env: list[bytes], worker_id: int) -> bool:
    """/proc/PID is worker `worker_id`: started fresh, its environment says so; forked from the
    fork server (checkpointless/control/forkserver.py), its environment and command line are the
    server's, and its name says so."""
    if f"CL_WORKER_ID={worker_id}".encode() in env:
        return True
    try:
        return (proc / "comm").read_text().strip() == f"cl-worker-{worker_id}"
    except OSError:
        return False


def steps_logged(run_dir: Path) -> int:
    """How many distinct steps rank 0 has logged (a step redone after a roll-back is logged
    again: lines would count it twice)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = set()
    for line in path.read_text().splitlines():
        try:
            steps.add(json.loads(line).get("step"))
        except ValueError:  # a line being written
            pass
    return len(steps - {None})


def seeded_moments(seed: int, lines: list[int], max_delay_s: float = 0.5) -> list[tuple]:
    rng = random.Random(seed)
    return [(n, round(rng.uniform(0.0, max_delay_s), 3)) for n in lines]


def train_killing(tmp_path, name: str, recipe: str, moments, *overrides, victims=None,
                  timeout_s=400):
    """Train `recipe` through the CLI and kill worker 1, then 2, then 3 ... (or the worker ids in
    `victims`) at `moments`. Returns (out dir, report, kills: [(line, delay, pid)], log text).

    Every kill must land: a victim with no live process fails the run (were finding workers to
    break, every run would otherwise pass as a failure-free one), and each victim must be in
    the report, as a failure the job recovered from or as a worker killed after its result was
    in (`killed_after_done`); a spare victim, only if it had taken a rank by then."""
    out = tmp_path / name
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(launcher_cmd(tmp_path, out, recipe, *overrides), cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
        kills = []
        try:
            deadline = time.time() + timeout_s
            for victim, (line, delay) in zip(victims or range(1, len(moments) + 1), moments):
                while steps_logged(out) < line and proc.poll() is None:
                    assert time.time() < deadline, log_path.read_text()[-3000:]
                    time.sleep(0.003)
                time.sleep(delay)
                pids = worker_pids(out, victim)
                assert pids, (f"no live process of worker {victim} to kill at line {line} + "
                              f"{delay} s: nothing would be tested", log_path.read_text()[-2000:])
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                kills.append((line, delay, pids[0]))
            rc = proc.wait(timeout=max(1.0, deadline - time.time()))
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log_path.read_text()
    assert rc == 0, (kills, text[-4000:])
    report = json.loads((out / "report.json").read_text())
    hit = {f["worker"] for f in report["failures"]} | set(report.get("killed_after_done", []))
    launched = len(report["pids_at_start"])  # workers 0..n-1 held ranks from the start; a
    for victim, kill in zip(victims or range(1, len(moments) + 1), kills):  # spare killed
        # before it was promoted is replaced unseen by the job, and not in its report
        assert victim >= launched or victim in hit, (f"worker {victim} was SIGKILLed {kill} but the report has no "
                               "failure of it", report["failures"], text[-3000:])
    return out, report, kills, text
