"""A preemption under checkpointless.coordinator=etcd, real processes: 2 nodes x 2 workers on
loopback ports (each node's launcher an agent and a candidate for the coordinator's role), an etcd
cluster of three members of the test's own (tests/support/etcd_cluster.py), tiny-llama, 30 steps.

SIGTERM to node 0's launcher (the coordinator's node): every rank stops at one boundary, the
durable checkpoint is written once, both launchers exit 143 and leave nothing running; the same
launch again with checkpoint.resume=auto, in the same etcd under the same prefix (as a
resubmitted job would be), ends with the bits of the failure-free run of 1 node x 4 workers.
Skipped, saying why, without Debian's etcd-server."""
import json
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import ROOT, TINY_30, assert_same_bits, launcher_cmd
from tests.support.etcd_cluster import Cluster, _free_ports

# make test-scale (extended), not make test: about 100 s here beside its 30-step reference, and
# make test is past its time budget on this machine; the default coordinator's SIGTERM stays in
# make test (tests/scenarios/test_preemption.py)
pytestmark = [pytest.mark.slow, pytest.mark.extended]
ARGS = (*TINY_30, "checkpoint.interval=100", "distributed.num_nodes=2",
        "distributed.nproc_per_node=2", "checkpointless.spares=0",
        "checkpointless.coordinator=etcd", "checkpointless.etcd.node_addr=127.0.0.1")
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT),
           RES_OPTIONS="timeout:1 attempts:1")


@pytest.fixture
def etcd():
    cluster = Cluster()
    yield cluster
    cluster.close()


def _launch(tmp_path, etcd, port: int, tag: str, *extra) -> list[subprocess.Popen]:
    """Both nodes' launchers, their logs in tmp_path/<tag>.node<k>.log."""
    endpoints = ",".join(e.split("//", 1)[1] for e in etcd.endpoints)
    procs = []
    for k in range(2):
        args = launcher_cmd(tmp_path, tmp_path / "out", "tiny-llama", *ARGS, *extra,
                            f"distributed.node_rank={k}", f"distributed.master_port={port}",
                            f"checkpointless.etcd.endpoints={endpoints}")
        log = open(tmp_path / f"{tag}.node{k}.log", "w")
        procs.append(subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def _logs(tmp_path, tag: str) -> str:
    return "\n".join(f"--- {p.name}\n" + p.read_text()[-2500:]
                     for p in sorted(tmp_path.glob(f"{tag}.node*.log")))


def _steps(tmp_path) -> int:
    path = tmp_path / "out" / "metrics.jsonl"
    return path.read_text().count('"step"') if path.exists() else 0


def _end(procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_sigterm_under_etcd_stops_every_node_with_one_checkpoint_and_resumes_to_the_same_bits(
        tmp_path, etcd, tiny_llama_30_steps_digest):
    port, port2 = _free_ports(2)
    procs = _launch(tmp_path, etcd, port, "run")
    try:
        deadline = time.time() + 300
        while _steps(tmp_path) < 8:
            assert time.time() < deadline and all(p.poll() is None for p in procs), \
                _logs(tmp_path, "run")
            time.sleep(0.2)
        # node 0's candidate took the role first (the others wait a second a node)
        assert "node 0 holds the coordinator's role" in (tmp_path / "run.node0.log").read_text()
        procs[0].send_signal(signal.SIGTERM)
        t0 = time.time()
        codes = [p.wait(timeout=120) for p in procs]
        took = time.time() - t0
    finally:
        _end(procs)
    text = _logs(tmp_path, "run")
    assert codes == [143, 143], text  # every node: stopped on request, resumable
    assert took < 30, took
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["status"] == "preempted" and 8 <= rep["steps_completed"] < 30, rep["status"]
    assert rep["preempted"] == {"why": "SIGTERM on node 0",
                                "stopped_before_step": rep["steps_completed"]}
    assert len(set(rep["params_sha256_by_rank"].values())) == 1
    assert rep["recoveries"] == [] and "lost (" not in text  # nobody died of the signal
    # the checkpoint of the stop, written once: one directory, every rank's part, nothing
    # half-written beside it, and one rank 0 saying it wrote it
    ckpts = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step-{rep['steps_completed']:08d}"]
    assert sorted(p.name for p in (ckpts / f"step-{rep['steps_completed']:08d}").iterdir()) == \
        [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    logs = "".join(p.read_text() for p in tmp_path.glob("run.node*.log"))
    assert logs.count("checkpoint written; resume with checkpoint.resume=auto") == 1, text
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert not [line for line in out.splitlines() if str(tmp_path / "out") in line]
    print(f"SIGTERM to every launcher's exit: {took:.2f} s, stopped before step "
          f"{rep['steps_completed']}")

    # the same launch again: the ended job's keys in etcd are cleared, not refused
    procs = _launch(tmp_path, etcd, port2, "resume", "checkpoint.resume=auto")
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        _end(procs)
    assert codes == [0, 0], _logs(tmp_path, "resume")
    resumed = json.loads((tmp_path / "out" / "report.json").read_text())
    assert resumed["status"] == "ok" and resumed["steps_completed"] == 30
    assert "resumed from checkpoint" in (tmp_path / "resume.node0.log").read_text()
    assert_same_bits(resumed, tiny_llama_30_steps_digest)
