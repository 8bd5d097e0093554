"""Sharded initialization (models/init.py, launcher/model_setup.build/shard): a random init is
built on the meta device, each rank fills only its FSDP2 shard, and the full model is the same
bits for a seed whatever the world size or strategy; the model's own init rules are kept."""
import math

import pytest
import torch

from tests.conftest import spawn_gloo


def _tiny_cfg(**over):
    from launcher.recipe.load import load
    return load("tiny-llama", ["model.config.num_hidden_layers=2", "data.seq_len=32",
                               *[f"{k}={v}" for k, v in over.items()]])


def _digest(state: dict) -> str:
    from checkpointless.worker.digest import state_sha256
    return state_sha256(state)


def _sharded(rank, world, overrides):
    from launcher.train.export import local_state
    from launcher.train.model_setup import build, shard
    from models.init import is_meta
    cfg = _tiny_cfg(**{"distributed.strategy": "fsdp", "distributed.num_processes": world,
                       **overrides})
    _, model, _ = build(cfg, torch.device("cpu"))
    meta_before = is_meta(model)
    shard(model, cfg)
    local = sum(p.to_local().numel() for p in model.parameters())
    # every rank gathers each tensor in turn (full_state would give rank 0 alone the state)
    return rank, meta_before, is_meta(model), local, _digest(local_state(model, "fsdp"))


def _sharded_digest(rank, port, q, world, overrides):
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False),
                            rank=rank, world_size=world)
    q.put(_sharded(rank, world, overrides))
    dist.destroy_process_group()


def _two_ranks(rank, port, q, folder):
    """The 2-process cases of this file in one pair of processes (each process imports torch,
    transformers and the launcher once: about 5 s on 2 cores), one after the other on one group:
    the seeded init sharded, the same with LoRA, and pretrained weights read shard by shard."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False),
                            rank=rank, world_size=2)
    q.put({"seeded": _sharded(rank, 2, {}), "lora": _sharded(rank, 2, LORA),
           "pretrained": _pretrained(rank, 2, folder)})
    dist.destroy_process_group()


LORA = {"peft.method": "lora", "peft.r": 4}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """{case: [what each of the 2 ranks put]}, and the saved model of the pretrained case with
    its folder."""
    folder = tmp_path_factory.mktemp("pretrained")
    saved = _save_pretrained(folder)
    got = spawn_gloo(_two_ranks, 2, str(folder), timeout=300)
    return {case: [g[case] for g in got] for case in got[0]}, saved, folder


def _whole_digest(**overrides):
    from launcher.train.model_setup import build
    _, model, _ = build(_tiny_cfg(**overrides), torch.device("cpu"))
    return _digest(model.state_dict()), sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow),
                                   pytest.param(8, marks=pytest.mark.scale)])
def test_the_full_model_is_the_same_bits_for_any_world_size_and_strategy(world, request):
    ddp, n = _whole_digest()  # the whole model, filled as ddp fills it
    if world == 2:
        got = request.getfixturevalue("two_ranks")[0]["seeded"]
    else:
        got = spawn_gloo(_sharded_digest, world, world, {}, timeout=300)
    assert [g[1] for g in got] == [True] * world  # built on meta: nothing allocated before
    assert not any(g[2] for g in got)  # every shard allocated after shard()
    assert all(g[3] < n / world + 2000 for g in got)  # each rank holds about 1/world
    assert {g[4] for g in got} == {ddp}


def test_lora_base_and_adapters_are_the_same_bits_sharded_or_whole(two_ranks):
    ddp, _ = _whole_digest(**LORA)
    got = two_ranks[0]["lora"]
    assert len(got) == 2 and {g[4] for g in got} == {ddp}


def test_a_seed_changes_the_model_and_the_same_seed_repeats_it():
    a, _ = _whole_digest()
    assert _whole_digest()[0] == a
    assert _whole_digest(**{"run.seed": 1})[0] != a


def test_the_models_own_init_rules_are_kept():
    """transformers' rules (normal(initializer_range) for linear and embedding weights, ones for
    norms, zeros for biases, GPT-2's residual projections scaled by 1/sqrt(2 n_layer)), the
    padding row zeroed, tied embeddings tied, rotary buffers computed; peft's B = 0."""
    from launcher.train.model_setup import build
    from launcher.recipe.load import load
    _, m, _ = build(load("tiny-gpt2"), torch.device("cpu"))
    n_layer = m.config.n_layer
    assert m.lm_head.weight is m.transformer.wte.weight
    assert m.transformer.h[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert m.transformer.h[0].attn.c_proj.weight.std().item() == \
        pytest.approx(0.02 / math.sqrt(2 * n_layer), rel=0.05)
    assert torch.all(m.transformer.h[0].ln_1.weight == 1)
    assert torch.all(m.transformer.h[0].attn.c_attn.bias == 0)

    cfg = _tiny_cfg(**{"peft.method": "lora", "peft.r": 4})
    _, m, _ = build(cfg, torch.device("cpu"))
    base = m.get_base_model()
    pad = base.config.pad_token_id
    if pad is not None:
        assert torch.all(base.model.embed_tokens.weight[pad] == 0)
    assert base.model.embed_tokens.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.all(base.model.norm.weight == 1)
    rope = base.model.rotary_emb
    expected = 1.0 / (base.config.rope_parameters["rope_theta"] ** (
        torch.arange(0, rope.inv_freq.numel() * 2, 2).float() / (rope.inv_freq.numel() * 2)))
    assert torch.allclose(rope.inv_freq, expected)
    lora_b = [p for n, p in m.named_parameters() if "lora_B" in n]
    assert lora_b and all(torch.all(p == 0) for p in lora_b)
    lora_a = [p for n, p in m.named_parameters() if "lora_A" in n]
    assert all(p.abs().sum() > 0 for p in lora_a)


def test_an_init_that_cannot_be_replayed_is_refused_by_name():
    from models.init import EmptyBuild, UnknownInit, materialize

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(3, 3))
            self.w.data = torch.zeros(3, 3, device="meta")  # not a torch call on the parameter

    with EmptyBuild() as b:
        m = Odd()
    with pytest.raises(UnknownInit, match="'w'"):
        materialize(m, b.rules(m), 0, "cpu")


