"""No single point of failure (checkpointless.coordinator=etcd): 3 active nodes x 2 workers + 1
spare node, each node's launcher in its own network namespace on a bridge (addresses that exist
only there), the embedded etcd (one member in each of nodes 0..2), tiny-llama, gloo.

- node 0 killed mid-run (every process in its namespace SIGKILLed at once: its launcher, its
  workers, its etcd member and the coordinator's role with them): another launcher takes the
  role, node 0's ranks move to the spare node, and the run ends with the failure-free bits;
- node 0's link cut (a partition): the same, and once the link is back node 0's processes are
  gone and wrote nothing after the cut;
- nodes 1 and 2 killed (two of the three etcd members): a clean stop, nothing left running.

Skipped, saying why, without root, network namespaces or Debian's etcd-server (.ci/run installs
it)."""
import json
import os
import signal
import subprocess
import time

import pytest

from checkpointless.ha import member as etcd_member
from tests.support import netns
from tests.conftest import ROOT, assert_moved_or_hosted, launcher_cmd

# `make test-scale` (extended), not `make test`: about 5 min each on 2 cores (8 workers, 4
# launchers, 4 candidates and 3 etcd members), past make test's time budget
pytestmark = [pytest.mark.slow, pytest.mark.extended]

STEPS = 24
# OMP_WAIT_POLICY=PASSIVE: the four nodes here share this machine's two cores. A spare's warm-up
# checks that two CPU threads keep the bits (launcher/train/model_setup.py warm_up), and OpenMP's
# threads spin at every barrier while the six ranks hold the cores: node 3's spares took 20-40 s
# to be ready (about 4 s of CPU; a stack sampled then was in libgomp's barrier, in sgemm), so
# node 0 was killed before they were, its ranks were hosted by a shrink, and the job grew back
# at step 20 or 21 of 24, or not at all. Sleeping at the barrier, they are ready about 5 s after
# they start (1 s of CPU), before the kill.
ENV = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="eth0",
           RES_OPTIONS="timeout:1 attempts:1", OMP_WAIT_POLICY="PASSIVE")
JOB = ["distributed.num_nodes=3", "distributed.nproc_per_node=2", "checkpointless.spare_nodes=1",
       "checkpointless.spares=0", f"trainer.max_steps={STEPS}"]


def _skip_reason():
    if etcd_member.binary() is None:
        return "no etcd binary (Debian's etcd-server package; .ci/run installs it)"
    return netns.available()


@pytest.fixture
def nodes():
    why = _skip_reason()
    if why:
        pytest.skip(why)
    n = netns.Nodes(4)
    yield n
    n.close()


@pytest.fixture(scope="module")
def six_workers_digest(references):
    """The same recipe on one node x 6 workers, no failure: the bits every run here ends with."""
    _, rep, _ = references.train("tiny-llama", "distributed.num_processes=6",
                                 f"trainer.max_steps={STEPS}")
    return rep["params_sha256"]


def _launch(nodes, tmp_path, k: int, *extra):
    args = launcher_cmd(tmp_path, tmp_path / "out", "tiny-llama", *JOB, *extra,
                        f"distributed.node_rank={k}", "distributed.master_port=29400",
                        "checkpointless.coordinator=etcd", "checkpointless.confirm_s=12",
                        "checkpointless.etcd.member_hosts=" + ",".join(nodes.addrs[:3]))
    log = open(tmp_path / f"node{k}.log", "w")
    return nodes.popen(k, args, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT)


def _steps(tmp_path) -> int:
    path = tmp_path / "out" / "metrics.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if '"step"' in line)


def _logs(tmp_path) -> str:
    return "\n".join(f"--- node {k}\n" + (tmp_path / f"node{k}.log").read_text()[-2500:]
                     for k in range(4) if (tmp_path / f"node{k}.log").exists())


def _wait_steps(tmp_path, n: int, procs, timeout_s=300.0):
    deadline = time.time() + timeout_s
    while _steps(tmp_path) < n:
        assert time.time() < deadline, _logs(tmp_path)
        assert all(p.poll() is None for p in procs), ([p.returncode for p in procs],
                                                      _logs(tmp_path))
        time.sleep(0.2)


def _kill_node(nodes, k: int) -> None:
    for pid in nodes.pids(k):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _check_moved_run(tmp_path, digest):
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["params_sha256"] == digest, (rep["recoveries"], _logs(tmp_path))
    assert len(set(rep["params_sha256_by_rank"].values())) == 1
    moves = rep["coordinator_moves"]
    assert moves[0]["node"] == 0 and moves[0].get("start")
    assert len(moves) == 2 and moves[1]["node"] in (1, 2, 3) and moves[1]["from_node"] == 0
    assert moves[1]["token"] > moves[0]["token"]
    recs = rep["recoveries"]
    assert sorted(r["failed_rank"] for r in recs) == [0, 1]
    assert_moved_or_hosted(rep, {("node_lost", 0, 3)}, 6)
    # the record counts from the launch, not from the takeover (control/ledger.py): the steps
    # node 0's coordinator recorded before the kill are in (less its last second's at most)
    assert rep["steps_completed"] == STEPS and rep["steps_this_launch"] >= STEPS - 5, (
        rep["steps_this_launch"], rep["goodput"])
    print(f"step records in the report: {rep['steps_this_launch']} of {STEPS}; goodput "
          f"{rep['goodput']}")
    return rep


