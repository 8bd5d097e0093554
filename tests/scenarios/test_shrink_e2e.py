"""No spare left (checkpointless.shrink): tiny-llama on 4 workers under ddp, ranks killed with
no spare ready; the survivors host the lost logical ranks and the run ends with the bits of the
same recipe's failure-free run, on fewer processes, then grows back when a refill is ready.
Real processes on gloo, killed inside their backward and from outside mid-step."""
import json

import pytest

from tests.conftest import TINY_30, assert_same_bits, train
from tests.support.external_kill import seeded_moments, train_killing

pytestmark = pytest.mark.slow

EXACT_16 = ("trainer.max_steps=16", "checkpointless.shrink=exact")


def test_a_kill_with_no_spare_shrinks_onto_three_processes_with_the_failure_free_bits(
        tmp_path, references):
    """Rank 0 SIGKILLs itself inside its backward at step 5, then worker 3 is SIGKILLed from
    outside at a seeded moment: no spare, no refill, so survivors host the lost logical ranks
    (4 -> 3 -> 2 processes) and every step after is the failure-free run's to the bit. The
    survivor numbered process 0 from then on writes the metrics."""
    _, ref, _ = references.train("tiny-llama", *EXACT_16)
    out, rep, kills, log = train_killing(
        tmp_path, "shrink", "tiny-llama", seeded_moments(40, [9]), *EXACT_16,
        "checkpointless.spares=0", "checkpointless.refill=false", "faults=[kill:0:5@backward]",
        victims=[3])
    assert rep["status"] == "ok", log[-3000:]
    assert_same_bits(rep, ref, kills)
    shrinks = rep["shrinks"]
    assert [(s["from_processes"], s["to_processes"]) for s in shrinks] == [(4, 3), (3, 2)], log
    assert shrinks[0]["logical_ranks_moved"] == [0]
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()
            if '"step"' in x][-1] == 15
    assert rep["grows"] == [] and rep["processes_at_end"] == 2
    assert "no spare ready" in log


def test_shrink_then_grow_back_when_the_refill_is_ready_with_the_same_bits(
        tmp_path, tiny_llama_30_steps):
    """The default (shrink=auto, exact under ddp), one spare, two kills a step apart: a kill
    that finds no spare ready (the first one's refill, or the launch's spare, still warming)
    shrinks the job; each refill, once warm, takes a hosted logical rank back (a grow), and the
    run ends on 4 processes with the failure-free bits. 30 steps: the refills have about 8 s
    to warm up after the kills (16 steps left them about 4, short on a loaded machine)."""
    _, ref, _ = tiny_llama_30_steps  # the session's 30-step reference, under the same default
    _, rep, r = train(tmp_path, "grow", "tiny-llama", *TINY_30, "checkpointless.spares=1",
                      "faults=[kill:1:3@backward,kill:2:4@random:3]")
    assert rep["status"] == "ok" and rep["shrink"] == {"mode": "exact"}
    assert_same_bits(rep, ref)
    shrinks, grows = rep["shrinks"], rep["grows"]
    assert shrinks and grows, r.stdout[-3000:]
    assert shrinks[0]["from_processes"] == 4 and grows[-1]["to_processes"] == 4
    moved_out = sorted(x for s in shrinks for x in s["logical_ranks_moved"])
    assert sorted(x for g in grows for x in g["logical_ranks_moved"]) == moved_out
    assert rep["processes_at_end"] == 4 and "spare ready: logical rank" in r.stdout


@pytest.mark.extended  # in make test-scale (make test's time budget): fast is ddp's old reduction
def test_fast_keeps_the_batch_and_says_the_bits_may_differ(tmp_path, references):
    """shrink=fast: today's collectives; after the shrink a survivor runs the lost rank's
    micro-batch too (the same batch), the loss stays the failure-free run's to rounding, and the
    report says the bits may differ."""
    _, ref, _ = references.train("tiny-llama", "trainer.max_steps=16")
    _, rep, r = train(tmp_path, "fast", "tiny-llama", "trainer.max_steps=16",
                      "checkpointless.shrink=fast", "checkpointless.spares=0",
                      "checkpointless.refill=false", "faults=[kill:2:6@optimizer]")
    assert rep["status"] == "ok" and rep["processes_at_end"] == 3
    assert [(s["from_processes"], s["to_processes"]) for s in rep["shrinks"]] == [(4, 3)]
    assert rep["shrink"]["mode"] == "fast" and "may differ" in rep["shrink"]["bits"]
    assert rep["final_loss"] == pytest.approx(ref["final_loss"], abs=1e-4)


