"""Failures where they cluster: at start-up, and a second one inside a recovery.

One ddp run, four losses, each a real SIGKILL of a worker process: worker 2 before it says it
is ready (its imports done, nothing built: today's "start-up failure" window), rank 1 just after
every member met at the first group's barrier and before that group's rendezvous (so the others
wait for an address it never writes), rank 1's replacement's peers lose rank 3 at step 6, and
then rank 0 (a survivor) dies inside the recovery's own group rendezvous. Before the rendezvous
could be cut and torch's group counter was reset after a failed constructor, the last one cost
a 60 s stall and then the run. It must end with the failure-free bits.

Under fsdp a slice lost before the first step has no peer copy yet (the first snapshot's
exchange runs beside step 0): its replacement starts from its own build of that slice, the
recipe's seeded init, which is the lost rank's bit for bit (restore.py, _start_from_build).
"""
import pytest

from tests.conftest import FSDP_12, TINY_30, assert_same_bits, train

pytestmark = pytest.mark.slow


def test_losses_at_start_up_and_inside_a_recovery_end_with_the_failure_free_bits(
        tmp_path, tiny_llama_30_steps):
    """On the session's 30-step tiny-llama (its failure-free run shared with the other ddp
    fault tests, not a reference of its own: a launcher run costs about 20 s of start-up)."""
    faults = "faults=[kill:2:0@init,kill:1:0@join,kill:3:6,kill:0:6@join]"
    _, want, _ = tiny_llama_30_steps
    out, rep, r = train(tmp_path, "clustered", "tiny-llama", *TINY_30, faults,
                        "checkpointless.spares=4")
    log = r.stdout + r.stderr
    for phase in ("step 0 (init)", "step 0 (join)", "step 6 (join)"):
        assert phase in log, log[-3000:]
    assert rep["status"] == "ok"
    assert_same_bits(rep, want)
    recs = rep["recoveries"]
    assert [x["failed_worker"] for x in recs][:2] == [2, 1], recs
    assert {x["resumed_step"] for x in recs} == {0, 6}, recs
    assert all(x["restored_from"] == "peer_memory" for x in recs if x["resumed_step"] == 6)
    # no recovery waited out a timeout: the cut group failed at once
    assert max(x["recovery_s"] for x in recs) < 30, recs
    assert "[c10d]" not in log  # torch's C++ stack dumps of the closed connections


# in make test-scale, not make test (its time budget): fsdp slices lost before the first step
# starting from their replacements' seeded builds run in make test in test_startup_kills.py (a
# whole node lost before step 0, restored_from "build"); kills at @init and @join in the ddp run
# above; a kill in backward under fsdp in test_kill_anywhere.py
@pytest.mark.extended
def test_fsdp_slices_lost_before_the_first_step_start_from_the_seeded_build(tmp_path,
                                                                           fsdp_12_steps):
    """Rank 2 killed while building its model, rank 1 inside the first group's rendezvous: no
    member has trained, no copy of either slice exists, and no durable checkpoint has been written
    (the old path stopped the run with "no durable checkpoint"). Then rank 3 dies in step 0's
    backward, once the first snapshots may or may not have landed."""
    _, want = fsdp_12_steps
    faults = "faults=[kill:2:0@init,kill:1:0@join,kill:3:0@backward]"
    out, rep, r = train(tmp_path, "fsdp-start", "tiny-llama", *FSDP_12, faults,
                        "checkpointless.spares=3")
    log = r.stdout + r.stderr
    assert rep["status"] == "ok", log[-3000:]
    assert_same_bits(rep, want)
    recs = rep["recoveries"]
    assert {x["resumed_step"] for x in recs} == {0}, recs
    assert "build" in {x["restored_from"] for x in recs}, recs
    assert "start from their replacement's own build" in log
