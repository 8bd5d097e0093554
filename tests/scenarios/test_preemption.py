"""SIGTERM to a launcher (Slurm preemption, Ctrl-C is SIGINT) stops the whole job at one step
boundary with a durable checkpoint; a resume reaches the failure-free bits. Real processes."""
import json
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import ROOT, TINY_30, assert_same_bits, launcher_cmd, train

pytestmark = pytest.mark.slow
ARGS = (*TINY_30, "checkpoint.interval=100")


def test_sigterm_stops_every_process_with_a_checkpoint_and_a_resume_ends_with_the_same_bits(
        tmp_path, tiny_llama_30_steps_digest):
    want = tiny_llama_30_steps_digest  # checkpoints do not change the bits

    # as under Slurm, whose preemption signals every process of the job step at once: the
    # launcher, its workers and its spares (all of this session), not the launcher alone
    log = open(tmp_path / "run.log", "w")
    p = subprocess.Popen(launcher_cmd(tmp_path, tmp_path / "run", "tiny-llama", *ARGS),
                         cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                         env=dict(os.environ, SLURM_JOB_ID="4242"))
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 8:
        assert p.poll() is None and time.time() < deadline, (tmp_path / "run.log").read_text()
        time.sleep(0.2)
    step_wide = _session(p.pid)
    assert len(step_wide) >= 6  # the launcher, 4 workers and the spare at least
    for pid in step_wide:
        os.kill(pid, signal.SIGTERM)
    t0 = time.time()
    rc = p.wait(timeout=120)
    took = time.time() - t0
    text = (tmp_path / "run.log").read_text()
    assert rc == 143, text[-3000:]  # 128 + SIGTERM: stopped on request, resumable
    assert took < 20, took
    rep = json.loads((tmp_path / "run" / "report.json").read_text())
    assert rep["status"] == "preempted" and 8 <= rep["steps_completed"] < 30
    assert len(set(rep["params_sha256_by_rank"].values())) == 1
    saved = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))
    assert saved and saved[-1].name == f"step-{rep['steps_completed']:08d}"
    assert sorted(p.name for p in saved[-1].iterdir()) == \
        [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]  # each rank wrote its part
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert not [l for l in out.splitlines() if str(tmp_path / "run") in l]  # none left

    assert "lost (" not in text  # no worker died of the signal: nothing to recover

    _, resumed, _ = train(tmp_path, "run", "tiny-llama", *ARGS, "checkpoint.resume=auto",
                          timeout=300)
    assert_same_bits(resumed, want)


def _session(sid: int) -> list[int]:
    """Every process of session `sid` (the launcher's: its workers keep it, in groups of their
    own), the launcher first."""
    out = subprocess.run(["ps", "-eo", "pid=,sid="], capture_output=True, text=True).stdout
    pids = [int(a) for a, b in (line.split() for line in out.splitlines()) if int(b) == sid]
    return sorted(pids, key=lambda pid: pid != sid)
