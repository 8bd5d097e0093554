"""The failure paths that are easy to get wrong, on real processes with a small plain-torch loop:
a user's own error with a misleading message, a second failure during a recovery, a spare that
never becomes ready, a worker that dies before it joins, and a run with checkpointless off.
Each recovered run ends with the bits of the failure-free run."""
import pytest

from tests.conftest import ROOT, assert_same_bits, final_digest, supervised

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests/support/scripts/small_loop.py"
OPTIONS = ("--heartbeat-timeout", "3")


def run(tmp_path, *args, expect_rc=0, timeout=180, **env):
    """small_loop.py under the supervisor, 4 workers; `env` breaks it (see the script)."""
    return supervised(tmp_path, "report", [SCRIPT], *OPTIONS, *args, expect_rc=expect_rc,
                      timeout=timeout, env=dict(env, MARKER_DIR=str(tmp_path)))


@pytest.fixture
def clean_digest(references):
    """The failure-free run of small_loop.py (trained once per session)."""
    return final_digest(references.supervised([SCRIPT], *OPTIONS))


def test_own_error_with_a_misleading_message_is_replaced_within_seconds(tmp_path, clean_digest):
    # rank 1 raises in the second generation (a kill came first): it has built two groups
    rep = run(tmp_path, "--spares", "2", "--fault", "kill:2:3", RAISE_AT="1:6")
    assert_same_bits(rep, clean_digest)
    kill, rec = rep["recoveries"]
    assert kill["failed_rank"] == 2
    assert rec["cause"] == "error" and rec["failed_rank"] == 1 and rec["failed_at_step"] == 6
    assert "timed out reading shard 7" in rec["error"]  # its own message, in report.json
    assert rec["recovery_s"] < 5.0  # never a process-group timeout
    assert "rank 1 raised:" in rep["stdout"] and "timed out reading shard 7" in rep["stdout"]
    # one traceback, printed once, by the supervisor; none of torch's "[rank1]: " wrappers
    said = rep["stdout"].split("\n{")[0] + rep["stderr"]  # the report's JSON follows the log
    assert said.count("RuntimeError: timed out reading shard 7") == 1 and "[rank1]:" not in said
    assert "waitForInput" not in rep["stderr"]  # no c10d noise while waiting


def test_own_error_again_at_the_same_step_stops_the_run_with_its_message(tmp_path):
    rep = run(tmp_path, "--spares", "1", RAISE_AT="1:6", RAISE_ALWAYS="1", expect_rc=1)
    assert "raised an error again" in rep["stderr"]
    assert "timed out reading shard 7" in rep["stderr"]
    assert rep["status"] == "failed" and "timed out reading shard 7" in rep["error"]
    assert [f["cause"] for f in rep["failures"]] == ["error", "error"]
    assert rep["took_s"] < 90  # stopped promptly, not after a process-group timeout


def test_a_spare_whose_node_check_fails_is_skipped_for_the_next(tmp_path, clean_digest):
    bad = '[ "$CL_WORKER_ID" != 4 ] || { echo "GPU 0: uncorrected ECC errors"; exit 1; }'
    rep = run(tmp_path, "--spares", "2", "--health-command", bad, "--fault", "kill:1:5",
              WAIT_READY="4,5")  # both spares ready (4 unhealthy) before the kill
    assert_same_bits(rep, clean_digest)
    (rec,) = rep["recoveries"]
    assert rec["failed_rank"] == 1 and rec["replacement_worker"] == 5  # not 4
    assert "spare worker 4 is unhealthy" in rep["stdout"]
    assert "spare worker 4 (node 0) is not promoted: its node is unhealthy (health command" \
        in rep["stdout"] and "uncorrected ECC errors" in rep["stdout"]


