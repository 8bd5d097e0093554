"""Sharded (FSDP2) training survives the loss of a slice: from a peer's memory, or from disk.

tiny-llama, fsdp, 4 workers, real processes. Every scenario must end with the failure-free
params_sha256. Checkpoints every 4 steps do not change the bits, so the reference run also
leaves the disk state that the fallback and the resume scenarios use.
"""
import json
import shutil

import pytest

from tests.conftest import FSDP_12 as BASE
from tests.conftest import FSDP_SAVERS as SAVERS
from tests.conftest import assert_replayed, assert_replicas_agree, assert_same_bits, losses, train

pytestmark = pytest.mark.slow  # real training processes; `make test-fast` skips them


@pytest.fixture
def reference(fsdp_12_steps):
    assert_replayed(fsdp_12_steps[1])  # the sharded step, run twice, gave the same bits
    return fsdp_12_steps


# Under all three savers at once; the fp32 path's recovery from a peer's memory is the one of
# test_peers_lost_in_the_middle_of_a_background_replica_exchange below (and of the multi-node
# fsdp and the kill-anywhere tests). In make test-scale: bf16 on CPU makes its two runs take 3
# minutes, and make test must stay under 25.
@pytest.mark.extended
def test_a_killed_shard_comes_back_from_a_peers_memory(tmp_path, references):
    _, reference, _ = references.train("tiny-llama", *BASE, *SAVERS)
    _, rep, r = train(tmp_path, "kill", "tiny-llama", *BASE, *SAVERS, "checkpointless.spares=1",
                      "faults=[kill:2:7]")
    assert_same_bits(rep, reference)
    (rec,) = rep["recoveries"]
    assert rec["failed_rank"] == 2 and rec["restored_from"] == "peer_memory"
    assert rec["served"] == {"2": 3}  # rank 2 copies its slice to the next rank on the ring
    assert rec["state_bytes"] > 0 and rec["resumed_step"] in (6, 7)
    # survivors blocked on peers that left for recovery are released at once, not at the
    # 60 s process-group timeout (this took 61 s before release.py)
    assert rec["recovery_s"] < 15
    assert rec["steps_redone"] == 7 - rec["resumed_step"]
    assert rep["pids_at_start"]["0"] == rep["pids_at_end"]["0"]  # survivors kept their process
    for local in rep["local_params_by_rank"].values():
        assert local < 0.4 * rep["full_params"]  # really sharded four ways


@pytest.mark.extended  # make test's time budget: the hsdp shrink's second loss in
# test_shrink_e2e.py falls back to the durable checkpoint in make test
def test_a_slice_lost_with_its_holder_falls_back_to_the_durable_checkpoint(tmp_path, reference):
    _, rep, r = train(tmp_path, "pair", "tiny-llama", *BASE, "checkpointless.spares=2",
                      "faults=[kill:1:7,kill:2:7]")
    assert_same_bits(rep, reference[1])
    assert {x["restored_from"] for x in rep["recoveries"]} == {"durable_checkpoint"}
    assert "resume from the durable checkpoint at step 4" in r.stdout


def stopped_at_step_8(reference, out):
    """The reference's disk as a job killed while writing its step-12 checkpoint left it: step 8
    is the newest complete checkpoint, step 12's files lie in a temporary directory without the
    metadata only the last writer adds."""
    shutil.copytree(reference[0], out)
    ckpts = out / "checkpoints"
    partial = ckpts / ".step-00000012.g0.tmp"
    (ckpts / "step-00000012").rename(partial)
    (partial / ".metadata").unlink()
    (partial / "__3_0.distcp").unlink()
    return ckpts


