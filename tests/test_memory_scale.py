"""A 0.4B-parameter Llama (hidden 1024, 24 layers, from config) on 8 CPU workers under fsdp: no
worker ever holds the full model, and report.json's `memory` says what each one held.

The model is built on the meta device and each rank fills only its shard (models/init.py), so a
worker's peak resident set above its baseline (after imports) must stay below the full model's
fp32 parameter bytes (1.6 GB): a worker that built, initialized or gathered the whole model even
once would reach it. The peak is read at the end of training, before the end-of-run digest
gathers the full state (launcher/loop.py; that gather is a separate change). Vocabulary,
sequence and steps are minimal: the point is the memory, not the training.
"""
import pytest

from tests.test_train_e2e import assert_replicas_agree, train

pytestmark = pytest.mark.slow

MODEL = ("model.config.hidden_size=1024", "model.config.num_hidden_layers=24",
         "model.config.intermediate_size=4096", "model.config.num_attention_heads=16",
         "model.config.num_key_value_heads=16", "model.config.max_position_embeddings=64")
RUN = ("distributed.strategy=fsdp", "distributed.num_processes=8", "trainer.max_steps=3",
       "trainer.micro_batch_size=1", "data.seq_len=32", "data.synthetic_docs=200",
       "trainer.save_model=false", "optim.warmup_steps=1",
       # steps of a 0.4B model on 8 processes sharing 2 cores take many seconds
       "checkpointless.heartbeat_timeout_s=120", "checkpointless.pg_timeout_s=600")
FULL_PARAMS = 24 * (4 * 1024 * 1024 + 3 * 1024 * 4096) + 2 * 257 * 1024 + 49 * 1024


def test_no_worker_of_a_0_4b_llama_on_8_fsdp_workers_holds_the_full_model(tmp_path):
    _, rep, _ = train(tmp_path, "big", "tiny-llama", *MODEL, *RUN, "checkpointless.spares=0",
                      "checkpointless.replication.factor=1")
    assert_replicas_agree(rep)
    assert rep["full_params"] == FULL_PARAMS  # ~403M
    full_fp32 = rep["full_params"] * 4
    mem = rep["memory"]
    assert set(mem["peak_rss_bytes_by_rank"]) == {str(r) for r in range(8)}
    for r, peak in mem["peak_rss_bytes_by_rank"].items():
        base = mem["baseline_rss_bytes_by_rank"][r]
        assert 0 < base < peak
        assert peak - base < full_fp32, (r, peak - base, full_fp32)
        # each holds its 1/8: parameters, AdamW's two moments, and no peer copies
        assert mem["param_bytes_by_rank"][r] == pytest.approx(full_fp32 / 8, rel=0.01)
        assert mem["optimizer_state_bytes_by_rank"][r] == \
            pytest.approx(2 * full_fp32 / 8, rel=0.01)
        assert mem["replica_bytes_by_rank"][r] == 0
