"""Pretrained weights under every mesh the recipes build (models/pretrained.py): a tiny Llama
saved with save_pretrained in several files is read by 4 real gloo processes sharded as fsdp,
fsdp x tp and hsdp x tp. Each rank reads only its part of each tensor; the gathered state is the
saved one bit for bit; the loss of a fixed batch is the saved model's; and the export written
from the mesh reloads with from_pretrained giving the sharded model's logits. A tiny gpt-oss
saved as its hub checkpoints are (MXFP4 experts: `_blocks` and `_scales`) is read under fsdp,
each rank dequantizing only its own experts. Pipeline stages
(pp x fsdp x tp) load through the same path: tests/scenarios/test_recipe_smoke.py runs
llama3.1-405b's shape from a saved checkpoint."""
import pytest
import torch

from tests.conftest import spawn_gloo

pytestmark = pytest.mark.slow  # 4 processes importing transformers: not in make test-fast

WORLD = 4
# (name, recipe overrides, (shard_size, tp) of the Layout): the job's mesh of each shape
SHAPES = [
    ("fsdp", ["distributed.strategy=fsdp"], (4, 1)),
    ("fsdp x tp", ["distributed.strategy=fsdp", "distributed.tp_size=2"], (4, 2)),
    ("hsdp x tp", ["distributed.strategy=hsdp", "distributed.shard_size=2",
                   "distributed.tp_size=2"], (2, 2)),
]


def _cfg(folder, *extra):
    from launcher.recipe.load import load
    return load("tiny-llama", ["model.config.num_hidden_layers=2", "data.seq_len=32",
                               f"distributed.num_processes={WORLD}", "model.init=pretrained",
                               f"model.id={folder}", *extra])


def _batch():
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 250, (2, 24), generator=g)


def _gpt_oss_cfg(folder):
    from launcher.recipe.load import load
    return load("tiny-llama", ["model.name=gpt-oss", "~model.config", "data.seq_len=32",
                               f"distributed.num_processes={WORLD}", "model.init=pretrained",
                               f"model.id={folder}", "distributed.strategy=fsdp"])


