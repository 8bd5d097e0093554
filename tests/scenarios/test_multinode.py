"""Several nodes: one launcher per node, the coordinator in node 0's, a spare node, a whole node lost.

The nodes here are launcher processes on this machine talking over loopback ports (each node's
launcher and workers are their own processes; no network namespaces are made by these tests, so a
cut link, as opposed to a dead node, is not exercised). Real processes, tiny-llama, gloo.
"""
import json
import os
import signal
import socket
import subprocess
import time

import pytest

from tests.conftest import FSDP_12, ROOT, assert_moved_or_hosted, launcher_cmd

pytestmark = pytest.mark.slow

ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, node: int, port: int, *extra, command="train"):
    args = launcher_cmd(tmp_path, tmp_path / "out", "tiny-llama", "distributed.num_nodes=2",
                        "distributed.nproc_per_node=2", "checkpointless.spare_nodes=1",
                        "checkpointless.spares=0", f"distributed.master_port={port}",
                        "trainer.max_steps=30",
                        *([f"distributed.node_rank={node}"] if command == "train" else []),
                        *extra, command=command)
    log = open(tmp_path / (f"node{node}.log" if command == "train" else "coordinator.log"), "w")
    return subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _steps(tmp_path) -> int:
    path = tmp_path / "out" / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _job_processes(tmp_path) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [l for l in out.splitlines() if str(tmp_path) in l and "ps -eo" not in l]


def _wait_steps(tmp_path, n: int, procs, timeout_s=240.0):
    deadline = time.time() + timeout_s
    while _steps(tmp_path) < n:
        assert time.time() < deadline, (tmp_path / "node0.log").read_text()[-3000:]
        assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
        time.sleep(0.2)


def assert_node_1_moved_to_the_spare_node(tmp_path, rep) -> None:
    """Node 1's ranks (2 and 3) moved together to the spare node (2) in one new generation,
    detected within node_timeout_s (3 s) of the node's last beat and back soon after a spare was
    ready (on a loaded 2-core machine the spare node's workers may still be importing: that
    wait is its own phase, said in the log, not recovery work); nothing of the job is left."""
    recs = rep["recoveries"]
    assert sorted(r["failed_rank"] for r in recs) == [2, 3]
    assert_moved_or_hosted(rep, {("node_lost", 1, 2)}, 4)
    assert len({r["generation"] for r in recs}) == 1  # failed together, one new generation
    log = (tmp_path / "node0.log").read_text()
    assert "node 1 lost" in log
    assert all(r["detect_s"] < 3.0 + 1.0 for r in recs), [r["detect_s"] for r in recs]
    assert all(r["recovery_s"] - r["phases_s"]["spare_wait"] < 3.0 + 3.0 for r in recs), \
        [r["phases_s"] for r in recs]
    if any(r["phases_s"]["spare_wait"] > 0.5 for r in recs):
        assert "for a spare to warm up" in log, [r["phases_s"] for r in recs]
    assert not _job_processes(tmp_path)  # nothing of the job is left on any node


@pytest.fixture
def one_node_digest(tiny_llama_30_steps_digest):
    return tiny_llama_30_steps_digest  # the same recipe on 1 node x 4 workers


# in make test-scale, not make test (three launchers: its time budget). The same path, a node
# lost mid-step moving whole to the spare node in one generation, detected within node_timeout_s,
# nothing of the job left, runs in make test under fsdp x tp (test_tp_inside_each_node_..., which
# asserts the same of its recoveries), and under Slurm (test_slurm.py, ddp, these bits)
@pytest.mark.extended
def test_a_lost_node_moves_whole_to_the_spare_node_with_the_one_node_bits(tmp_path,
                                                                          one_node_digest):
    port = _port()
    procs = [_launch(tmp_path, k, port) for k in range(3)]
    try:
        _wait_steps(tmp_path, 12, procs)
        os.killpg(procs[1].pid, signal.SIGKILL)  # node 1's launcher; its workers die with it
        assert procs[0].wait(timeout=240) == 0, (tmp_path / "node0.log").read_text()[-3000:]
        assert procs[2].wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["params_sha256"] == one_node_digest  # 2 nodes x 2, a node lost = 1 node x 4
    assert len(set(rep["params_sha256_by_rank"].values())) == 1
    assert_node_1_moved_to_the_spare_node(tmp_path, rep)