def test_the_replacement_killed_while_it_receives_the_state(tmp_path, clean_digest):
    rep = run(tmp_path, "--spares", "1", "--fault", "kill:2:5", "--fault", "kill:2:5@receive")
    assert_same_bits(rep, clean_digest)
    assert [f["rank"] for f in rep["failures"]] == [2, 2]
    assert "(receive)" in rep["stdout"]
    assert rep["recoveries"] and rep["recoveries"][-1]["resumed_step"] == 5


def test_the_sender_killed_midway_through_sending_the_state(tmp_path, clean_digest):
    """Rank 2 lost at step 5; rank 0, the survivor sending its state to rank 2's replacement,
    is killed after the sizes and skeleton and before the payload: the replacement's receive
    fails, and the next plan gives rank 0 to a second spare; both receive from the others."""
    rep = run(tmp_path, "--spares", "2", "--fault", "kill:2:5", "--fault", "kill:0:5@send")
    assert_same_bits(rep, clean_digest)
    assert sorted(f["rank"] for f in rep["failures"]) == [0, 2]
    assert "(send)" in rep["stdout"]
    assert rep["recoveries"][-1]["resumed_step"] == 5
    for r in (1, 3):  # the other survivors kept their processes throughout
        assert rep["pids_at_start"][str(r)] == rep["pids_at_end"][str(r)]


def _kill_when_it_appears(marker: str, worker_id: int, stop, killed: list) -> None:
    """SIGKILL worker `worker_id` of the run whose environment holds `marker`, as soon as its
    process exists (a spare still warming up: imports, model, no rank)."""
    import os
    import signal
    import time
    from pathlib import Path
    want = {f"CL_WORKER_ID={worker_id}".encode(), marker.encode()}
    while not stop.is_set():
        for p in Path("/proc").iterdir():
            if not p.name.isdigit():
                continue
            try:
                env = set((p / "environ").read_bytes().split(b"\0"))
            except OSError:
                continue
            if want <= env:
                os.kill(int(p.name), signal.SIGKILL)
                killed.append(int(p.name))
                return
        time.sleep(0.005)


def test_a_spare_lost_while_it_warms_up_is_refilled_without_touching_the_job(tmp_path,
                                                                             clean_digest):
    """The only spare SIGKILLed from outside as soon as its process exists; a refill takes its
    place, and takes rank 2 when it dies at step 8. The job's ranks never noticed the spare."""
    import threading
    stop, killed = threading.Event(), []
    t = threading.Thread(target=_kill_when_it_appears,
                         args=(f"MARKER_DIR={tmp_path}", 4, stop, killed), daemon=True)
    t.start()
    try:
        rep = run(tmp_path, "--spares", "1", "--fault", "kill:2:8")
    finally:
        stop.set()
    assert killed, "the spare was never seen"
    assert_same_bits(rep, clean_digest)
    assert "spare worker 4 exited" in rep["stdout"]
    assert [f["rank"] for f in rep["failures"]] == [2]  # the spare's loss is not the job's
    (rec,) = rep["recoveries"]
    assert rec["replacement_worker"] == 5  # the refill
    for r in (0, 1, 3):
        assert rep["pids_at_start"][str(r)] == rep["pids_at_end"][str(r)]


def test_a_survivor_killed_while_the_new_group_forms(tmp_path, clean_digest):
    rep = run(tmp_path, "--spares", "2", "--fault", "kill:2:5", "--fault", "kill:1:5@regroup")
    assert_same_bits(rep, clean_digest)
    assert sorted(f["rank"] for f in rep["failures"]) == [1, 2]
    assert "(regroup)" in rep["stdout"]
    for r in (0, 3):  # the other survivors kept their processes throughout
        assert rep["pids_at_start"][str(r)] == rep["pids_at_end"][str(r)]


def test_a_spare_that_never_becomes_ready_stops_the_run_clearly(tmp_path):
    rep = run(tmp_path, "--spares", "1", "--spare-wait", "4", "--fault", "kill:2:5",
              STALL_SPARES="1", expect_rc=1)
    assert "no spare became ready within checkpointless.spare_wait_s=4 s" in rep["stderr"]
    assert rep["status"] == "failed" and rep["failures"][0]["rank"] == 2


