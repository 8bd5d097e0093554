"""Sharded durable checkpoints (checkpointless/worker/durable.py) and the streamed digest and export
(launcher/train/export.py), in real gloo processes.

The recipe-loop scenarios (a job stopped at 4 workers resumed at 2, a same-size resume ending
with the failure-free bits, the durable-checkpoint fallback of a recovery) are in
tests/scenarios/test_fsdp_recovery.py, on the reference run it already trains.
"""
import json
import os

import pytest
import torch
import torch.distributed as dist

from tests.conftest import spawn_gloo

# a checkpoint read or written here without a process group is DCP's single-process mode
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))


def _killed_mid_write(rank, port, q, directory):
    from torch.distributed.checkpoint import FileSystemWriter

    from checkpointless.worker.durable import ShardedCheckpoints
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    model, ck = _model(), ShardedCheckpoints(directory, keep=1)
    for step in (1, 2):  # keep=1: step 1 is rotated away when step 2 commits
        ck.save(step, {"model": model.state_dict(), "step": step})
    ck.wait()
    dist.barrier()  # both parts of step 2 are on disk, so one of the two ranks committed it
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if rank == 1:  # dies once its file of step 3 is written, before it is recorded as done
        write = FileSystemWriter.write_data

        def dying(self, plan, planner):
            write(self, plan, planner).wait()
            os._exit(9)
        FileSystemWriter.write_data = dying
    ck.save(3, {"model": model.state_dict(), "step": 3})
    if rank == 0:
        ck.wait()  # returns: nobody waits for a peer's part
        q.put("rank 0 finished its write of step 3")
    else:
        ck.wait()


@pytest.mark.slow  # real processes
def test_a_rank_killed_mid_write_never_replaces_the_newest_checkpoint(tmp_path):
    import torch.multiprocessing as mp

    from checkpointless.worker import durable
    d = tmp_path / "ckpt"
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_killed_mid_write, args=(r, store.port, q, str(d)))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=90)
    assert [p.exitcode for p in procs] == [0, 9]
    assert q.get(timeout=5) == "rank 0 finished its write of step 3"

    assert [s for s, _ in durable.list_checkpoints(d)] == [2]  # rotated to keep=1
    step2 = d / "step-00000002"
    assert sorted(p.name for p in step2.iterdir()) == [".metadata", "__0_0.distcp",
                                                       "__1_0.distcp"]  # one file per rank
    partial = d / ".step-00000003.g0.tmp"  # both ranks' files are there, the commit is not
    assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in partial.iterdir()}
    assert not (partial / ".metadata").exists()
    assert durable.latest(d) == (2, step2)

    # the newest complete checkpoint loads (here without a process group, at world size 1):
    # the state before the update, not the killed write's
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
    state = {"model": model.state_dict(), "step": -1}
    durable.load(step2, state)
    assert state["step"] == 2
    for got, want in zip(state["model"].values(), _model().state_dict().values()):
        assert torch.equal(got, want)
    durable.remove_partial(d)  # what a launch does before its first step
    assert not partial.exists() and durable.latest(d) == (2, step2)


def _digest_and_export(rank, port, q, out):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import GPT2Config, GPT2LMHeadModel

    from checkpointless.worker.digest import state_sha256
    from launcher.train.export import digest_and_export
    from models import build_tokenizer
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.manual_seed(0)  # tied input and output embeddings, as GPT-2 has
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=257,
                                       n_positions=64))
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    want = state_sha256(gathered)  # the digest as the loop took it before: all gathered first
    del gathered
    got, n = digest_and_export(model, "fsdp", build_tokenizer("byte"), out, rank, 2)
    q.put((rank, want, got, n))


@pytest.mark.slow
def test_the_streamed_digest_is_the_gathered_one_and_the_sharded_export_reloads(tmp_path):
    from transformers import AutoModelForCausalLM

    from checkpointless.worker.digest import model_sha256
    out = tmp_path / "model"
    out.mkdir()  # an earlier export in the same folder, at other world sizes
    for stale in ("model.safetensors", "model-00003-of-00004.safetensors"):
        (out / stale).write_bytes(b"stale")
    results = spawn_gloo(_digest_and_export, 2, str(out), timeout=120)
    digests = {want for _, want, _, _ in results} | {got for _, _, got, _ in results}
    assert len(digests) == 1  # same hex as before, on every rank
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    assert "lm_head.weight" not in index["weight_map"]  # tied: transformers re-ties it on load
    model = AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert model_sha256(model) == digests.pop()  # the export is the trained state, bit for bit


def test_resume_over_old_single_file_checkpoints_is_refused_before_launch(tmp_path):
    from launcher.run.preflight import _checkpoints
    from launcher.recipe.load import load
    (tmp_path / "step-00000008.pt").write_bytes(b"")
    cfg = load("tiny-llama", [f"checkpoint.dir={tmp_path}", "checkpoint.resume=auto"])
    msg = _checkpoints(cfg)
    assert f"checkpoint.dir={tmp_path} holds step-00000008.pt" in msg
    assert "single-file" in msg and "Fix:" in msg and "checkpoint.resume=never" in msg
    assert _checkpoints(load("tiny-llama", [f"checkpoint.dir={tmp_path}"])) is None  # never


def test_a_checkpoint_of_another_model_is_refused_naming_the_tensor(tmp_path):
    import torch.distributed.checkpoint as dcp

    from launcher.train.checkpoints import CheckpointMismatch, refuse_another_model
    saved = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8))
    dcp.save({"model": saved.state_dict(), "step": 4}, checkpoint_id=str(tmp_path / "step"))
    refuse_another_model(tmp_path / "step", saved.state_dict())  # the same model: no error
    wider = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.Linear(96, 8))
    with pytest.raises(CheckpointMismatch) as err:
        refuse_another_model(tmp_path / "step", wider.state_dict())
    msg = str(err.value)
    assert "checkpoint.resume=auto" in msg and "a different model" in msg
    assert "'0.weight', [64, 32] there, [96, 32] here" in msg and "Fix:" in msg


def _scaler_round_trip(rank, port, q, directory):
    from types import SimpleNamespace

    from launcher.train.checkpoints import DurableCheckpoints
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    cfg = SimpleNamespace(checkpoint=SimpleNamespace(dir=directory, keep=2))
    job = SimpleNamespace(rank=rank, gen=0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    for step in range(3):  # the scale grows after every 2 good steps: 1024 -> 2048, tracker 1
        scaler.scale(model(torch.ones(4, 32)).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    saved = scaler.state_dict()
    ckpt = DurableCheckpoints(cfg, job, model, opt, scaler)
    ckpt.save(3)
    ckpt.close()
    dist.barrier()
    fresh = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    m2, m3 = _model(), _model()
    step = DurableCheckpoints(cfg, job, m2, torch.optim.AdamW(m2.parameters()),
                              fresh).load_step(3)
    # and a run without fp16 loads the same checkpoint, the scaler's entries unasked for
    DurableCheckpoints(cfg, job, m3, torch.optim.AdamW(m3.parameters())).load_step(3)
    q.put((rank, step, saved, fresh.state_dict()))


@pytest.mark.slow  # real processes
def test_the_grad_scaler_state_survives_a_durable_checkpoint(tmp_path):
    results = spawn_gloo(_scaler_round_trip, 2, str(tmp_path / "ckpt"), timeout=120)
    for rank, step, saved, loaded in results:
        assert step == 3
        assert saved["scale"] == 2048.0 and saved["_growth_tracker"] == 1  # it did move
        assert loaded == saved
