"""SIGTERM to a launcher (Slurm preemption, Ctrl-C is SIGINT) stops the whole job at one step
boundary with a durable checkpoint; a resume reaches the failure-free bits. Real processes."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow
ENV = dict(os.environ, HF_HUB_OFFLINE="1")
ARGS = ["tiny-llama", "trainer.max_steps=30", "trainer.progress_bar=false",
        "checkpoint.interval=100"]


def _cmd(tmp_path, name, *extra):
    return [sys.executable, "-m", "launcher", "train", *ARGS, f"run.output_dir={tmp_path / name}",
            f"data.cache_dir={tmp_path / 'cache'}", *extra]


def test_sigterm_stops_every_process_with_a_checkpoint_and_a_resume_ends_with_the_same_bits(
        tmp_path, tiny_llama_30_steps_digest):
    want = tiny_llama_30_steps_digest  # checkpoints do not change the bits

    log = open(tmp_path / "run.log", "w")
    p = subprocess.Popen(_cmd(tmp_path, "run"), cwd=ROOT, env=ENV, stdout=log,
                         stderr=subprocess.STDOUT, start_new_session=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 240
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 8:
        assert p.poll() is None and time.time() < deadline, (tmp_path / "run.log").read_text()
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
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

    resumed = subprocess.run(_cmd(tmp_path, "run", "checkpoint.resume=auto"), cwd=ROOT,
                             env=ENV, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((tmp_path / "run" / "report.json").read_text())["params_sha256"] == want