@pytest.mark.extended  # in make test-scale, not make test (its time budget)
def test_a_slow_node_is_fenced_and_its_ranks_move_to_the_spare_node_with_the_one_node_bits(
        tmp_path, one_node_digest):
    port = _port()
    slow = "faults=[slow:2:5:3,slow:3:5:3]"  # both of node 1's ranks, from step 5
    procs = [_launch(tmp_path, k, port, slow) for k in range(3)]
    try:
        assert procs[0].wait(timeout=400) == 0, (tmp_path / "node0.log").read_text()[-3000:]
        assert procs[2].wait(timeout=30) == 0
        assert procs[1].wait(timeout=30) == 1  # fenced: its agent stopped its workers
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["params_sha256"] == one_node_digest
    assert sorted((s["rank"], s["action"], s["slow_node"]) for s in rep["stragglers"]) == [
        (2, "evicted", True), (3, "evicted", True)]
    assert {(r["cause"], r["failed_node"], r["replacement_node"]) for r in rep["recoveries"]} \
        == {("slow", 1, 2)}
    assert len({r["generation"] for r in rep["recoveries"]}) == 1  # moved together
    assert "every rank of node 1 is slow" in (tmp_path / "node0.log").read_text()
    assert "fenced by the coordinator (fenced: slow" in (tmp_path / "node1.log").read_text()
    assert not _job_processes(tmp_path)


@pytest.mark.extended  # in make test-scale, not make test (its time budget)
def test_losing_the_coordinator_stops_every_node_with_a_message(tmp_path):
    port = _port()
    procs = [_launch(tmp_path, k, port) for k in range(3)]
    try:
        _wait_steps(tmp_path, 5, procs)
        os.killpg(procs[0].pid, signal.SIGKILL)  # the coordinator's node
        t_kill = time.time()
        for p in procs[1:]:
            assert p.wait(timeout=3.0 + 5 + 30) != 0
        took = time.time() - t_kill
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert took < 3.0 + 5 + 10, took
    for k in (1, 2):
        assert "coordinator" in (tmp_path / f"node{k}.log").read_text()
    time.sleep(1)
    assert not _job_processes(tmp_path)


@pytest.mark.extended  # in make test-scale, not make test (its time budget)
def test_sigterm_to_one_nodes_launcher_stops_the_whole_job_at_one_boundary(tmp_path):
    port = _port()
    # two nodes, no spare node: what is tested is the stop, not a replacement
    procs = [_launch(tmp_path, k, port, "checkpoint.interval=100",
                     "checkpointless.spare_nodes=0") for k in range(2)]
    try:
        _wait_steps(tmp_path, 5, procs)
        procs[1].send_signal(signal.SIGTERM)  # preemption reaches node 1 first
        assert procs[0].wait(timeout=60) == 143, (tmp_path / "node0.log").read_text()[-3000:]
        assert procs[1].wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["status"] == "preempted" and "SIGTERM on node 1" in rep["preempted"]["why"]
    assert (tmp_path / "out" / "checkpoints" / f"step-{rep['steps_completed']:08d}" /
            ".metadata").exists()
    time.sleep(1)
    assert not _job_processes(tmp_path)


def lose_node_1(tmp_path, *extra, after_steps=6, spare_node_exits=False) -> dict:
    """2 nodes x 2 and a spare node; node 1's launcher and workers SIGKILLed 0.15 s into step
    `after_steps` (its compute, not its start). The report of the run that went on (with
    `spare_node_exits`, once the spare node's launcher, which took node 1's place, exited 0)."""
    port = _port()
    procs = [_launch(tmp_path, k, port, *extra) for k in range(3)]
    try:
        _wait_steps(tmp_path, after_steps, procs)
        time.sleep(0.15)
        os.killpg(procs[1].pid, signal.SIGKILL)
        assert procs[0].wait(timeout=240) == 0, (tmp_path / "node0.log").read_text()[-3000:]
        if spare_node_exits:
            assert procs[2].wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    return json.loads((tmp_path / "out" / "report.json").read_text())


@pytest.mark.extended  # in make test-scale, not make test (four launchers: its time budget)
@pytest.mark.parametrize("gap_s", [0.3, 1.0])
def test_a_node_lost_while_another_nodes_ranks_move_ends_with_the_one_node_bits(
        tmp_path, one_node_digest, gap_s):
    """2 nodes x 2 and two spare nodes: node 1 lost 0.15 s into step 6, then `gap_s` later node
    2, the first spare node (the one that takes node 1's ranks when it is ready first), while
    those ranks move: the other spare node takes them, the run keeps the one-node bits."""
    port = _port()
    procs = [_launch(tmp_path, k, port, "checkpointless.spare_nodes=2") for k in range(4)]
    try:
        _wait_steps(tmp_path, 6, procs)
        time.sleep(0.15)
        os.killpg(procs[1].pid, signal.SIGKILL)
        time.sleep(gap_s)
        os.killpg(procs[2].pid, signal.SIGKILL)
        assert procs[0].wait(timeout=300) == 0, (tmp_path / "node0.log").read_text()[-3000:]
        assert procs[3].wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["status"] == "ok" and rep["params_sha256"] == one_node_digest
    recs = rep["recoveries"]
    assert {r["failed_node"] for r in recs} >= {1}, recs
    assert all(r["replacement_node"] in (2, 3) or r.get("shrunk") for r in recs), recs
    if any(r.get("shrunk") for r in recs):  # see assert_moved_or_hosted
        assert rep["grows"][-1]["to_processes"] == 4, rep["grows"]
    assert not _job_processes(tmp_path)