def test_a_worker_that_dies_before_it_joins_stops_the_run_at_once(tmp_path):
    rep = run(tmp_path, "--spares", "1", CRASH_WORKER="2", expect_rc=1)
    assert "before it finished starting up" in rep["stderr"]
    assert "crashing before join" in rep["stdout"]
    assert rep["took_s"] < 60


@pytest.mark.extended  # in make test-scale (its time budget; policy.crash_loop in test_policy.py)
def test_a_replacement_crashing_at_start_up_again_and_again_stops_the_run(tmp_path):
    rep = run(tmp_path, "--spares", "1", "--fault", "kill:2:5", CRASH_REPLACEMENTS="1",
              expect_rc=1)
    assert "failed before completing its first step 2 times in a row" in rep["stderr"]
    assert "broken device" in rep["stderr"]  # the replacement's own error, not an exit code
    lost = [f for f in rep["failures"] if f["rank"] == 2]
    assert len(lost) == 3 and all(f["step"] == 5 for f in lost)  # the real step, not 0
    assert rep["took_s"] < 90


def test_a_script_that_keeps_torchs_ddp_wrapper_gets_one_clear_error(tmp_path):
    """The bare model protected, then wrapped in torch's DDP, as DDP scripts do: refused where
    the wrapper is built, before any step (not at the first failure), naming the drop-in."""
    rep = run(tmp_path, "--spares", "1", WRAP_DDP="after", expect_rc=1)
    said = rep["stderr"] + rep["stdout"]
    assert "torch.nn.parallel.DistributedDataParallel was built inside a checkpointless job" \
        in said and "checkpointless.DistributedDataParallel(model)" in said
    assert rep["recoveries"] == [] and len(rep["failures"]) <= 4  # no spare thrown at it
    assert all(f["cause"] == "error" for f in rep["failures"]) and rep["took_s"] < 60
    assert rep.get("steps_completed", 0) == 0


def test_an_unseeded_script_starts_from_rank_0s_state_and_its_replicas_stay_equal(tmp_path):
    """Each process builds a different model (no seed); the job starts every rank from rank
    0's state, as torch's DDP does when it is built, and a replacement after a kill receives it."""
    rep = run(tmp_path, "--spares", "1", "--consistency-every", "4", "--fault", "kill:1:6",
              UNSEEDED="1")
    final_digest(rep)  # every rank ended with one state
    assert [x["failed_rank"] for x in rep["recoveries"]] == [1]


def test_a_silently_corrupted_replica_is_caught_named_and_replaced(tmp_path, clean_digest):
    # a bit flips in rank 2's parameters at the start of step 8, where the check runs: the rank
    # is named, leaves, and its replacement receives the majority's state, so nothing of the
    # corruption reaches a gradient and the run ends with the failure-free bits
    rep = run(tmp_path, "--spares", "1", "--consistency-every", "4", "--fault", "corrupt:2:8")
    assert_same_bits(rep, clean_digest)
    (rec,) = rep["recoveries"]
    assert rec["cause"] == "diverged" and rec["failed_rank"] == 2 and rec["resumed_step"] == 8
    assert "rank 2's parameters differ from the majority's at step 8" in rec["error"]


def test_a_corruption_the_periodic_check_misses_fails_the_run_at_the_end(tmp_path):
    rep = run(tmp_path, "--spares", "1", "--consistency-every", "0", "--fault", "corrupt:2:8",
              expect_rc=1)
    assert "replicas disagree at the end of the run" in rep["stderr"]
    assert rep["status"] == "failed"