def test_the_checkpoint_directory_holds_one_set_of_shard_files_per_rank(reference):
    from checkpointless.worker import durable
    ckpts = reference[0] / "checkpoints"
    assert [s for s, _ in durable.list_checkpoints(ckpts)] == [4, 8, 12]
    assert sorted(p.name for p in ckpts.iterdir()) == [f"step-{s:08d}" for s in (4, 8, 12)]
    for _, path in durable.list_checkpoints(ckpts):
        assert sorted(p.name for p in path.iterdir()) == \
            [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
        sizes = [(path / f"__{r}_0.distcp").stat().st_size for r in range(4)]
        assert min(sizes) > 0.8 * max(sizes)  # each rank wrote its own quarter


def test_the_sharded_export_reloads_with_from_pretrained_and_is_the_final_state(reference):
    from transformers import AutoModelForCausalLM

    from checkpointless.worker.digest import model_sha256
    model_dir = reference[0] / "model"
    files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    assert files == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model_sha256(model) == reference[1]["params_sha256"]


@pytest.mark.extended  # in make test-scale, not make test (its time budget)
def test_a_stopped_job_resumes_with_checkpoint_resume_auto(tmp_path, reference):
    out = tmp_path / "stopped"
    ckpts = stopped_at_step_8(reference, out)
    _, rep, r = train(tmp_path, "stopped", "tiny-llama", *BASE, "checkpointless.spares=0",
                      f"checkpoint.dir={ckpts}", "checkpoint.resume=auto")
    assert "resumed from checkpoint" in r.stdout and "step-00000008" in r.stdout
    assert rep["steps_this_launch"] == 4
    assert_same_bits(rep, reference[1])  # the same world size: bits
    assert not (ckpts / ".step-00000012.g0.tmp").exists()  # the dead write was cleared
    assert (ckpts / "step-00000012" / ".metadata").exists()


@pytest.mark.extended  # in make test-scale, not make test (its time budget)
def test_a_job_stopped_at_4_workers_resumes_at_2_and_trains_on(tmp_path, reference):
    """DCP reshards the 4 ranks' slices into 2. Twice the rows per worker keep the global batch
    (and so the rows of each step), so the loss curve is the uninterrupted one to float noise."""
    out = tmp_path / "two"
    ckpts = stopped_at_step_8(reference, out)
    (out / "metrics.jsonl").unlink()
    _, rep, r = train(tmp_path, "two", "tiny-llama", *BASE, "checkpointless.spares=0",
                      "distributed.num_processes=2", "trainer.micro_batch_size=16",
                      f"checkpoint.dir={ckpts}", "checkpoint.resume=auto")
    assert "step-00000008" in r.stdout and "(2 workers)" in r.stdout
    assert rep["world_size"] == 2 and rep["steps_this_launch"] == 4
    assert_replicas_agree(rep)
    resumed, uninterrupted = losses(out), losses(reference[0])[8:]
    assert len(resumed) == 4 and resumed == pytest.approx(uninterrupted, rel=1e-4, abs=1e-5)
    assert sorted(p.name for p in (ckpts / "step-00000012").iterdir()) == \
        [".metadata", "__0_0.distcp", "__1_0.distcp"]  # now written by 2 ranks


@pytest.mark.extended  # in make test-scale, not make test (its time budget)
def test_with_checkpointless_off_a_failure_stops_the_run_and_its_checkpoints_stay(tmp_path,
                                                                                  reference):
    out, _, r = train(tmp_path, "off", "tiny-llama", *BASE, "checkpointless.enabled=false",
                      "faults=[kill:1:9]", expect_rc=1)
    assert "checkpointless is off" in r.stderr
    rep = json.loads((out / "report.json").read_text())
    assert rep["status"] == "failed" and rep["failures"][0]["rank"] == 1
    from checkpointless.worker.durable import latest, load
    step, path = latest(out / "checkpoints")
    assert step == 8 and load(path, {"step": -1})["step"] == 8  # the newest complete one, readable
    # and it is the failure-free run's state: resuming from it ends with the same bits
    _, resumed, _ = train(tmp_path, "off", "tiny-llama", *BASE, "checkpoint.resume=auto",
                          "checkpointless.spares=0")
    assert_same_bits(resumed, reference[1])


def test_peers_lost_in_the_middle_of_a_background_replica_exchange(tmp_path, reference):
    """The exchange runs beside the step (redundancy.py). Rank 2 is killed, then rank 0 hangs,
    each in its exchange thread after the headers went out: its holder is mid-receive and the
    step is computing. The torn copy never counts, survivors are released at once (the kill) or
    as soon as the hang is declared, never at the process-group timeout (300 s)."""
    _, rep, r = train(tmp_path, "exchange", "tiny-llama", *BASE, "checkpointless.spares=2",
                      "checkpointless.heartbeat_timeout_s=5",
                      "faults=[kill:2:7@exchange,hang:0:10@exchange]")
    assert "(exchange)" in r.stdout
    assert_same_bits(rep, reference[1])
    kill, hang = rep["recoveries"]
    assert (kill["failed_rank"], hang["failed_rank"]) == (2, 0)
    assert {kill["restored_from"], hang["restored_from"]} == {"peer_memory"}
    # the copy of step 7 (or 10) was torn in flight: the previous complete one is used
    assert kill["served"] == {"2": 3} and kill["resumed_step"] in (5, 6)
    assert hang["served"] == {"0": 1} and hang["resumed_step"] in (8, 9)
    assert kill["recovery_s"] < 10
    assert hang["recovery_s"] < 5 + 10  # the heartbeat timeout, then at once