def _save_mxfp4(folder):
    """A tiny gpt-oss saved as openai/gpt-oss-20b is: each expert projection as MXFP4 blocks and
    scales (random bytes), the rest as is; returns the model holding what those bytes mean."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    config = AutoConfig.for_model(
        "gpt_oss", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, vocab_size=260, sliding_window=16, max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config)
    g, state = torch.Generator().manual_seed(9), {}
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                state[name] = t.contiguous()
                continue
            experts, inputs, outputs = t.shape
            blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16),
                                   dtype=torch.uint8, generator=g)
            scales = torch.randint(118, 128, (experts, outputs, inputs // 32),
                                   dtype=torch.uint8, generator=g)
            state[name + "_blocks"], state[name + "_scales"] = blocks, scales
            t.copy_(convert_moe_packed_tensors(blocks, scales, dtype=t.dtype))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config.quantization_config = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn",
                                                             "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    config.save_pretrained(folder)
    return model


def _mxfp4_under_fsdp(rank, folder, out, read):
    """The MXFP4 checkpoint read under fsdp 4 (one expert a rank), and exported."""
    from checkpointless.worker.digest import state_sha256
    from launcher.train.export import digest_and_export, local_state
    from launcher.train.model_setup import build, shard
    read[0] = 0
    cfg = _gpt_oss_cfg(folder)
    tokenizer, model, _ = build(cfg, torch.device("cpu"))
    shard(model, cfg)
    digest = state_sha256(local_state(model, "fsdp"))
    digest_and_export(model, "fsdp", tokenizer, out / "gpt-oss", rank, WORLD)
    return {"read": read[0], "digest": digest, "export": str(out / "gpt-oss")}


def _each_shape(rank, port, q, folder, out, gpt_oss):
    import torch.distributed as dist

    from checkpointless.worker import full_tensor
    from checkpointless.worker.digest import state_sha256
    from checkpointless.worker.mesh import Layout, build as groups, device_mesh
    from launcher.train.export import digest_and_export, local_state
    from launcher.train.model_setup import build, shard
    from models import pretrained
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False),
                            rank=rank, world_size=WORLD)
    read, original = [0], pretrained.SafetensorsFiles.read_part

    def counted(self, key, param):  # what this rank reads from the files, element by element
        part = original(self, key, param)
        read[0] += part.numel()
        return part
    pretrained.SafetensorsFiles.read_part = counted
    got = {}
    for name, overrides, (shard_size, tp) in SHAPES:
        read[0] = 0
        cfg = _cfg(folder, *overrides)
        layout = Layout(WORLD, shard_size, tp=tp)
        mesh = device_mesh(layout, groups(layout, rank), "cpu")
        tokenizer, model, _ = build(cfg, torch.device("cpu"))
        shard(model, cfg, mesh)
        largest = max(p.numel() for p in model.parameters())
        batch = _batch()
        with torch.no_grad():
            outputs = model(input_ids=batch, labels=batch)
        logits = full_tensor(outputs.logits)
        digest = state_sha256(local_state(model, "fsdp"))
        export_to = out / name.replace(" ", "")
        digest_and_export(model, "fsdp", tokenizer, export_to, rank, WORLD)
        # plain numbers: a tensor on the queue is shared through a file descriptor that dies
        # with the process
        got[name] = {"read": read[0], "largest": largest, "digest": digest,
                     "loss": outputs.loss.item(),
                     "logits": logits.tolist() if rank == 0 else None,
                     "export": str(export_to)}
    got["gpt-oss mxfp4"] = _mxfp4_under_fsdp(rank, gpt_oss, out, read)
    q.put((rank, got))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """The saved models (tiny Llama, tiny gpt-oss), and [(rank, {shape: what that rank saw})]
    for each of the 4 ranks."""
    from transformers import AutoModelForCausalLM

    from launcher.train.model_setup import build
    folder = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(123)  # other values than the seeded init would give
    _, like, _ = build(_cfg(folder, "model.init=random", "model.id=null"), torch.device("cpu"))
    saved = AutoModelForCausalLM.from_config(like.config)
    saved.save_pretrained(folder, max_shard_size="100KB")  # several files and an index
    out = tmp_path_factory.mktemp("exports")
    gpt_oss = tmp_path_factory.mktemp("gpt-oss")
    saved = (saved, _save_mxfp4(gpt_oss))
    return saved, spawn_gloo(_each_shape, WORLD, str(folder), out, gpt_oss, timeout=240)


@pytest.mark.parametrize("shape", [s[0] for s in SHAPES])
def test_each_rank_reads_its_part_and_the_whole_is_the_saved_model(loaded, shape):
    from checkpointless.worker.digest import state_sha256
    (saved, _), got = loaded
    n = sum(p.numel() for p in saved.parameters())
    assert {g[shape]["digest"] for _, g in got} == {state_sha256(saved.state_dict())}
    for rank, g in got:
        # fsdp: a quarter of the model; with tp 2 the norms and embeddings are whole on each tp
        # rank, the split layers a quarter (fsdp x tp) or a half (hsdp x tp: 2 replicas)
        assert g[shape]["read"] < 0.6 * n, (shape, rank, g[shape]["read"], n)
        assert g[shape]["largest"] == max(p.numel() for p in saved.parameters())


@pytest.mark.parametrize("shape", [s[0] for s in SHAPES])
def test_the_first_loss_is_the_saved_models_on_the_same_batch(loaded, shape):
    (saved, _), got = loaded
    with torch.no_grad():
        batch = _batch()
        expected = saved(input_ids=batch, labels=batch).loss.item()
    for _, g in got:
        assert g[shape]["loss"] == pytest.approx(expected, abs=1e-5), shape


@pytest.mark.parametrize("shape", [s[0] for s in SHAPES])
def test_the_export_from_the_mesh_reloads_with_the_sharded_models_logits(loaded, shape):
    from transformers import AutoModelForCausalLM
    _, got = loaded
    rank0 = dict(got)[0][shape]
    reloaded = AutoModelForCausalLM.from_pretrained(rank0["export"])
    with torch.no_grad():
        logits = reloaded(input_ids=_batch()).logits
    torch.testing.assert_close(logits, torch.tensor(rank0["logits"]), rtol=0, atol=1e-5)


def test_gpt_oss_mxfp4_experts_are_dequantized_each_rank_its_own_and_export_full_precision(
        loaded):
    from transformers import AutoModelForCausalLM

    from checkpointless.worker.digest import state_sha256
    (_, saved), got = loaded
    expected = state_sha256(saved.state_dict())
    assert {g["gpt-oss mxfp4"]["digest"] for _, g in got} == {expected}
    packed = sum(p.numel() for n, p in saved.named_parameters()
                 if n.endswith(("experts.gate_up_proj", "experts.down_proj")))
    for _, g in got:  # a quarter of the experts' bytes (a half-byte a value) and of the rest
        assert g["gpt-oss mxfp4"]["read"] < 0.5 * sum(
            p.numel() for p in saved.parameters()) - 0.25 * packed
    reloaded = AutoModelForCausalLM.from_pretrained(dict(got)[0]["gpt-oss mxfp4"]["export"])
    assert getattr(reloaded.config, "quantization_config", None) is None
    assert state_sha256(reloaded.state_dict()) == expected