# in make test-scale, not make test (its time budget): the same path, fsdp slices of a node lost
# mid-step restored from another node's memory with the one-node bits, runs in make test under tp
# (test_tp_inside_each_node_a_lost_node_takes_a_whole_tp_group_and_comes_back_with_the_bits:
# fsdp 2 across the nodes x tp 2 inside each, its slices from node 0's memory)
@pytest.mark.extended
def test_fsdp_across_nodes_restores_a_lost_nodes_slices_from_another_nodes_memory(
        tmp_path, fsdp_12_steps):
    rep = lose_node_1(tmp_path, *FSDP_12)
    recs = rep["recoveries"]
    assert sorted(r["failed_rank"] for r in recs) == [2, 3]
    # placement=auto across nodes: ranks 2 and 3's copies were on node 0 (ranks 0 and 1)
    assert {r["restored_from"] for r in recs} == {"peer_memory"}
    assert set(recs[0]["served"].values()) <= {0, 1}
    assert len(set(rep["params_sha256_by_rank"].values())) == 1
    # 2 nodes x 2 with a node lost mid-step = 1 node x 4 without a failure, to the bit
    assert rep["params_sha256"] == fsdp_12_steps[1]["params_sha256"]
    assert "(2 ranks of lost nodes, 0 processes)" in (tmp_path / "node0.log").read_text()


@pytest.mark.extended  # in make test-scale, not make test (its time budget)
def test_with_a_standalone_coordinator_losing_node_0_and_rank_0_is_recovered(tmp_path,
                                                                            one_node_digest):
    port = _port()
    coordinator = _launch(tmp_path, -1, port, command="coordinator")
    procs = [_launch(tmp_path, k, port, "distributed.standalone_coordinator=true")
             for k in range(3)]
    try:
        _wait_steps(tmp_path, 12, [coordinator] + procs)
        os.killpg(procs[0].pid, signal.SIGKILL)  # node 0, holding ranks 0 and 1
        assert coordinator.wait(timeout=240) == 0, (tmp_path / "coordinator.log").read_text()[-3000:]
    finally:
        for p in [coordinator] + procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["params_sha256"] == one_node_digest
    assert {(r["failed_rank"], r["cause"], r["failed_node"], r["replacement_node"])
            for r in rep["recoveries"]} == {(0, "node_lost", 0, 2), (1, "node_lost", 0, 2)}
    time.sleep(1)
    assert not _job_processes(tmp_path)


@pytest.mark.extended  # make test's time budget; a node lost whole stays in make test under
# fsdp (test_startup_kills.py) and Slurm (test_slurm.py), tp's kills in test_tensor_parallel.py
def test_tp_inside_each_node_a_lost_node_takes_a_whole_tp_group_and_comes_back_with_the_bits(
        tmp_path, references):
    """2 nodes x 2 workers, tp 2 inside each node (one tp group per node) x fsdp 2 across them:
    node 1's launcher and workers SIGKILLed mid-step take both ranks of a tp group; the spare
    node takes them at their (dp_shard, tp) coordinates, each slice sent from node 0's memory,
    and the run ends with the bits of the same tp run on one node without a failure."""
    tp = ("distributed.tp_size=2",)
    _, want, _ = references.train("tiny-llama", *FSDP_12, *tp)
    rep = lose_node_1(tmp_path, *FSDP_12, *tp, spare_node_exits=True)
    recs = rep["recoveries"]
    assert rep["parallelism"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1}
    assert_node_1_moved_to_the_spare_node(tmp_path, rep)
    assert {r["restored_from"] for r in recs} == {"peer_memory"}
    assert {r["failed_coordinates"]["dp_shard"] for r in recs} == {1}
    assert set(recs[0]["served"].values()) <= {0, 1}  # copies a node away
    assert len(set(rep["params_sha256_by_rank"].values())) == 1
    assert rep["params_sha256"] == want["params_sha256"]
    assert "(2 ranks of lost nodes, 0 processes)" in (tmp_path / "node0.log").read_text()
