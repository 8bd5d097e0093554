"""End to end through the real CLI: tiny HF models, real worker processes, gloo, offline.

Each run costs ~15 s of start-up (every worker imports transformers), so the scenarios are few
and each checks a lot.
"""
import json
import socket
import threading
import time
import urllib.request

import pytest

from tests.conftest import FSDP_12, assert_replayed, assert_replicas_agree, assert_same_bits, losses, train

pytestmark = pytest.mark.slow  # real training processes; `make test-fast` skips them


def test_tiny_llama_trains_its_loss_falls_and_the_export_reloads_and_generates(
        tiny_llama_30_steps):
    """On the session's failure-free tiny-llama run (4 workers, 30 steps), which the fault
    tests of this file, test_preemption.py and test_multinode.py end with."""
    out, rep, run = tiny_llama_30_steps
    assert rep["world_size"] == 4 and rep["steps_completed"] == 30
    assert rep["tokens"] == 30 * 4 * 8 * 128
    assert_replicas_agree(rep)
    assert_replayed(rep)  # the recipe loop's step, run twice at step 1, gave the same bits
    assert rep["replay"]["checked_at_step"] == 1 and "replay check passed at step 1" in \
        run.stdout
    ls = losses(out)
    assert len(ls) == 30 and ls[-1] < ls[0] - 1.5  # from ~5.5 (uniform over bytes) well down
    assert rep["final_loss"] == pytest.approx(ls[-1])
    assert (out / "recipe.yaml").exists()
    assert sorted(p.name for p in (out / "model").glob("*.safetensors")) == \
        [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]  # one per rank

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from checkpointless.worker.digest import model_sha256
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert model_sha256(model) == rep["params_sha256"]  # the export is the trained state
    ids = tok("alice went to", return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert gen.shape[1] == ids.shape[1] + 12
    assert tok.decode(gen[0]).startswith("alice went to")


def test_tiny_gpt2_with_dropout_is_deterministic_and_flat_sync_and_kills_mid_step_keep_the_bits(
        tmp_path, references):
    """Dropout's randomness is a function of (step, rank); with 2 ranks a sum of two gradients
    has one order, so the flat all-reduce after backward (distributed.grad_sync=flat), even
    across a kill, ends with the overlapped buckets' bits."""
    # today's collectives (shrink=exact, the ddp default, reduces by logical rank instead)
    args = ("distributed.num_processes=2", "trainer.max_steps=25", "checkpointless.shrink=off")
    out_a, a, _ = references.train("tiny-gpt2", *args)
    _, b, _ = train(tmp_path, "b", "tiny-gpt2", *args, "distributed.grad_sync=flat",
                    "checkpointless.spares=1", "faults=[kill:1:10]")
    assert [x["resumed_step"] for x in b["recoveries"]] == [10]
    assert_same_bits(b, a)
    ls = losses(out_a)
    assert ls[-1] < ls[0] - 1.0
    # kills inside a step's compute, under small buckets (with 2 ranks a sum has one order, so
    # their layout keeps the bits): in backward once the later buckets' all-reduce started, as
    # the optimizer step begins (the survivor has finished the step: it stands), and at a seeded
    # random moment of a step
    _, c, r = train(tmp_path, "c", "tiny-gpt2", *args, "distributed.bucket_cap_mb=0.25",
                    "checkpointless.spares=2",
                    "faults=[kill:1:4@backward,kill:0:9@optimizer,kill:1:14@random:2]")
    assert_same_bits(c, a)
    for phase in ("(backward)", "(optimizer)", "(random: "):
        assert phase in r.stdout
    steps = [x["resumed_step"] for x in c["recoveries"]]
    assert steps[:2] == [4, 10] and steps[2] in (14, 15)
    assert c["recoveries"][0]["ranks_reusing_grads"] == [0]  # its own, kept from the cut pass


def test_fsdp_really_shards_and_its_replicas_agree(references):
    """On the session's failure-free fsdp run (4 workers, 12 steps), the one every fsdp fault
    test (test_fsdp_recovery.py, test_kill_anywhere.py, test_multinode.py) ends with."""
    out, rep, r = references.train("tiny-llama", *FSDP_12)
    # said in one line at start: the launcher shards, not accelerate's FSDP plugin
    assert r.stdout.count("fsdp (gloo): the launcher shards each decoder block with torch's "
                          "fully_shard, not accelerate's FSDP plugin") == 1
    assert_replicas_agree(rep)
    full = rep["full_params"]
    for local in rep["local_params_by_rank"].values():
        assert local < 0.35 * full  # each rank holds about a quarter, not a replica
    ls = losses(out)
    assert len(ls) == 12 and ls[-1] < ls[0] - 1.0


def test_kill_hang_and_raise_in_one_run_end_with_the_failure_free_bits(tmp_path,
                                                                      tiny_llama_30_steps):
    _, ref, _ = tiny_llama_30_steps  # the same recipe, 30 steps, without spares or failures
    port, scrapes = _free_port(), []
    scraper = _Scraper(port, scrapes)
    try:
        out, rep, r = train(tmp_path, "faults", "tiny-llama", "trainer.max_steps=30",
                            "checkpointless.spares=2", "faults=[kill:1:6,hang:2:12,raise:0:18]",
                            f"checkpointless.metrics_port={port}")
    finally:
        scraper.stop()
    assert_same_bits(rep, ref)
    # Prometheus, scraped during the run: each recovery counted by its cause, with its phases
    last = scrapes[-1]
    assert last['checkpointless_recoveries_total{cause="exit"}'] == 1
    assert last['checkpointless_recoveries_total{cause="hang"}'] == 1
    assert last['checkpointless_recoveries_total{cause="error"}'] == 1
    assert last['checkpointless_failures_total{cause="exit"}'] == 1
    assert 0 < last['checkpointless_last_recovery_seconds{phase="total"}'] < 30
    assert 18 < last["checkpointless_steps_completed"] <= 30
    # one generation a recovery; a failure that found no spare ready shrank, and a grow followed
    assert last["checkpointless_generation"] == 3 + len(rep["grows"])
    assert 0 < last["checkpointless_goodput_ratio"] < 1
    assert last["checkpointless_tokens_per_second"] > 0
    assert last["checkpointless_replay_replayable"] == 1  # the rehearsal at step 1 passed
    assert last['checkpointless_replay_mismatches_total{check="redo"}'] == 0
    assert_replayed(rep)  # and no redo after the three recoveries gave other bits
    assert any(s['checkpointless_recoveries_total{cause="exit"}'] == 0 for s in scrapes)  # before
    assert rep["final_loss"] == ref["final_loss"]
    causes = [(x["failed_rank"], x["cause"], x["resumed_step"]) for x in rep["recoveries"]]
    assert causes == [(1, "exit", 6), (2, "hang", 12), (0, "error", 18)]
    # the survivors redo each interrupted step from the gradients they kept: only the
    # replacement computes, and the bits still match the failure-free run. A failure that found
    # no spare ready (still warming) shrank instead: every process of it then reuses its own
    for x in rep["recoveries"]:
        new = set() if x.get("shrunk") else {x["failed_rank"]}  # the replacement computes
        assert x["ranks_reusing_grads"] == sorted(set(range(x["processes"])) - new), x
    # three workers of the launch were hit, each once; the fourth never restarted: its process
    # still holds a rank at the end (rank 3 when spares took each rank; after a shrink, whose
    # renumbering moves the later faults' ranks onto other workers, another one)
    assert len(set(rep["pids_at_start"].values()) & set(rep["pids_at_end"].values())) == 1
    assert 0 < rep["goodput"] < ref["goodput"] <= 1
    steps = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(30))  # every step trained and logged exactly once
    assert r.stdout.count("[checkpointless] recovered rank") == 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Scraper:
    """Scrapes http://127.0.0.1:PORT/metrics every 0.3 s while a run goes on, as Prometheus
    would; each successful scrape's samples (name{labels} -> value) are appended."""

    def __init__(self, port: int, scrapes: list):
        self.port, self.scrapes, self.done = port, scrapes, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.done.is_set():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics",
                                            timeout=2) as resp:
                    text = resp.read().decode()
                self.scrapes.append({k: float(v) for k, v in (
                    line.rsplit(" ", 1) for line in text.splitlines()
                    if line.startswith("checkpointless_"))})
            except OSError:
                pass  # not serving yet, or any more
            time.sleep(0.3)

    def stop(self):
        self.done.set()
        self.thread.join(timeout=5)


