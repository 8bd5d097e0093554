"""Workers and nodes lost from outside while the job starts up, each ending with the failure-free
bits.

Not through `faults` (their @init and @join phases are tests/scenarios/test_clustered_failures.py): a real
SIGKILL from this test, at a moment measured from when the victim's process appeared, wherever
it then is. Started as fresh interpreters (CHECKPOINTLESS_FORKSERVER=0) a worker spends its first
seconds importing torch and transformers, then builds its model, says it is ready, meets the
others at the first group, and runs the start-up agreement; the delays below spread over that.
Forked from the fork server, it is through all of it within about half a second.

A node lost at start-up: its launcher (and so its workers) killed a moment after its workers
appeared, before the first step, across three launchers on loopback ports (no namespaces).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import FSDP_12, ROOT, assert_same_bits, launcher_cmd
from tests.support.external_kill import steps_logged, worker_pids
from tests.scenarios.test_multinode import _launch, _port

DDP_12 = ("trainer.max_steps=12",)
FRESH = {"CHECKPOINTLESS_FORKSERVER": "0"}


def train_killing_at_start(tmp_path, name: str, victim: int, delay_s: float, *overrides,
                           env=None, timeout_s=400):
    """Train tiny-llama and SIGKILL worker `victim` `delay_s` after its process appeared.
    Returns (report, steps logged when it was killed, log text)."""
    out = tmp_path / name
    log_path = tmp_path / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(launcher_cmd(tmp_path, out, "tiny-llama", *overrides), cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, **(env or {})))
        try:
            deadline = time.time() + timeout_s
            while not (pids := worker_pids(out, victim)):
                assert proc.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.005)
            time.sleep(delay_s)
            steps_at_kill = steps_logged(out)
            for pid in worker_pids(out, victim):
                os.kill(pid, signal.SIGKILL)
            rc = proc.wait(timeout=max(1.0, deadline - time.time()))
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log_path.read_text()
    assert rc == 0, (delay_s, text[-4000:])
    return json.loads((out / "report.json").read_text()), steps_at_kill, text


# (strategy, delay after the victim's process appeared, fresh or forked)
MOMENTS = [(s, d, "fresh") for s in ("ddp", "fsdp") for d in (0.3, 2.0, 5.0, 9.0)] + \
          [(s, d, "forked") for s in ("ddp", "fsdp") for d in (0.05, 0.3)]


@pytest.mark.sweep
@pytest.mark.parametrize("strategy,delay,start", MOMENTS,
                         ids=[f"{s}-{d}s-{k}" for s, d, k in MOMENTS])
def test_sweep_a_worker_killed_from_outside_while_it_starts_up(tmp_path, references, strategy,
                                                              delay, start):
    runs = {"ddp": DDP_12, "fsdp": FSDP_12}[strategy]
    _, want, _ = references.train("tiny-llama", *runs)
    rep, steps_at_kill, log = train_killing_at_start(
        tmp_path, "start", 2, delay, *runs, "checkpointless.spares=1",
        env=FRESH if start == "fresh" else None)
    assert rep["status"] == "ok"
    assert_same_bits(rep, want, delay, start, steps_at_kill)
    if steps_at_kill == 0:  # it died before any step: a recovery at step 0
        assert [r["resumed_step"] for r in rep["recoveries"]] == [0], rep["recoveries"]


# ---- a whole node lost at start-up, across launchers (tests/scenarios/test_multinode.py's three)

def _node_workers_up(out, ids) -> bool:
    return all(worker_pids(out, w) for w in ids)


@pytest.mark.slow
def test_fsdp_a_node_lost_before_the_first_step_moves_to_the_spare_node_with_the_bits(
        tmp_path, fsdp_12_steps):
    """2 nodes x 2 workers and a spare node, fsdp: node 1's launcher and workers killed as soon
    as its workers exist, before any step (no copy of its slices exists anywhere, no checkpoint:
    the spare node's workers start from their own build). The bits of 1 node x 4."""
    _, want = fsdp_12_steps
    port, out = _port(), tmp_path / "out"
    procs = [_launch(tmp_path, k, port, *FSDP_12) for k in range(3)]
    try:
        deadline = time.time() + 240
        while not _node_workers_up(out, (2, 3)):  # node 1's workers: ranks 2 and 3
            assert time.time() < deadline and all(p.poll() is None for p in procs), \
                (tmp_path / "node0.log").read_text()[-3000:]
            time.sleep(0.01)
        assert steps_logged(out) == 0
        os.killpg(procs[1].pid, signal.SIGKILL)
        assert procs[0].wait(timeout=300) == 0, (tmp_path / "node0.log").read_text()[-3000:]
        assert procs[2].wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    rep = json.loads((out / "report.json").read_text())
    assert rep["status"] == "ok"
    assert_same_bits(rep, want)
    recs = rep["recoveries"]
    assert sorted(r["failed_rank"] for r in recs) == [2, 3], recs
    assert {(r["cause"], r["failed_node"], r["resumed_step"]) for r in recs} == {
        ("node_lost", 1, 0)}, recs
    # no copy of the lost slices existed: the replacements keep their own (seeded) builds
    assert "build" in {r["restored_from"] for r in recs}, recs
    assert "start from their replacement's own build of the step-0 state" in \
        (tmp_path / "node0.log").read_text()