@pytest.fixture(scope="module")
def buckets_and_loader_workers(tmp_path_factory, references):
    """One run shared by the two tests below: the drop-in DDP with several buckets in flight and
    a DataLoader with 2 worker processes forked after join(); rank 2 killed at step 5, then (in
    the next generation, whose replacement forked its own loader workers) rank 1 raises at step
    10. Its reference: the failure-free run with the same buckets (their sums' order decides the
    bits; loader workers do not)."""
    clean = references.supervised([SCRIPT], *OPTIONS, env={"DDP_BUCKET_MB": "0.004"})
    tmp = tmp_path_factory.mktemp("buckets")
    rep = run(tmp, "--spares", "2", "--fault", "kill:2:5", "--fault", "raise:1:10",
              DDP_BUCKET_MB="0.004", LOADER_WORKERS="2")
    assert_same_bits(rep, clean)
    assert [(r["failed_rank"], r["cause"], r["resumed_step"]) for r in rep["recoveries"]] == \
        [(2, "exit", 5), (1, "error", 10)]
    return rep


def test_dataloader_workers_forked_after_join_do_not_stall_a_recovery(buckets_and_loader_workers):
    # DataLoader workers inherit the process group's sockets: the dead rank's children keep
    # its connections open, and a survivor closing its own copies would not release its peers.
    # A rank killed, then (in the next generation, whose replacement forked its own loader
    # workers) one that raises.
    for rec in buckets_and_loader_workers["recoveries"]:
        assert rec["recovery_s"] < 10.0  # not the process-group timeout


def test_the_drop_in_ddp_with_several_buckets_in_flight_recovers_a_kill(
        buckets_and_loader_workers):
    # several collectives per step: after the first fails no other may touch the broken group
    # (gloo aborts the process on stray bytes), and survivors redo the step from kept gradients
    rep = buckets_and_loader_workers
    rec = rep["recoveries"][0]
    assert rec["failed_rank"] == 2 and rec["ranks_reusing_grads"] == [0, 1, 3]
    # no survivor was lost on the way: the two injected failures only
    assert [f["rank"] for f in rep["failures"]] == [2, 1]


def test_a_worker_that_exits_cleanly_without_finishing_stops_the_job_with_that_said(tmp_path):
    """Exit code 0 before job.finish() is a script that left its loop, not a fault: the spare is
    not handed the rank (it would find no member holding the state), the job says why."""
    rep = run(tmp_path, "--spares", "1", expect_rc=1, timeout=120, MAX_STEPS="2",
              SKIP_FINISH="1")
    out = rep["stdout"] + rep["stderr"]
    assert "exited with code 0 without calling job.finish() (accelerator.end_training())" in out
    assert "no member of the new generation holds training state" not in out
    assert "this is a bug" not in out


def test_a_rank_killed_after_the_loop_or_on_its_way_out_ends_with_the_failure_free_bits(
        tmp_path, clean_digest):
    """Rank 2 killed after the last step, before finish(): the survivors, in finish()'s replica
    check or its barrier, recover; the replacement takes the rank after the loop and finishes
    with them. Rank 1 killed once finish() returned (its result in): nothing is lost, no
    recovery runs, and the run stands."""
    # both in one run: rank 2's recovery comes first (rank 1 waits for it in finish()), rank 1
    # dies once its finish() returned. Stragglers only reported: seen once in CI, a loaded
    # machine made rank 0 a straggler here and its eviction a second recovery (not what this
    # test is about)
    rep = run(tmp_path, "--spares", "1", "--straggler-action", "report",
              KILL_BEFORE_FINISH="2", KILL_AFTER_FINISH="1")
    assert_same_bits(rep, clean_digest)
    assert rep["status"] == "ok"
    (rec,) = rep["recoveries"]  # rank 2's: none for rank 1, killed after its result was in
    assert rec["failed_rank"] == 2 and rec["resumed_step"] == 16
    assert rep["killed_after_done"] == [1]
    assert "workers [1] were killed (signals [9]) after reporting their results" in \
        rep["stdout"] + rep["stderr"]
