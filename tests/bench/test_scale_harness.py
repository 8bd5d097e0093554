"""The control plane at a small scale: the real coordinator and node agents, simulated ranks
(launcher/bench/scale/harness.py), at a small size. A node's loss completes every phase, and the coordinator's steady
store calls do not grow with the ranks per node."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402


from tests.conftest import ROOT as _ROOT  # noqa: E402
ROOT = str(_ROOT)


def _measure(tmp_path, nodes: int, per_node: int) -> dict:
    out = tmp_path / f"scale-{nodes}x{per_node}.json"
    run = subprocess.run([sys.executable, "-m", "launcher.bench.scale", "--nodes", str(nodes),
                          "--ranks-per-node", str(per_node), "--spare-nodes", "2",
                          "--steady-s", "3", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and out.exists(), run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(out.read_text())[0]


# in `make test`, not `make test-fast`: two real coordinators and 20 real agents, about 40 s
@pytest.mark.slow
def test_a_node_loss_completes_every_phase_and_steady_calls_follow_nodes_not_ranks(tmp_path):
    one = _measure(tmp_path, 8, 1)
    four = _measure(tmp_path, 8, 4)
    for row in (one, four):
        for kind in ("rank_failure", "node_failure"):
            f = row[kind]
            assert "error" not in f, f
            assert f["lost_ranks"] == (1 if kind == "rank_failure" else row["ranks_per_node"])
            phases = [f["detect_s"], f["decide_s"], f["plan_to_every_rank_s"],
                      f["barrier_complete_s"]]
            assert all(p >= 0 for p in phases), f
            assert f["barrier_complete_s"] >= f["plan_to_every_rank_s"]
        for kind in ("rank_failure", "node_failure"):  # what a recovery cost, per node
            b = row[kind]["beyond_steady"]
            assert b["tcp_segments_per_node"] > 10 and b["cpu_ms_per_node"] > 0, b
            assert b["cpu_bound_s"] == pytest.approx(b["cpu_s"] / row["cores"], abs=1e-3)
        # a node is lost after node_timeout_s (3 s) without a new record, counted from the last
        # one seen (up to 0.75 s before the kill); a rank's exit is seen at once
        assert row["node_failure"]["detect_s"] > 2.0 > row["rank_failure"]["detect_s"]
    ops1, ops4 = one["steady"]["store_ops_per_s"], four["steady"]["store_ops_per_s"]
    # the same 10 nodes with four times the ranks: what reaches the coordinator stays put
    # (its per-rank share would quadruple it), while the nodes' own stores take the beats
    assert ops4 < 1.5 * ops1, (ops1, ops4)
    assert four["steady"]["node_store_ops_per_s_each"] > \
        2 * one["steady"]["node_store_ops_per_s_each"]


# in `make test`: a coordinator and one shard started, then given no time; about 5 s
@pytest.mark.slow
def test_a_size_that_cannot_start_says_why_and_exits_non_zero(tmp_path):
    out = tmp_path / "none.json"
    run = subprocess.run([sys.executable, "-m", "launcher.bench.scale", "--nodes", "2",
                          "--ranks-per-node", "1", "--start-timeout-s", "0", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0, run.stdout[-2000:]
    assert "did not all start within 0 s" in run.stdout and "connections" in run.stdout
    row = json.loads(out.read_text())[0]
    assert row["nodes"] == 2 and "did not all start" in row["error"]


def test_coordinator_connections_counts_what_the_store_server_accepted():
    from launcher.bench.scale.proc import coordinator_connections
    from checkpointless.protocol import membership
    server, own = membership.host("127.0.0.1")
    before = coordinator_connections(os.getpid(), server.port)
    clients = [membership.connect("127.0.0.1", server.port) for _ in range(3)]
    got = coordinator_connections(os.getpid(), server.port)
    # the server's end of each new connection; the clients' ends (other local ports) are not
    assert got["store"] - before["store"] == 3, (before, got)
    assert got["sockets"] - before["sockets"] == 6  # both ends of each, all in this process
    del clients, own, server


def test_a_threads_cpu_is_read_to_the_millisecond():
    """The harness sums the CPU of a few hundred threads per shard, each of which runs a few
    ms in a recovery: whole clock ticks (10 ms, /proc's stat) lost seconds in the sum."""
    import threading
    import time
    from launcher.bench.scale.proc import cpu_s
    got = {}

    def spin():
        while time.thread_time() < 0.015:  # a thread's CPU, from its own clock
            pass
        got["own"] = time.thread_time()
        got["read"] = cpu_s(os.getpid(), threading.get_native_id())

    t = threading.Thread(target=spin)
    t.start()
    t.join()
    # in ticks it would read 0.01 or 0.02, 5 ms off
    assert abs(got["read"] - got["own"]) < 0.002, got
