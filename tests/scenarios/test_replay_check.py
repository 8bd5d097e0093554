"""The replay rehearsal end to end, on the prefetching GPT loop of examples/: its port ends with
the failure-free bits under outside SIGKILLs mid-step; the README's change alone (the prefetch
kept) is caught at the second step, said under warn and stopped under strict, and its report
never claims the failure-free bits.

Real processes under `python -m checkpointless`; the kills are SIGKILLs from this test, at seeded
moments after rank 0 printed a step, wherever the victim is."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, final_digest, supervised
from tests.support.external_kill import is_worker

pytestmark = pytest.mark.slow  # real training processes; `make test-fast` skips them

PORT = ROOT / "examples/gpt_prefetch_checkpointless.py"
ENV = {"MAX_ITERS": "30", "LOG_INTERVAL": "1"}
DRAW = '        X, Y = get_batch("train")  # this step\'s batch, drawn in it: a redone step draws it again\n'
FORWARD = "        logits, loss = model(X, Y)\n"


def naive_port(tmp_path: Path) -> Path:
    """The port as the README's change alone leaves it: the original's prefetch kept."""
    text = PORT.read_text()
    assert DRAW + FORWARD in text and "for it in job.steps(" in text
    text = text.replace(DRAW + FORWARD, FORWARD + '        X, Y = get_batch("train")  # next\n')
    text = text.replace("for it in job.steps(", 'X, Y = get_batch("train")\nfor it in job.steps(')
    path = tmp_path / "gpt_prefetch_naive.py"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    rep = supervised(tmp_path_factory.mktemp("clean"), "clean", [PORT], "--spares", "0",
                     env=ENV)
    assert rep["recoveries"] == [] and rep["replay"]["replayable"] is True, rep["replay"]
    assert rep["replay"]["checked_at_step"] == 1
    assert "NOT guaranteed" not in rep["stderr"]
    return final_digest(rep)


def pids_of(wid: int) -> list[int]:
    """The live processes started as worker `wid` of a job run from this test's examples."""
    found = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            env = (p / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if is_worker(p, env, wid):
            found.append(int(p.name))
    return found


def test_the_port_keeps_the_failure_free_bits_under_outside_kills_mid_step(tmp_path, clean):
    """Worker 1 SIGKILLed some way into the step after rank 0 printed step 8, worker 2 after
    step 17 (seeded delays spread over a step): two recoveries, the failure-free bits, no
    replay mismatch."""
    rng = random.Random(59)
    moments = [(8, 1, rng.uniform(0, 0.15)), (17, 2, rng.uniform(0, 0.15))]
    report = tmp_path / "killed.json"
    out = open(tmp_path / "killed.out", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "checkpointless", "--nproc", "4", "--spares", "2", "--report",
         str(report), "--heartbeat-timeout", "3", str(PORT)], stdout=out,
        stderr=subprocess.STDOUT, cwd=ROOT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **ENV})
    killed = []
    try:
        deadline = time.time() + 200
        for step, wid, delay in moments:
            while f"iter {step}:" not in (tmp_path / "killed.out").read_text():
                assert proc.poll() is None and time.time() < deadline, "the run ended early"
                time.sleep(0.01)
            time.sleep(delay)
            pids = pids_of(wid)
            assert pids, f"no process of worker {wid} to kill"  # never a silent failure-free run
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            killed.append((step, wid, pids))
        assert proc.wait(timeout=200) == 0, (tmp_path / "killed.out").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        out.close()
    rep = json.loads(report.read_text())
    assert len(killed) == 2 and len(rep["recoveries"]) == 2, rep["recoveries"]
    assert final_digest(rep) == clean
    assert rep["replay"]["replayable"] is True and rep["replay"]["mismatches"] == []


def test_the_readme_change_alone_is_caught_at_the_second_step(tmp_path, clean):
    """warn: one message at step 1 naming the output and the prefetch; the run goes on, and its
    report says replayable false; strict: the run stops there with that reason."""
    naive = naive_port(tmp_path)
    rep = supervised(tmp_path, "warn", [naive], "--spares", "0", env=ENV)
    replay = rep["replay"]
    assert replay["replayable"] is False and replay["checked_at_step"] == 1, replay
    assert {m["what"] for m in replay["mismatches"]} >= {"output", "grads", "state"}
    assert {m["rank"] for m in replay["mismatches"]} == {0, 1, 2, 3}
    assert rep["stderr"].count("replay check FAILED at step 1") == 1
    assert "prefetch" in rep["stderr"] and "NOT guaranteed" in rep["stderr"]
    assert rep["steps_completed"] == 30 and rep["status"] == "ok"

    rep = supervised(tmp_path, "strict", [naive], "--spares", "1", "--replay-check", "strict",
                     env=ENV, expect_rc=1)
    assert rep["status"] == "failed" and "replay_check=strict" in rep["error"]
    assert rep["steps_completed"] <= 3 and rep["recoveries"] == []
    assert rep["replay"]["replayable"] is False