@pytest.mark.extended
def test_a_second_loss_inside_the_shrinks_regroup_shrinks_again_with_the_same_bits(
        tmp_path, references):
    """Rank 2 killed at step 5 with no spare; while the survivors form the shrunk generation's
    group, the new process 0 is killed too: its logical ranks move again (4 -> 3 -> 2), and the
    run ends with the failure-free bits."""
    _, ref, _ = references.train("tiny-llama", *EXACT_16)
    _, rep, r = train(tmp_path, "regroup", "tiny-llama", *EXACT_16, "checkpointless.spares=0",
                      "checkpointless.refill=false", "faults=[kill:2:5,kill:0:5@regroup]")
    assert rep["status"] == "ok", r.stdout[-3000:]
    assert_same_bits(rep, ref)
    assert rep["processes_at_end"] == 2
    # logical rank 2 went to process 0 (the least loaded, lowest index), which then was lost
    assert [s["logical_ranks_moved"] for s in rep["shrinks"]] == [[2], [0, 2]], rep["shrinks"]


FSDP_EXACT = ("distributed.strategy=fsdp", "trainer.max_steps=12", "checkpoint.interval=4",
              "checkpoint.keep=3", "checkpointless.shrink=exact")


def test_fsdp_kills_with_no_spare_cut_the_slices_anew_and_keep_the_failure_free_bits(
        tmp_path, references):
    """fsdp, no spare: rank 0 SIGKILLs itself inside its backward at step 3, then rank 2 inside
    its optimizer step at step 10. Each shrink cuts every parameter's and optimizer state's
    slices anew for the processes left (the lost slice from its peer copy) on a model rebuilt
    for them, FSDP's reduce-scatter sums the logical ranks in order, and the run ends on 2
    processes with the bits of the failure-free fsdp run on 4."""
    _, ref, _ = references.train("tiny-llama", *FSDP_EXACT)
    _, rep, r = train(tmp_path, "fsdp", "tiny-llama", *FSDP_EXACT, "checkpointless.spares=0",
                      "checkpointless.refill=false",
                      "faults=[kill:0:3@backward,kill:2:10@optimizer]")
    assert rep["status"] == "ok", r.stdout[-3000:]
    assert_same_bits(rep, ref)
    assert [(s["from_processes"], s["to_processes"]) for s in rep["shrinks"]] == \
        [(4, 3), (3, 2)], r.stdout[-3000:]
    assert rep["processes_at_end"] == 2 and rep["shrink"] == {"mode": "exact"}
    assert [x["restored_from"] for x in rep["recoveries"]] == ["peer_memory"] * 2


@pytest.mark.extended
def test_fsdp_shrinks_and_grows_back_with_the_failure_free_bits(tmp_path, references):
    """fsdp, one spare, two kills in one step (the second in the redone step's optimizer
    step, a moment after the first recovery): the refill is not warm yet, so the job shrinks to
    3 processes; the refill, once warm, takes the logical rank back (a grow: every slice cut
    again for 4, the spare's included), with the failure-free bits. (Kills a step apart let a
    slow refill on a loaded machine be ready for the second: no shrink, seen once.)"""
    _shrinks_and_grows_back(tmp_path, references, "fsdp-grow", FSDP_EXACT,
                            "faults=[kill:1:3@backward,kill:2:3@optimizer]")


def _shrinks_and_grows_back(tmp_path, references, name: str, job: tuple, faults: str) -> None:
    """30 steps of `job` with one spare and `faults`: a shrink, then a grow back to 4, ending
    with the failure-free fsdp run's bits."""
    steps = ("trainer.max_steps=30",)
    _, ref, _ = references.train("tiny-llama", *FSDP_EXACT, *steps)
    _, rep, r = train(tmp_path, name, "tiny-llama", *job, *steps, "checkpointless.spares=1",
                      faults)
    assert rep["status"] == "ok", r.stdout[-3000:]
    assert_same_bits(rep, ref)
    assert rep["shrinks"] and rep["grows"], r.stdout[-3000:]
    assert rep["processes_at_end"] == 4


