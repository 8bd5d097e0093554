"""Silent data corruption, end to end: a worker's chip computes a wrong gradient (fault `sdc`,
one bit of its contribution flipped before the reduction, every step from STEP on); an idle
spare's replay finds it, the witness confirms, the supervisor evicts the worker (cause sdc) and
the job rewinds to the durable checkpoint known clean. Each run ends with the bits of the
failure-free run (the shared references of conftest.py), which it could not without the rewind:
every step after STEP was reduced wrong on every replica."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from checkpointless.worker.audit import audited
from tests.conftest import FSDP_12, TINY_30, assert_same_bits, train

AUDITS = ("checkpointless.audit.every=1", "checkpointless.spares=1")


def _found(rep, out: str, rank: int, wrong_from: int, interval: int) -> None:
    """One recovery, cause sdc, at the first audit of `rank` from `wrong_from` on, back to a
    checkpoint from before that step."""
    found_at = next(s for s in range(wrong_from, 1000) if audited(s, 1, 4)[0] == rank)
    assert f"computed a wrong gradient at step {found_at}" in out
    assert len(rep["failures"]) == 1, (rep["failures"], rep["recoveries"])
    (failure,) = rep["failures"]
    assert failure["cause"] == "sdc" and failure["rank"] == rank, rep["failures"]
    assert "silent data corruption" in failure["error"]
    (rec,) = rep["recoveries"]
    assert rec["cause"] == "sdc" and rec["restored_from"] == "durable_checkpoint", rec
    assert rec["resumed_step"] <= wrong_from and rec["resumed_step"] % interval == 0
    assert rec["steps_redone"] > 0 and rep["status"] == "ok"


@pytest.mark.slow
def test_ddp_a_wrong_gradient_is_found_evicted_and_rewound(tmp_path, tiny_llama_30_steps):
    """Rank 2 wrong from step 20, audited at 19 (right) and 22 (wrong): back to the
    checkpoint at step 20, the newest one at or before 20."""
    _, rep, r = train(tmp_path, "sdc", "tiny-llama", *TINY_30, *AUDITS, "checkpoint.interval=5",
                      "faults=[sdc:2:20]")
    assert_same_bits(rep, tiny_llama_30_steps[1])
    _found(rep, r.stdout + r.stderr, rank=2, wrong_from=20, interval=5)


@pytest.mark.slow
def test_fsdp_a_wrong_gradient_is_found_evicted_and_rewound(tmp_path, fsdp_12_steps):
    """Under fsdp the tapped gradient is the unsharded one before its reduce-scatter, and the
    spare replays on a whole model it builds beside its unfilled one. Rank 1 wrong from step 6;
    audited at 3, 5 (right) and 10 (wrong, found as the ranks wait at the end for the last
    audits): back to the checkpoint at step 4."""
    _, rep, r = train(tmp_path, "sdc", "tiny-llama", *FSDP_12, *AUDITS, "faults=[sdc:1:6]")
    assert_same_bits(rep, fsdp_12_steps[1])
    _found(rep, r.stdout + r.stderr, rank=1, wrong_from=6, interval=4)


@pytest.mark.extended
def test_a_clean_run_with_audits_finds_nothing_and_keeps_the_bits(tmp_path, tiny_llama_30_steps):
    _, rep, r = train(tmp_path, "clean", "tiny-llama", *TINY_30, *AUDITS,
                      "checkpoint.interval=5")
    assert rep["failures"] == [] and rep["recoveries"] == []
    assert_same_bits(rep, tiny_llama_30_steps[1])
    assert "wrong gradient" not in r.stdout + r.stderr


@pytest.mark.extended
def test_without_audits_the_wrong_gradient_poisons_every_replica(tmp_path, fsdp_12_steps):
    """What the audits are for: the same fault with audits off ends `ok`, the replicas agreeing
    with one another, on bits that are not the failure-free run's."""
    _, rep, _ = train(tmp_path, "poisoned", "tiny-llama", *FSDP_12, "faults=[sdc:1:6]")
    assert rep["status"] == "ok" and rep["recoveries"] == []
    assert len(set(rep["params_sha256_by_rank"].values())) == 1
    assert rep["params_sha256"] != fsdp_12_steps[1]["params_sha256"]
