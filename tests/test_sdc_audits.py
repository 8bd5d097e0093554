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

from tests.conftest import FSDP_12, TINY_30, assert_same_bits, train

AUDITS = ("checkpointless.audit.every=1", "checkpointless.spares=1")


def _found(rep, rank: int, wrong_from: int, rewound_to: int) -> dict:
    (failure,) = rep["failures"]
    assert failure["cause"] == "sdc" and failure["rank"] == rank, rep["failures"]
    assert "silent data corruption" in failure["error"]
    (rec,) = rep["recoveries"]
    assert rec["cause"] == "sdc" and rec["restored_from"] == "durable_checkpoint", rec
    assert rec["resumed_step"] == rewound_to and rec["steps_redone"] > 0
    assert rep["status"] == "ok"
    return rec


@pytest.mark.slow
def test_ddp_a_wrong_gradient_is_found_evicted_and_rewound(tmp_path, tiny_llama_30_steps):
    """Rank 2 wrong from step 12; audited at 2, 6, 10 (right) and 14 (wrong): back to the
    checkpoint at step 10, the newest one at or before 11."""
    _, rep, r = train(tmp_path, "sdc", "tiny-llama", *TINY_30, *AUDITS, "checkpoint.interval=5",
                      "faults=[sdc:2:12]")
    assert_same_bits(rep, tiny_llama_30_steps[1])
    _found(rep, rank=2, wrong_from=12, rewound_to=10)
    assert "computed a wrong gradient at step 14" in r.stdout + r.stderr


@pytest.mark.slow
def test_fsdp_a_wrong_gradient_is_found_evicted_and_rewound(tmp_path, fsdp_12_steps):
    """Under fsdp the tapped gradient is the unsharded one before its reduce-scatter, and the
    spare replays on a whole model it builds beside its unfilled one. Rank 1 wrong from step 6;
    audited at 1, 5 (right) and 9 (wrong, found while the ranks wait at the end): back to the
    checkpoint at step 4."""
    _, rep, _ = train(tmp_path, "sdc", "tiny-llama", *FSDP_12, *AUDITS, "faults=[sdc:1:6]")
    assert_same_bits(rep, fsdp_12_steps[1])
    _found(rep, rank=1, wrong_from=6, rewound_to=4)


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
