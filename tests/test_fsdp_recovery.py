"""Sharded (FSDP2) training survives the loss of a slice: from a peer's memory, or from disk.

tiny-llama, fsdp, 4 workers + spares, real processes. Every scenario must end with the
failure-free params_sha256.
"""
import json

import pytest

from tests.test_train_e2e import assert_replicas_agree, train

BASE = ("distributed.strategy=fsdp", "trainer.max_steps=16", "checkpointless.spares=2")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_ref")
    _, rep, _ = train(tmp, "ref", "tiny-llama", *BASE)
    assert_replicas_agree(rep)
    return rep


def test_a_killed_shard_comes_back_from_a_peers_memory(tmp_path, reference):
    _, rep, r = train(tmp_path, "kill", "tiny-llama", *BASE, "faults=[kill:2:9]")
    assert_replicas_agree(rep)
    assert rep["params_sha256"] == reference["params_sha256"]
    (rec,) = rep["recoveries"]
    assert rec["failed_rank"] == 2 and rec["restored_from"] == "peer_memory"
    assert rec["served"] == {"2": 3}  # rank 2 copies its slice to the next rank on the ring
    assert rec["state_bytes"] > 0 and rec["steps_redone"] >= 0
    assert rep["pids_at_start"]["0"] == rep["pids_at_end"]["0"]


def test_a_slice_lost_with_its_holder_falls_back_to_the_durable_checkpoint(tmp_path, reference):
    _, rep, r = train(tmp_path, "pair", "tiny-llama", *BASE, "checkpoint.interval=4",
                      "faults=[kill:1:10,kill:2:10]")
    assert_replicas_agree(rep)
    assert rep["params_sha256"] == reference["params_sha256"]
    assert {x["restored_from"] for x in rep["recoveries"]} == {"durable_checkpoint"}
    assert "resume from the durable checkpoint at step 8" in r.stdout


def test_a_stopped_job_resumes_with_checkpoint_resume_auto(tmp_path, reference):
    stop = train(tmp_path, "stopped", "tiny-llama", *BASE, "checkpoint.interval=4",
                 "checkpointless.spares=0", "checkpointless.refill=false", "faults=[kill:0:11]",
                 expect_rc=1)
    out = stop[0]
    assert "no spare left" in stop[2].stderr
    _, rep, r = train(tmp_path, "stopped", "tiny-llama", *BASE, "checkpoint.interval=4",
                      "checkpoint.resume=auto")
    assert "resumed from checkpoint" in r.stdout and "step-00000008" in r.stdout
    assert rep["params_sha256"] == reference["params_sha256"]
