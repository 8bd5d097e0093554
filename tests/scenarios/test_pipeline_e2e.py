"""Pipeline parallel end to end: tiny-llama in 2 stages, real processes on gloo, workers killed by
injected faults and by SIGKILL from outside mid-step, a node holding a stage lost across
launchers; each run ends with the failure-free pipeline run's bits."""
import pytest

from tests.conftest import FSDP_12, TINY_30, assert_replayed, assert_replicas_agree, assert_same_bits, losses
from tests.support.external_kill import seeded_moments, train_killing

pytestmark = pytest.mark.slow

PP_30 = ("distributed.pp_size=2", *TINY_30)


def test_ddp_stages_train_as_ddp_and_kills_in_either_stage_keep_the_pipeline_bits(
        tmp_path, references, tiny_llama_30_steps):
    """2 stages x 2 replicas (1f1b). Each loss is ddp's on the same 4 workers (a pipeline trains
    its workers' rows: the same batches, the model cut in two); then rank 3 (last stage) killed in its backward, and workers 0 (first
    stage) and 2 (last stage) SIGKILLed from outside at seeded moments mid-step: each stage's
    state comes from its twin, every stage redoes the step, and the bits are the failure-free
    pipeline run's."""
    out, ref, _ = references.train("tiny-llama", *PP_30)
    assert_replicas_agree(ref)
    assert_replayed(ref)  # the pipelined step, run twice, gave the same bits
    assert ref["parallelism"] == {"dp_replicate": 2, "dp_shard": 1, "tp": 1, "pp": 2}
    assert ref["pipeline"]["split"] == "stage 0: layers 0-1 +embed; stage 1: layers 2-3 +norm,head"
    assert ref["pipeline"]["schedule"] == "1f1b" and ref["pipeline"]["microbatches"] == 2
    plain, _, _ = tiny_llama_30_steps  # the same recipe under ddp on the same 4 workers
    assert losses(out)[0] == pytest.approx(losses(plain)[0], abs=1e-5)
    assert losses(out) == pytest.approx(losses(plain), abs=1e-4)
    locals_ = ref["local_params_by_rank"]
    assert max(locals_.values()) < 0.75 * ref["full_params"]  # a stage, not the model
    _, rep, kills, log = train_killing(
        tmp_path, "pp", "tiny-llama", seeded_moments(39, [5, 8]), *PP_30,
        "checkpointless.spares=3", "faults=[kill:3:2@backward]", victims=[0, 2])
    assert "(backward)" in log and all(p for _, _, p in kills), kills
    assert rep["status"] == "ok"
    assert_same_bits(rep, ref, kills)
    recs = rep["recoveries"]
    assert [x["failed_rank"] for x in recs] == [3, 0, 2]
    assert [x["failed_coordinates"]["pp"] for x in recs] == [1, 0, 1]
    for x in recs:  # from the other replica of the same stage
        assert x["source_coordinates"]["pp"] == x["failed_coordinates"]["pp"], x
        assert x["source"] != x["failed_rank"]


# in make test-scale (its time budget): fsdp inside stages stays in make test through the lost
# node below, and the schedules' stage forward in tests/launcher/test_pipeline.py
@pytest.mark.extended
def test_fsdp_stages_interleaved_a_worker_killed_mid_step_keeps_the_pipeline_bits(
        tmp_path, references):
    """fsdp inside 2 stages, interleaved 1F1B (two virtual stages per worker): worker 1 (first
    stage) SIGKILLed from outside mid-step; its slices come from a peer's copy and the bits are
    the failure-free run's."""
    inter = (*FSDP_12, "distributed.pp_size=2", "distributed.pp_schedule=interleaved-1f1b")
    _, ref, _ = references.train("tiny-llama", *inter)
    assert ref["pipeline"]["layers_by_worker_stage"] == [[0, 2], [1, 3]]
    _, rep, kills, _ = train_killing(tmp_path, "inter", "tiny-llama", seeded_moments(40, [6]),
                                     *inter, "checkpointless.spares=1", victims=[1])
    assert rep["status"] == "ok" and kills[0][2], kills
    assert_same_bits(rep, ref, kills)
    (rec,) = rep["recoveries"]
    assert rec["failed_rank"] == 1 and rec["restored_from"] == "peer_memory"


def test_a_lost_node_holding_a_whole_stage_comes_back_from_the_other_nodes_memory(
        tmp_path, references):
    """2 nodes x 2 workers, one stage per node, fsdp inside each: node 1's launcher and workers
    SIGKILLed mid-step take the whole last stage; the spare node takes both ranks, each slice
    sent from its copy on node 0, and the bits are the one-node pipeline run's."""
    from tests.scenarios.test_multinode import lose_node_1
    pp = (*FSDP_12, "distributed.pp_size=2")
    _, want, _ = references.train("tiny-llama", *pp)
    rep = lose_node_1(tmp_path, *pp)
    recs = rep["recoveries"]
    assert sorted(r["failed_rank"] for r in recs) == [2, 3]
    assert {r["failed_coordinates"]["pp"] for r in recs} == {1}
    assert {r["restored_from"] for r in recs} == {"peer_memory"}
    assert set(recs[0]["served"].values()) <= {0, 1}  # copies a node away
    assert rep["params_sha256"] == want["params_sha256"]
    assert len(set(rep["params_sha256_by_rank"].values())) == 1
