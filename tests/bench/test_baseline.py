"""The torchrun baseline the benchmark measures checkpointless against.

The "20x faster recovery" figure is only honest if the baseline does its job: a SIGKILLed worker
makes torchrun restart every worker, they resume from the newest checkpoint on disk, and the run
ends with the same bits as one that lost nobody. These tests run the bench's own recipe and
command (`modes.mode_recipe`, `baseline.torchrun_cmd`, `baseline.torchrun_workers`) with real
processes, on a 2-layer tiny Llama and 2 workers: each worker start costs ~13 s of imports here.
"""
import re
import subprocess
import sys
import time

import pytest

from launcher.bench.baseline import run_torchrun, torchrun_cmd, torchrun_workers
from launcher.bench.config import BenchConfig
from launcher.bench.modes import mode_recipe
from launcher.bench.records import read_records, run_digest
from tests.conftest import ROOT

STEPS, EVERY = 16, 4  # a checkpoint every 4 steps
KILL_AFTER = 2 * EVERY  # kill once the step-8 checkpoint is on disk


def test_torchrun_workers_finds_the_training_processes_by_rank():
    # an agent with two "workers" (RANK set, launcher.train.loop on the command line) and a helper
    agent = subprocess.Popen([sys.executable, "-c", """
import os, subprocess, sys, time
sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
kids = [subprocess.Popen(sleep + ["launcher.train.loop"], env={**os.environ, "RANK": str(r)})
        for r in (0, 1)]
helper = subprocess.Popen(sleep, env={**os.environ, "RANK": "7"})
print(*[k.pid for k in kids], helper.pid, flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    pids = []
    try:
        pids = [int(x) for x in agent.stdout.readline().split()]
        assert torchrun_workers(agent.pid) == {0: pids[0], 1: pids[1]}
    finally:
        for pid in pids:
            subprocess.run(["kill", "-9", str(pid)])
        agent.kill()
        agent.wait()


def bench_cfg(tmp_path) -> tuple[BenchConfig, list[str]]:
    cfg = BenchConfig(workers=2, steps=STEPS, output_dir=str(tmp_path), max_restarts=3)
    overrides = ["model.config.num_hidden_layers=2", f"data.cache_dir={tmp_path / 'cache'}",
                 "data.synthetic_docs=500"]
    return cfg, overrides


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The failure-free run under torchrun, as the bench's `off` mode runs it."""
    cfg, overrides = bench_cfg(tmp_path_factory.mktemp("bench"))
    _, out = mode_recipe(cfg, overrides, "off")
    rc, kills, _ = run_torchrun(cfg, out)
    assert rc == 0 and kills == [], (out / "torchrun.log").read_text()[-3000:]
    return out


def newest_checkpoint(out) -> int:
    from checkpointless.worker.durable import latest
    found = latest(out / "checkpoints")
    return found[0] if found else 0


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, pytest.param(1, marks=pytest.mark.extended)])  # rank 1: make test-scale
def test_restart_resumes_from_the_newest_checkpoint_and_ends_with_the_failure_free_bits(
        tmp_path, reference, rank):
    cfg, overrides = bench_cfg(tmp_path)
    _, out = mode_recipe(cfg, overrides, "restart", tau_steps=EVERY)
    with open(out / "torchrun.log", "w") as log:
        agent = subprocess.Popen(torchrun_cmd(cfg, out, cfg.max_restarts), stdout=log,
                                 stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and agent.poll() is None:  # wait for a checkpoint to lose
            steps = [r["step"] for r in read_records(out)]
            if newest_checkpoint(out) >= KILL_AFTER and max(steps) >= KILL_AFTER + 1:
                break
            time.sleep(0.01)
        before = torchrun_workers(agent.pid)
        assert agent.poll() is None and sorted(before) == [0, 1], "no kill window"
        subprocess.run(["kill", "-9", str(before[rank])])
        t_kill = time.time()

        while time.time() < deadline:  # torchrun starts a fresh set of workers
            now = torchrun_workers(agent.pid)
            if len(now) == 2 and not set(now.values()) & set(before.values()):
                break
            time.sleep(0.05)
        else:
            pytest.fail("torchrun did not restart the workers")
        # the old workers are gone and the new ones have not trained yet: this is what they find
        resume_at = newest_checkpoint(out)
        assert resume_at >= KILL_AFTER  # a real resume, not a start from scratch
        assert agent.wait(timeout=max(1, deadline - time.time())) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()

    log = (out / "torchrun.log").read_text()
    assert re.search(rf"resumed from checkpoint .* at step {resume_at}\b", log), log[-3000:]
    records = read_records(out)
    after = [r for r in records if r["t_start"] >= t_kill]
    assert min(after, key=lambda r: r["t_start"])["step"] == resume_at
    assert sorted({r["step"] for r in after}) == list(range(resume_at, STEPS))
    assert sorted({r["step"] for r in records}) == list(range(STEPS))
    assert run_digest(out) == run_digest(reference) not in (None, "DISAGREE")
