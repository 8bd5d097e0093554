"""Workers SIGKILLed from outside, at seeded moments anywhere in a run, end with the failure-free
bits (tests/support/external_kill.py does the killing).

`faults` fire at points of the library's own code; a real failure strikes wherever the worker is:
in forward, inside a reduce-scatter or an all-reduce, in the optimizer step, during the replica
exchange, in the export after the last step, on the way out. The suite runs one fsdp job killed
three times (mid-run twice, once after its last step); `make test-sweep` runs many single kills
over a grid of seeded moments, under fsdp (with and without its memory savers), ddp and fsdp x tp 2.
"""
import pytest

from tests.conftest import FSDP_12, FSDP_SAVERS, assert_same_bits
from tests.support.external_kill import seeded_moments, train_killing

pytestmark = pytest.mark.slow


def test_fsdp_kills_inside_a_steps_compute_and_from_outside_end_with_the_failure_free_bits(
        tmp_path, fsdp_12_steps):
    """One fsdp run, five failures. Injected: rank 1 in backward after the last blocks
    reduce-scattered their gradients and before the first did (survivors then hold gradients of
    the interrupted pass in FSDP's unsharded parameters: the redo must not add to them), rank 2
    as its optimizer step begins (the others finish the step and roll back to their snapshot),
    rank 3 at a seeded random moment of its step. From outside: worker 4 (the spare that took
    rank 1) SIGKILLed at a seeded moment of a later step, and worker 5 (rank 2's) just after the
    last step, in the export or on its way out. No two neighbours on the ring are lost at once,
    so every slice keeps a copy in a peer's memory."""
    moments = seeded_moments(19, [10]) + [(12, 0.05)]  # one mid-step, one in the export
    out, rep, kills, log = train_killing(
        tmp_path, "anywhere", "tiny-llama", moments, *FSDP_12, "checkpointless.spares=4",
        "faults=[kill:1:3@backward,kill:2:6@optimizer,kill:3:8@random:1]", victims=[4, 5])
    for phase in ("(backward)", "(optimizer)", "(random: "):
        assert phase in log
    assert all(pid for _, _, pid in kills), kills  # each victim was alive when it was killed
    assert rep["status"] == "ok"
    assert_same_bits(rep, fsdp_12_steps[1], kills)
    recs = rep["recoveries"]
    assert [x["failed_worker"] for x in recs[:4]] == [1, 2, 3, 4]
    assert recs[0]["resumed_step"] == 3  # no survivor had applied step 3
    assert {x["restored_from"] for x in recs} == {"peer_memory"}
    # the last kill, after the last step, restores the final state the loop's end copied to
    # peers, or, striking while that copy is in flight, rolls back and redoes the last step;
    # or it finds worker 5 on its way out, its result in: nothing is lost
    if len(recs) == 5:
        assert recs[4]["resumed_step"] == 12 or \
            (recs[4]["resumed_step"], recs[4]["steps_redone"]) == (11, 1), recs[4]
    else:
        assert rep["killed_after_done"] == [5], rep
    assert rep["steps_completed"] == 12
    assert (out / "model" / "model.safetensors.index.json").exists()


RUNS = {"fsdp": FSDP_12, "fsdp-savers": FSDP_12 + FSDP_SAVERS, "ddp": ("trainer.max_steps=12",),
        "tp": FSDP_12 + ("distributed.tp_size=2",)}
SWEEP = [(kind, seed) for kind, n in (("fsdp", 6), ("fsdp-savers", 4), ("ddp", 6), ("tp", 4))
         for seed in range(n)]


@pytest.mark.sweep
@pytest.mark.parametrize("kind,seed", SWEEP, ids=[f"{k}-{n}" for k, n in SWEEP])
def test_sweep_a_kill_at_a_seeded_moment_ends_with_the_failure_free_bits(
        tmp_path, kind, seed, references):
    """One worker killed once, after a seeded line of metrics.jsonl (1 to 12: the last is the
    export and the exit) and a seeded delay within the next step."""
    import random
    rng = random.Random(f"{kind}:{seed}")
    moment = (rng.randint(1, 12), round(rng.uniform(0.0, 0.5), 3))
    _, want, _ = references.train("tiny-llama", *RUNS[kind])  # trained once per kind
    _, rep, kills, _ = train_killing(tmp_path, "sweep", "tiny-llama", [moment], *RUNS[kind],
                                     "checkpointless.spares=1")
    assert_same_bits(rep, want, moment, kills)


TWICE = {**{k: RUNS[k] for k in ("ddp", "fsdp")},
         "hsdp": ("distributed.strategy=hsdp", "distributed.shard_size=2", "trainer.max_steps=12",
                  "checkpoint.interval=4")}
# the second victim: worker 3, a survivor; or worker 4, the first spare, which takes rank 1
SWEEP_TWICE = [(kind, seed, 3) for kind in TWICE for seed in range(4)] + \
              [(kind, seed, 4) for kind in TWICE for seed in range(4, 6)]


@pytest.mark.sweep
@pytest.mark.parametrize("kind,seed,second_victim", SWEEP_TWICE,
                         ids=[f"{k}-{n}-w{v}" for k, n, v in SWEEP_TWICE])
def test_sweep_a_second_kill_inside_the_first_recovery_ends_with_the_failure_free_bits(
        tmp_path, kind, seed, second_victim, references):
    """Worker 1 killed at a seeded moment, then 0 to 1 s later, wherever the first recovery then
    is (detection, the barrier, the group's rendezvous, the transfer, the first redone step),
    worker 3 (a survivor: not rank 1's neighbour on the copy ring, so every slice keeps a copy)
    or worker 4 (the spare taking rank 1, while it receives or before its first step)."""
    import random
    rng = random.Random(f"twice:{kind}:{seed}")
    first = (rng.randint(2, 10), round(rng.uniform(0.0, 0.5), 3))
    second = (first[0], round(rng.uniform(0.0, 1.0), 3))
    _, want, _ = references.train("tiny-llama", *TWICE[kind])
    _, rep, kills, _ = train_killing(tmp_path, "twice", "tiny-llama", [first, second],
                                     *TWICE[kind], "checkpointless.spares=2",
                                     victims=[1, second_victim])
    assert all(pid is not None for *_, pid in kills), kills
    assert_same_bits(rep, want, first, second, kills)