# ---- model.init=pretrained under fsdp: each rank reads its rows from the safetensors files ----

def _pretrained(rank, world, folder):
    from launcher.train.export import local_state
    from launcher.train.model_setup import build, shard
    from models import pretrained
    read = []
    original = pretrained.SafetensorsFiles.read_part

    def counted(self, key, param):  # what this rank reads from the files, element by element
        part = original(self, key, param)
        read.append(part.numel())
        return part
    pretrained.SafetensorsFiles.read_part = counted
    try:
        cfg = _tiny_cfg(**{"distributed.strategy": "fsdp", "distributed.num_processes": world,
                           "model.init": "pretrained", "model.id": folder})
        _, model, _ = build(cfg, torch.device("cpu"))
        shard(model, cfg)
    finally:
        pretrained.SafetensorsFiles.read_part = original
    return rank, sum(read), _digest(local_state(model, "fsdp"))


def _save_pretrained(folder):
    """A model of tiny-llama's shape with other values than the seeded init, saved in several
    files and an index, as save_pretrained writes a large model."""
    from transformers import AutoModelForCausalLM

    from launcher.train.model_setup import build
    torch.manual_seed(123)  # other values than the seeded init would give
    _, like, _ = build(_tiny_cfg(), torch.device("cpu"))
    saved = AutoModelForCausalLM.from_config(like.config)
    saved.save_pretrained(folder, max_shard_size="100KB")
    return saved


def test_pretrained_weights_are_read_shard_by_shard_and_equal_the_saved_model(two_ranks):
    got, saved, folder = two_ranks[0]["pretrained"], two_ranks[1], two_ranks[2]
    assert (folder / "model.safetensors.index.json").exists() and len(got) == 2
    expected = _digest(saved.state_dict())
    n = sum(p.numel() for p in saved.parameters())
    assert {g[2] for g in got} == {expected}
    for _, elements, _ in got:  # each rank read about half of the model, never all of it
        assert elements < 0.55 * n, (elements, n)


def _mesh_on_a_gpu_machine(rank, port, q):
    import torch.distributed as dist

    from launcher.train.model_setup import shard_mesh
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False),
                            rank=rank, world_size=2)
    torch.cuda.is_available = lambda: True  # what a GPU machine answers (distributed.device=cpu)
    try:
        mesh = shard_mesh()
        q.put((rank, mesh.device_type, mesh.get_group().group_name == dist.group.WORLD.group_name))
    except Exception as exc:  # noqa: BLE001
        q.put((rank, "error", repr(exc)))
    dist.destroy_process_group()


def test_the_shard_mesh_is_the_default_group_even_where_a_gpu_is_visible():
    """On a machine with a GPU, a mesh built by init_device_mesh over a gloo group makes a
    second group (a collective): a replacement sharding alone after it joins would wait for it
    forever. The mesh must be the default group itself, whose successor a recovery names alike."""
    assert spawn_gloo(_mesh_on_a_gpu_machine, 2) == [(0, "cpu", True), (1, "cpu", True)]