def test_node_0_killed_mid_run_the_role_moves_and_the_run_ends_with_the_same_bits(
        tmp_path, nodes, six_workers_digest):
    procs = [_launch(nodes, tmp_path, k) for k in range(4)]
    try:
        _wait_steps(tmp_path, 8, procs)
        t_kill = time.time()
        _kill_node(nodes, 0)
        for k in (1, 2, 3):
            assert procs[k].wait(timeout=300) == 0, _logs(tmp_path)
        # every process of the job ends with its launcher (those that die with it by their
        # death signal a moment later), looked at before the kills below
        deadline = time.time() + 10
        while any(nodes.pids(k) for k in (1, 2, 3)) and time.time() < deadline:
            time.sleep(0.1)
        left = {k: nodes.pids(k) for k in (1, 2, 3)}
    finally:
        for k in range(4):
            _kill_node(nodes, k)
    assert left == {1: [], 2: [], 3: []}
    rep = _check_moved_run(tmp_path, six_workers_digest)
    move = rep["coordinator_moves"][1]
    # the lease (3 s, renewed once if node 0 held etcd's leadership), a look, the candidate
    assert move["t_taken"] - t_kill < 3 + 3 + 1 + 5, move
    print(f"the role moved to node {move['node']} {move['t_taken'] - t_kill:.2f} s after the "
          f"kill; {move['detect_to_taken_s']} s after a node first saw the coordinator gone")
    # etcd's data stayed in the output folder
    assert sorted(p.name for p in (tmp_path / "out" / "etcd").iterdir() if p.is_dir()) == [
        "node0", "node1", "node2"]


def _step_lines(tmp_path) -> list[int]:
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if '"step"' in line]


def test_node_0_cut_off_the_role_moves_and_node_0_comes_back_to_nothing(
        tmp_path, nodes, six_workers_digest):
    procs = [_launch(nodes, tmp_path, k) for k in range(4)]
    try:
        _wait_steps(tmp_path, 8, procs)
        nodes.cut(0)  # its bridge port down: packets dropped, no connection reset
        for k in (1, 2, 3):
            assert procs[k].wait(timeout=300) == 0, _logs(tmp_path)
        report = (tmp_path / "out" / "report.json").read_text()
        steps = _step_lines(tmp_path)
        nodes.heal(0)
        # cut off from etcd's majority, node 0 gave up by itself: its coordinator lost its lease
        # and its agent could no longer reach etcd; whatever was left ends now
        assert procs[0].wait(timeout=60) != 0
        deadline = time.time() + 30
        while nodes.pids(0) and time.time() < deadline:
            time.sleep(0.2)
        assert nodes.pids(0) == []
    finally:
        for k in range(4):
            _kill_node(nodes, k)
    assert (tmp_path / "out" / "report.json").read_text() == report  # node 0 wrote nothing
    assert _step_lines(tmp_path) == steps
    assert sorted(set(steps)) == list(range(STEPS))  # every step logged
    _check_moved_run(tmp_path, six_workers_digest)
    log0 = (tmp_path / "node0.log").read_text()
    assert "lost the coordinator's role" in log0, log0[-3000:]


@pytest.mark.extended  # in make test-scale, not make test (its time budget)
def test_losing_two_of_the_three_etcd_members_stops_cleanly_with_the_checkpoint_intact(
        tmp_path, nodes):
    procs = [_launch(nodes, tmp_path, k, "checkpoint.interval=4") for k in range(4)]
    try:
        _wait_steps(tmp_path, 10, procs)
        _kill_node(nodes, 1)
        _kill_node(nodes, 2)
        for k in (0, 3):
            assert procs[k].wait(timeout=120) != 0, _logs(tmp_path)
        for k in range(4):
            assert nodes.pids(k) == []  # no process left on any node
    finally:
        for k in range(4):
            _kill_node(nodes, k)
    logs = _logs(tmp_path)
    assert "checkpoint.resume=auto" in logs, logs
    from checkpointless.worker import durable
    step, path = durable.latest(tmp_path / "out" / "checkpoints")
    assert step >= 4 and path.exists()


@pytest.mark.parametrize("gap_s", [0.3])
def test_the_coordinators_node_lost_inside_a_recovery_the_run_ends_with_the_same_bits(
        tmp_path, nodes, six_workers_digest, gap_s):
    """Rank 2 (on node 1) killed at step 8 (faults), then `gap_s` later, while that recovery is
    in flight (its plan being published, node 1's spare joining, the state moving), node 0 with
    the coordinator's role: the next coordinator finishes rank 2's recovery and moves node 0's
    ranks to the spare node. One spare process per node, so rank 2's stays on node 1."""
    # stragglers only reported: twelve workers on two cores make one now and then
    procs = [_launch(nodes, tmp_path, k, "checkpointless.spares=1", "faults=[kill:2:8]",
                     "checkpointless.straggler.action=report") for k in range(4)]
    try:
        _wait_steps(tmp_path, 8, procs)
        deadline = time.time() + 60
        while "injecting kill at rank 2" not in (tmp_path / "node1.log").read_text():
            assert time.time() < deadline, _logs(tmp_path)
            time.sleep(0.01)
        time.sleep(gap_s)
        _kill_node(nodes, 0)
        for k in (1, 2, 3):
            assert procs[k].wait(timeout=300) == 0, _logs(tmp_path)
    finally:
        for k in range(4):
            _kill_node(nodes, k)
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["status"] == "ok" and rep["params_sha256"] == six_workers_digest, (
        rep.get("recoveries"), rep.get("failures"), _logs(tmp_path))
    assert len(set(rep["params_sha256_by_rank"].values())) == 1
    assert len(rep["coordinator_moves"]) == 2
    # node 0's ranks once; rank 2 once or twice: the fault's claim lived in the lost
    # coordinator's store, so the replacement redoing step 8 may meet it again after the
    # takeover (seen here: a second loss of rank 2 inside the same recovery, also recovered)
    assert {f["rank"] for f in rep["failures"]} == {0, 1, 2}, rep["failures"]
