"""Tensor parallel (distributed.tp_size): the mesh's layout, the recipe's refusals, the clip over
two meshes in-process; then real processes on tiny-llama, fsdp 2 shards x tp 2: the same losses as
plain fsdp on 2 workers, and kills in backward, in the optimizer and from outside mid-step, each
ending with the failure-free tp bits, the replacement at the lost rank's coordinates.
"""
import pytest

from checkpointless.worker.mesh import Layout
from launcher.recipe.load import RecipeError, load
from tests.conftest import (FSDP_12, assert_replicas_agree, assert_same_bits, losses,
                            spawn_gloo, train)
from tests.support.external_kill import seeded_moments, train_killing

TP_12 = (*FSDP_12, "distributed.tp_size=2")


def test_tp_is_innermost_so_a_tp_group_is_consecutive_ranks_and_twins_share_both_coordinates():
    lay = Layout(8, 4, tp=2)  # hsdp: 2 replica groups of dp_shard 2 x tp 2
    assert lay.dims() == ("dp_replicate", "dp_shard", "tp")
    assert lay.mesh() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert lay.coords(6) == {"dp_replicate": 1, "dp_shard": 1, "tp": 0}
    assert lay.twins(6) == [2] and lay.data_rank(6) == 3 and lay.data_rank(7) == 3
    groups = lay.all_groups()
    assert [r for d, r in groups if d == "tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [r for d, r in groups if d == "dp_shard"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [r for d, r in groups if d == "dp_replicate"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [d for d, _ in groups] == sorted([d for d, _ in groups], key=(
        "dp_replicate", "dp_shard", "tp").index)  # built in one fixed order
    fsdp_tp = Layout(4, 4, tp=2)
    assert fsdp_tp.dims() == ("dp_shard", "tp") and fsdp_tp.twins(1) == []
    assert Layout(4, 2).dims() == ("dp_replicate", "dp_shard")  # hsdp as before
    with pytest.raises(ValueError, match="tp_size=3"):
        Layout(8, 4, tp=3)


@pytest.mark.parametrize("overrides,key", [
    (["distributed.tp_size=2"], "distributed.tp_size=2: composes with distributed.strategy=fsdp"),
    (["distributed.strategy=fsdp", "distributed.tp_size=3"], "distributed.tp_size=3: must divide"),
    (["distributed.strategy=fsdp", "distributed.tp_size=4", "distributed.num_nodes=2",
      "distributed.master_port=29400"],
     "distributed.tp_size=4: would put a tp group across two nodes"),
    (["distributed.strategy=hsdp", "distributed.num_processes=8", "distributed.shard_size=2",
      "distributed.tp_size=4"], "distributed.shard_size=2: counts the workers of a replica"),
    (["distributed.strategy=fsdp", "distributed.tp_size=2", "peft.method=lora"],
     "peft.method='lora': is not combined with distributed.tp_size=2"),
])
def test_a_tp_size_that_cannot_apply_is_refused_before_launch_naming_the_key(overrides, key):
    with pytest.raises(RecipeError) as exc:
        load("tiny-llama", overrides)
    assert key in str(exc.value) and "Fix:" in str(exc.value)


def test_models_without_a_plan_or_with_heads_tp_does_not_divide_are_refused_with_the_reason():
    from launcher.plan.model import hf_config
    from launcher.parallel.mesh import refusal
    llama = hf_config(load("tiny-llama", ["distributed.strategy=fsdp"]))[0]
    assert refusal(2, llama) is None and refusal(1, llama) is None
    assert "num_key_value_heads=2 is not a multiple of 4" in refusal(4, llama)
    gpt2 = hf_config(load("tiny-gpt2", ["distributed.strategy=fsdp"]))[0]
    assert "ships no tensor-parallel plan (GPT-2's attention is one fused Conv1D" in refusal(2, gpt2)
    from transformers import AutoConfig
    assert "embedding_rowwise" in refusal(2, AutoConfig.for_model("gpt_oss"))


def test_report_coordinates_follow_the_mesh():
    from launcher.parallel.mesh import coordinates, mesh_sizes
    d = load("tiny-llama", ["distributed.strategy=hsdp", "distributed.num_processes=8",
                            "distributed.shard_size=4", "distributed.tp_size=2"]).distributed
    assert mesh_sizes(d) == {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "pp": 1}
    assert coordinates(d, 5) == {"dp_replicate": 1, "dp_shard": 0, "tp": 1}
    ddp = load("tiny-llama", []).distributed
    assert mesh_sizes(ddp) == {"dp_replicate": 4, "dp_shard": 1, "tp": 1, "pp": 1}


