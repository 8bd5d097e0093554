"""A 0.4B-parameter Llama (hidden 1024, 24 layers, from config) on 8 CPU workers under fsdp: no
worker ever holds the full model, and report.json's `memory` says what each one held; a model of
the same width with replication on survives a kill with the failure-free bits.

The model is built on the meta device and each rank fills only its shard (models/init.py), so a
worker's peak resident set above its baseline (after imports) must stay below the full model's
fp32 parameter bytes (1.6 GB): a worker that built, initialized or gathered the whole model even
once would reach it. The peak is read at the end of training, before the end-of-run digest and
export (which gather one tensor at a time, launcher/train/model_setup.py).

The resident set counts what glibc keeps after a free, too: without a fixed mmap threshold its
heap keeps FSDP's freed all-gather buffers (4-16 MB tensors here; measured at 4 workers: a peak
of 3.7 GB with glibc's default, 2.3 GB with the threshold at 1 MB, for 2.05 GB of live state plus
imports), so these runs set MALLOC_MMAP_THRESHOLD_ and the figure tracks what is really held.

Slow on a 2-core machine: 9 processes, minimal vocabulary, sequence and steps.
"""
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.scenarios.test_train_e2e import assert_replicas_agree

pytestmark = [pytest.mark.slow, pytest.mark.scale]

WIDE = ("model.config.hidden_size=1024", "model.config.intermediate_size=4096",
        "model.config.num_attention_heads=16", "model.config.num_key_value_heads=16",
        "model.config.max_position_embeddings=64")
RUN = ("distributed.strategy=fsdp", "distributed.num_processes=8",
       "trainer.micro_batch_size=1", "data.seq_len=32", "data.synthetic_docs=200",
       "trainer.save_model=false", "optim.warmup_steps=1", "trainer.log_every=1",
       # steps of these models on 8 processes sharing 2 cores take many seconds
       "checkpointless.heartbeat_timeout_s=120", "checkpointless.pg_timeout_s=900")


def params_of(layers: int) -> int:
    return layers * (4 * 1024 * 1024 + 3 * 1024 * 4096 + 2 * 1024) + 2 * 257 * 1024 + 1024


def run(tmp_path, name, *overrides):
    out = tmp_path / name
    env = dict(os.environ, HF_HUB_OFFLINE="1", MALLOC_MMAP_THRESHOLD_="1048576")
    r = subprocess.run([sys.executable, "-m", "launcher", "train", "tiny-llama",
                        f"run.output_dir={out}", f"data.cache_dir={tmp_path / 'cache'}",
                        "trainer.progress_bar=false", *overrides],
                       capture_output=True, text=True, timeout=1500, cwd=ROOT, env=env)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-5000:])
    return json.loads((out / "report.json").read_text())


def test_no_worker_of_a_0_4b_llama_on_8_fsdp_workers_holds_the_full_model(tmp_path):
    rep = run(tmp_path, "big", *WIDE, "model.config.num_hidden_layers=24", *RUN,
              "trainer.max_steps=2", "checkpointless.spares=0",
              "checkpointless.replication.factor=1")
    assert_replicas_agree(rep)
    assert rep["full_params"] == params_of(24)  # 403M
    full_fp32 = rep["full_params"] * 4
    mem = rep["memory"]
    print("memory:", json.dumps(mem))
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


def test_a_wide_llama_with_replication_survives_a_kill_with_the_failure_free_bits(tmp_path):
    """The 0.4B model's width at 4 layers (67M): replication keeps two versions of each rank's
    slice and of its peer's (4 x 12 bytes per parameter over the job), which at 24 layers would
    need ~19 GB of this machine's 23."""
    # pg_timeout_s=120: a kill during a replica exchange can still leave a survivor waiting for
    # the process-group timeout (issue 13 item 6); measured here once at 900 s: 920 s recovery
    model = (*WIDE, "model.config.num_hidden_layers=4", *RUN, "trainer.max_steps=4",
             "checkpointless.pg_timeout_s=120")
    ref = run(tmp_path, "ref", *model, "checkpointless.spares=0",
              "checkpointless.replication.factor=1")
    rep = run(tmp_path, "kill", *model, "checkpointless.spares=1",
              "checkpointless.replication.factor=2", "faults=[kill:3:2]")
    assert ref["full_params"] == params_of(4)
    assert_replicas_agree(rep)
    assert rep["params_sha256"] == ref["params_sha256"]
    (rec,) = rep["recoveries"]
    assert rec["failed_rank"] == 3 and rec["restored_from"] == "peer_memory"
    mem = rep["memory"]
    version = 3 * params_of(4) * 4 / 8  # one slice: params + 2 moments, fp32, 1/8 each
    for r, held in mem["replica_bytes_by_rank"].items():
        # own slice and one peer's, two or three versions each (redundancy.py keeps three; the
        # newest is there once its exchange finished before the end, a matter of timing)
        own = mem["snapshot_bytes_by_rank"][r]
        for got in (held, own):
            assert any(got == pytest.approx(k * version, rel=0.05) for k in (2, 3)), (r, got)