def test_on_accelerate_bf16_with_accumulation_rank_0_replaced_keeps_the_bits_and_one_tb_run(
        tmp_path, references, monkeypatch):
    """The loop on accelerate's Accelerator (bf16 autocast, gradient accumulation over 2
    micro-batches through accelerate's loss scaling and no_sync on our buckets): rank 0 killed,
    its replacement builds its own Accelerator, becomes the main process, and the run ends with
    the failure-free bits. TensorBoard, W&B (offline) and MLflow (a local file store), through
    accelerate's trackers, each hold every step once and the recovery; W&B and MLflow in one
    run, continued by the replacement."""
    # 8 steps, rank 0 killed at the 5th: bf16 autocast on CPU makes each step of the two runs slow
    args = ("distributed.num_processes=2", "trainer.max_steps=8", "trainer.precision=bf16",
            "trainer.grad_accum_steps=2")
    _, ref, _ = references.train("tiny-llama", *args)
    out, rep, r = train(tmp_path, "tb", "tiny-llama", *args, "faults=[kill:0:4]",
                        "logging.trackers=[tensorboard,wandb,mlflow]",
                        env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    assert [x["failed_rank"] for x in rep["recoveries"]] == [0]
    assert_same_bits(rep, ref)
    assert rep["final_loss"] == ref["final_loss"]
    assert rep["pids_at_start"]["0"] != rep["pids_at_end"]["0"]  # rank 0 really was replaced
    # written by rank 0's replacement: its own Accelerator, built after it took the rank
    acc = json.loads((out / "results" / "rank0.json").read_text())["accelerator"]
    assert acc["device"] == "cpu" and acc["mixed_precision"] == "bf16"
    assert acc["gradient_accumulation_steps"] == 2 and not acc["grad_scaler"]
    assert acc["distributed_type"].endswith("MULTI_CPU")
    assert r.stdout.count("Accelerator: device cpu, mixed precision bf16") == 1  # said once
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run = out / "logs" / "tiny-llama"
    assert len(list(run.glob("events.out.tfevents.*"))) == 2  # rank 0, then its replacement
    events = EventAccumulator(str(run))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(8))  # each step once
    assert [round(e.value, 4) for e in events.Scalars("loss")] == \
        [round(x, 4) for x in losses(out)]
    (rec,) = events.Scalars("recovery/generation")
    assert rec.step == 4 and rec.value == 1
    assert events.Scalars("recovery/bytes_received")[0].value > 1e6
    # W&B offline: rank 0's run and its replacement's, one run id, each step in one of them once
    # (what the killed rank 0's W&B had not written out, its replacement gave it again)
    from launcher.train.wandb_refill import offline_history
    runs = sorted((out / "logs" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({p.name.split("-")[3] for p in runs}) == 1
    rows = [row for p in runs for row in offline_history(next(p.glob("run-*.wandb")))]
    assert sorted(row["_step"] for row in rows if "loss" in row) == list(range(8))
    # the killed rank 0's last row was never written by W&B (it writes a row once the next
    # step arrives): its replacement gave it again
    assert "given again from metrics.jsonl" in r.stdout
    losses_by_step = dict(enumerate(losses(out)))
    assert all(round(row["loss"], 4) == round(losses_by_step[row["_step"]], 4)
               for row in rows if "loss" in row)
    assert [(row["_step"], row["recovery/generation"]) for row in rows
            if "recovery/generation" in row] == [(4, 1)]
    # MLflow: one experiment, one run, continued by the replacement
    from mlflow.tracking import MlflowClient
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # as the launcher sets it for its own
    client = MlflowClient((out / "logs" / "mlruns").as_uri())
    (exp,) = [e for e in client.search_experiments() if e.name == "tiny-llama"]
    (run,) = client.search_runs([exp.experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == \
        list(range(8))
    (gen,) = client.get_metric_history(run.info.run_id, "recovery/generation")
    assert (gen.step, gen.value) == (4, 1)