def _clip_on_a_mesh(rank, port, q):
    """A two-layer MLP split column then row over tp 2, sharded over dp 2 by FSDP2, beside a
    replicated scale: its clipped gradients, gathered, against the whole model's on one rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    from checkpointless.worker import mesh
    from launcher.train.tensor_parallel import clip_grad_norm_
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4)
    layout = mesh.Layout(4, 4, tp=2)
    dm = mesh.device_mesh(layout, mesh.build(layout, rank), "cpu")

    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        m.scale = torch.nn.Parameter(torch.ones(8))
        return m

    def loss(m, x):
        return (m(x) * m.scale).square().mean()

    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(s)) for s in (0, 1)]
    whole = model()
    (loss(whole, xs[0]) + loss(whole, xs[1])).div(2).backward()
    want = torch.nn.utils.clip_grad_norm_(whole.parameters(), 0.1)
    split = model()
    parallelize_module(split, dm["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(split, mesh=dm["dp_shard"])
    loss(split, xs[layout.data_rank(rank)]).backward()
    got = clip_grad_norm_(split.parameters(), 0.1)
    grads = [p.grad.full_tensor() for p in split.parameters()]
    same = all(torch.allclose(g, w.grad, atol=1e-6) for g, w in zip(grads, whole.parameters()))
    from checkpointless.worker.consistency import whole_on_tp
    whole_ones = [n for n, p in split.named_parameters() if whole_on_tp(p)]
    q.put((rank, float(got), float(want), same, whole_ones))
    dist.destroy_process_group()


def test_the_clip_spans_split_and_replicated_gradients_as_the_whole_models_does():
    """Also: the end-of-run check of a tp group compares the parameters tp leaves whole."""
    for rank, got, want, same, whole_ones in spawn_gloo(_clip_on_a_mesh, 4, timeout=120):
        assert got == pytest.approx(want, rel=1e-5) and want > 0.1, rank
        assert same, rank  # every gradient scaled as the whole model's
        # what the end-of-run check compares across a tp group: what tp does not split
        assert sorted(whole_ones) == ["2.bias", "scale"], whole_ones


@pytest.mark.slow
def test_tp_trains_like_plain_fsdp_and_kills_anywhere_in_a_step_keep_the_tp_bits(
        tmp_path, references):
    """fsdp 2 shards x tp 2 on 4 workers: each loss as plain fsdp's on 2 workers (the same model
    and batches, split); then one run with a kill in backward (rank 1), one as the optimizer
    step begins (rank 2) and worker 4, the spare that took rank 1, SIGKILLed from outside at a
    seeded moment mid-step: the final bits are the failure-free tp run's."""
    out, ref, _ = references.train("tiny-llama", *TP_12)
    assert ref["parallelism"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "pp": 1}
    assert_replicas_agree(ref)
    plain, _, _ = references.train("tiny-llama", *FSDP_12, "distributed.num_processes=2")
    assert losses(out) == pytest.approx(losses(plain), abs=1e-4)
    locals_ = ref["local_params_by_rank"]
    assert max(locals_.values()) < 0.3 * ref["full_params"]  # split two ways and sharded two
    _, rep, kills, log = train_killing(
        tmp_path, "tp", "tiny-llama", seeded_moments(38, [8]), *TP_12,
        "checkpointless.spares=3", "faults=[kill:1:3@backward,kill:2:6@optimizer]", victims=[4])
    assert "(backward)" in log and "(optimizer)" in log and all(p for _, _, p in kills), kills
    assert rep["status"] == "ok"
    assert_same_bits(rep, ref, kills)
    recs = rep["recoveries"]
    assert [x["failed_rank"] for x in recs] == [1, 2, 1]
    assert recs[0]["failed_coordinates"] == {"dp_replicate": 0, "dp_shard": 0, "tp": 1}
    assert {x["restored_from"] for x in recs} == {"peer_memory"}
    for x in recs:  # the slice came from the rank holding its copy, named with its place
        assert x["source_coordinates"] is not None and x["source"] != x["failed_rank"], x


@pytest.mark.slow
@pytest.mark.extended  # 9 processes on 2 cores: in make test-scale, not make test
def test_hsdp_x_tp_a_lost_rank_gets_its_slice_from_the_twin_at_its_coordinates(tmp_path,
                                                                              references):
    """8 workers: 2 replica groups x dp_shard 2 x tp 2. Rank 5 (group 1, shard 0, tp 1) killed in
    backward: its twin, rank 1 (group 0, shard 0, tp 1), sends the slice; the bits are the
    failure-free hsdp x tp run's."""
    hsdp_tp = ("distributed.strategy=hsdp", "distributed.num_processes=8",
               "distributed.shard_size=4", "distributed.tp_size=2", "trainer.max_steps=10")
    _, ref, _ = references.train("tiny-llama", *hsdp_tp)
    _, rep, _ = train(tmp_path, "kill", "tiny-llama", *hsdp_tp, "checkpointless.spares=1",
                      "faults=[kill:5:4@backward]")
    assert_same_bits(rep, ref)
    (rec,) = rep["recoveries"]
    assert rec["failed_coordinates"] == {"dp_replicate": 1, "dp_shard": 0, "tp": 1}
    assert rec["source"] == 1
    assert rec["source_coordinates"] == {"dp_replicate": 0, "dp_shard": 0, "tp": 1}