@pytest.mark.extended
def test_fsdp_a_slice_lost_with_its_holder_is_cut_anew_from_the_durable_checkpoint(
        tmp_path, references):
    """fsdp, no spare: ranks 1 and 2 SIGKILL themselves in the same backward (rank 1's copy
    lived on rank 2): no peer holds slice 1, so both survivors build their objects for 2
    processes and load the step-4 checkpoint, which DCP cuts for them; the failure-free bits."""
    _, ref, _ = references.train("tiny-llama", *FSDP_EXACT)
    _, rep, r = train(tmp_path, "fsdp-disk", "tiny-llama", *FSDP_EXACT, "checkpointless.spares=0",
                      "checkpointless.refill=false", "faults=[kill:1:6@backward,kill:2:6@backward]")
    assert rep["status"] == "ok", r.stdout[-3000:]
    assert_same_bits(rep, ref)
    assert rep["processes_at_end"] == 2
    assert "durable_checkpoint" in [x["restored_from"] for x in rep["recoveries"]]
    assert "no peer holds every lost slice" in r.stdout + r.stderr


HSDP_EXACT = (*(o.replace("=fsdp", "=hsdp") for o in FSDP_EXACT), "distributed.shard_size=2")


def test_hsdp_kills_with_no_spare_run_on_fewer_processes_with_fsdps_failure_free_bits(
        tmp_path, references):
    """hsdp (2 replica groups of 2), no spare: worker 0 is SIGKILLed from outside at a seeded
    moment of step 3 or 4, then rank 2 SIGKILLs itself inside its optimizer step at step 10.
    Under exact the reduce-scatter sums every logical rank over the whole world and hands each
    chunk to its twins, so the failure-free hsdp run has the fsdp run's bits; the first shrink
    leaves 3 processes, which no replica group divides: the slices are cut anew one per process
    (the lost chunk from its twin); the second finds no copy of a lost slice (hsdp keeps no
    peer copies) and cuts the step-8 checkpoint for the 2 left. The failure-free fsdp bits."""
    _, ref, _ = references.train("tiny-llama", *FSDP_EXACT)
    _, rep, kills, log = train_killing(
        tmp_path, "hsdp", "tiny-llama", seeded_moments(12, [3]), *HSDP_EXACT,
        "checkpointless.spares=0", "checkpointless.refill=false",
        "faults=[kill:2:10@optimizer]", victims=[0])
    assert rep["status"] == "ok", log[-3000:]
    assert_same_bits(rep, ref, kills)
    assert [(s["from_processes"], s["to_processes"]) for s in rep["shrinks"]] == \
        [(4, 3), (3, 2)], log[-3000:]
    assert rep["processes_at_end"] == 2 and rep["shrink"] == {"mode": "exact"}
    first, second = rep["recoveries"]
    assert first["restored_from"] == "peer_memory" and first["state_bytes"] > 0, first
    assert second["restored_from"] == "durable_checkpoint" and second["resumed_step"] == 8, \
        second
    # the first lost rank sat in the launch's 2 x 2 mesh; the second in a 1-D generation of 3
    assert first["failed_coordinates"] == {"dp_replicate": 0, "dp_shard": 0, "tp": 0}, first
    assert second["failed_coordinates"] is None, second


@pytest.mark.extended
def test_hsdp_a_whole_replica_group_lost_then_grown_back_with_the_failure_free_bits(
        tmp_path, references):
    """hsdp (2 x 2), one spare: both ranks of replica group 0 SIGKILL themselves in one
    backward (step 3). The spare may take one of them; what finds no spare ready is hosted by a
    survivor on a 1-D cut of its slices (two processes are one shard group: the model is built
    anew on the world's group, not the old shard group), and once the refills are warm the job
    grows back to 2 x 2 (each chunk cut for its position again, the spares' included), with
    the failure-free fsdp bits."""
    _shrinks_and_grows_back(tmp_path, references, "hsdp-grow", HSDP_EXACT,
                            "faults=[kill:0:3@backward,kill:1:3@backward]")


@pytest.mark.extended
def test_hsdp_a_whole_replica_group_lost_with_no_spare_leaves_one_shard_group(
        tmp_path, references):
    """hsdp (2 x 2), no spare: both ranks of replica group 0 SIGKILL themselves in one
    backward (step 5). The 2 left are one shard group already holding both chunks, but their
    model names the old shard group: it is built anew on the world's and the chunks cut for it
    (from the survivors' own state); the run ends on 2 processes with the fsdp bits."""
    _, ref, _ = references.train("tiny-llama", *FSDP_EXACT)
    _, rep, r = train(tmp_path, "hsdp-group", "tiny-llama", *HSDP_EXACT,
                      "checkpointless.spares=0", "checkpointless.refill=false",
                      "faults=[kill:0:5@backward,kill:1:5@backward]")
    assert rep["status"] == "ok", r.stdout[-3000:]
    assert_same_bits(rep, ref)
    assert rep["processes_at_end"] == 2, rep["shrinks"]
    assert all(x["restored_from"] == "peer_memory" for x in rep["recoveries"]), rep["recoveries"]
