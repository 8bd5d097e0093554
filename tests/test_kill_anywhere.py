"""Workers SIGKILLed from outside, at seeded moments anywhere in a run, end with the failure-free
bits (tests/external_kill.py does the killing).

`faults` fire at points of the library's own code; a real failure strikes wherever the worker is:
in forward, inside a reduce-scatter or an all-reduce, in the optimizer step, during the replica
exchange, in the export after the last step, on the way out. The suite runs one fsdp job killed
three times (mid-run twice, once after its last step); `make test-sweep` runs many single kills
over a grid of seeded moments, under fsdp and ddp.
"""
import pytest

from tests.conftest import FSDP_12
from tests.external_kill import seeded_moments, train_killing
from tests.test_train_e2e import assert_replicas_agree

pytestmark = pytest.mark.slow


def test_fsdp_workers_killed_from_outside_mid_step_and_after_the_last_step(tmp_path,
                                                                           fsdp_12_steps):
    moments = seeded_moments(19, [3, 7]) + [(12, 0.05)]  # two mid-step, one in the export
    out, rep, kills, log = train_killing(tmp_path, "outside", "tiny-llama", moments, *FSDP_12,
                                         "checkpointless.spares=3")
    assert all(pid for _, _, pid in kills), kills  # each victim was alive when it was killed
    assert_replicas_agree(rep)
    assert rep["status"] == "ok"
    assert rep["params_sha256"] == fsdp_12_steps[1]["params_sha256"], (kills, rep["recoveries"])
    lost = [f["worker"] for f in rep["failures"]]
    assert lost == sorted(lost) and set(lost) | set(rep["killed_after_done"]) == {1, 2, 3}
    assert {x["restored_from"] for x in rep["recoveries"]} <= {"peer_memory"}
    # a kill after the last step restores the final state the loop's end copied to peers, or,
    # when it strikes while that copy is in flight, rolls back and redoes the last step
    if 3 in lost:
        last = rep["recoveries"][-1]
        assert last["resumed_step"] == 12 or (last["resumed_step"], last["steps_redone"]) == \
            (11, 1), last
    assert rep["steps_completed"] == 12
    assert (out / "model" / "model.safetensors.index.json").exists()


SWEEP = [(strategy, seed) for strategy in ("fsdp", "ddp") for seed in range(6)]


@pytest.mark.sweep
@pytest.mark.parametrize("strategy,seed", SWEEP, ids=[f"{s}-{n}" for s, n in SWEEP])
def test_sweep_a_kill_at_a_seeded_moment_ends_with_the_failure_free_bits(
        tmp_path, strategy, seed, fsdp_12_steps, tiny_llama_12_steps_ddp):
    """One worker killed once, after a seeded line of metrics.jsonl (1 to 12: the last is the
    export and the exit) and a seeded delay within the next step."""
    import random
    rng = random.Random(f"{strategy}:{seed}")
    moment = (rng.randint(1, 12), round(rng.uniform(0.0, 0.5), 3))
    args = FSDP_12 if strategy == "fsdp" else ("trainer.max_steps=12",)
    _, rep, kills, _ = train_killing(tmp_path, "sweep", "tiny-llama", [moment], *args,
                                     "checkpointless.spares=1")
    want = fsdp_12_steps[1] if strategy == "fsdp" else tiny_llama_12_steps_ddp
    assert_replicas_agree(rep)
    assert rep["params_sha256"] == want["params_sha256"], (moment, kills, rep["recoveries"])


@pytest.fixture(scope="session")
def tiny_llama_12_steps_ddp(tmp_path_factory):
    from tests.test_train_e2e import train
    tmp = tmp_path_factory.mktemp("ddp_ref")
    _, rep, _ = train(tmp, "ref", "tiny-llama", "trainer.max_steps=12", "checkpointless.spares=0")
    return rep
