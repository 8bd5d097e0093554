"""Under a real Slurm: slurmctld and three slurmd, each slurmd in its own network, hostname and
mount namespace (tests/support/slurm/cluster.sh), the job submitted with sbatch as a user would submit
examples/slurm/train.sbatch (its test twin, tests/support/slurm/train_twin.sbatch). tiny-llama, 2 active
nodes x 2 workers + 1 spare node. Needs root and Debian's slurmctld, slurmd, slurm-client and
munge (.ci/run installs them); skipped, saying why, where they cannot run."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.slurm]
CLUSTER = ROOT / "tests/support/slurm/cluster.sh"
TWIN = ROOT / "tests/support/slurm/train_twin.sbatch"


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "munged", "ip", "unshare")
               if shutil.which(b) is None]
    if missing:
        pytest.skip(f"no Slurm here: {', '.join(missing)} not installed (apt-get install "
                    "slurmctld slurmd slurm-client munge)")
    if os.geteuid() != 0:
        pytest.skip("no Slurm here: the test cluster's namespaces need root")
    where = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(["bash", str(CLUSTER), "up", str(where), "3"], capture_output=True,
                        text=True, timeout=120)
    if up.returncode != 0:
        subprocess.run(["bash", str(CLUSTER), "down", str(where)], timeout=60)
        pytest.skip(f"the test Slurm did not start: {up.stderr[-800:]}")
    env = dict(os.environ, SLURM_CONF=str(where / "slurm.conf"), HF_HUB_OFFLINE="1",
               PYTHONPATH=str(ROOT), PY=sys.executable)
    try:
        yield env
    finally:
        subprocess.run(["bash", str(CLUSTER), "down", str(where)], timeout=60)


def _submit(env, tmp_path, name, *overrides) -> str:
    out = tmp_path / name
    job_env = dict(env, OUT=str(out), CACHE=str(tmp_path.parent / "data-cache"))
    r = subprocess.run(["sbatch", "--parsable", "-o", str(tmp_path / f"{name}.log"), str(TWIN),
                        *overrides], capture_output=True, text=True, env=job_env, cwd=ROOT,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def _state(env, job: str) -> str:
    r = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True,
                       env=env, timeout=10)
    return r.stdout.strip()


def _wait(env, job: str, timeout_s=300):
    deadline = time.time() + timeout_s
    while _state(env, job):
        assert time.time() < deadline, f"job {job} still {_state(env, job)}"
        time.sleep(0.5)


def _wait_steps(out, n: int, timeout_s=240):
    deadline = time.time() + timeout_s
    path = out / "metrics.jsonl"
    while not path.exists() or len(path.read_text().splitlines()) < n:
        assert time.time() < deadline, "the job did not reach step %d" % n
        time.sleep(0.2)


def _node_processes(node: int, needle: str) -> list[int]:
    """The processes of the test cluster's node `node` (its network namespace) whose command
    line holds `needle`."""
    ns = f"clsn{node}"
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    found = []
    for pid in pids.split():
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if needle in cmdline:
            found.append(int(pid))
    return found


def test_sbatch_survives_a_nodes_tasks_killed_with_the_failure_free_bits(
        slurm, tmp_path, tiny_llama_30_steps_digest):
    job = _submit(slurm, tmp_path, "kill", "trainer.max_steps=30")
    out = tmp_path / "kill"
    _wait_steps(out, 10)
    victims = _node_processes(2, str(out))  # node rank 1: its launcher and its workers
    assert len(victims) >= 3, victims
    for pid in victims:
        os.kill(pid, 9)
    _wait(slurm, job)
    log = (tmp_path / "kill.log").read_text()
    rep = json.loads((out / "report.json").read_text())
    assert rep["status"] == "ok", log[-3000:]
    assert rep["params_sha256"] == tiny_llama_30_steps_digest, log[-3000:]  # = 1 node x 4
    # the spare node takes node 1's ranks; or, not ready yet at the kill, the survivors host
    # them (a shrink, shrink=exact being ddp's default) until it is: the same bits either way
    recs = rep["recoveries"]
    assert {(r["cause"], r["failed_node"]) for r in recs} == {("node_lost", 1)}, recs
    assert all(r["replacement_node"] == 2 or r.get("shrunk") for r in recs), recs
    assert bool(rep.get("shrinks")) == any(r.get("shrunk") for r in recs), rep.get("shrinks")
    assert "Slurm (SLURM_NNODES - 1 spare node(s))" in log  # its place, read from srun's env


@pytest.mark.extended  # in make test-scale, not make test (its time budget); the workers'
# SIGTERM handling under Slurm stays in make test through tests/scenarios/test_preemption.py
def test_a_term_preemption_stops_in_order_and_the_resubmitted_job_ends_with_the_bits(
        slurm, tmp_path, tiny_llama_30_steps_digest):
    args = ("trainer.max_steps=30", "checkpoint.interval=100", "checkpoint.resume=auto")
    job = _submit(slurm, tmp_path, "run", *args)
    out = tmp_path / "run"
    _wait_steps(out, 8)
    # what a preemption does: SIGTERM to every process of the job's steps, workers included
    subprocess.run(["scancel", "--signal=TERM", job], env=slurm, check=True, timeout=10)
    _wait(slurm, job, timeout_s=120)
    log = (tmp_path / "run.log").read_text()
    rep = json.loads((out / "report.json").read_text())
    assert rep["status"] == "preempted" and 8 <= rep["steps_completed"] < 30, log[-3000:]
    assert "lost (" not in log  # no worker died of the signal
    saved = sorted((out / "checkpoints").glob("step-*"))
    assert saved and saved[-1].name == f"step-{rep['steps_completed']:08d}"
    assert not any(_node_processes(k, str(out)) for k in (1, 2, 3))  # nothing left anywhere
    job = _submit(slurm, tmp_path, "run", *args)  # resubmitted as is: resume=auto
    _wait(slurm, job)
    rep = json.loads((out / "report.json").read_text())
    assert rep["status"] == "ok" and rep["params_sha256"] == tiny_llama_30_steps_digest, \
        (tmp_path / "run.log").read_text()[-3000:]
