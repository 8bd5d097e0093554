"""Pipeline parallel, in-process: the mesh with a pp dimension, the split of the layers, the stage
forward against the whole model's, the restore's per-stage agreement and the refusals."""
import itertools
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from checkpointless.worker.agreement import replicated_step  # noqa: E402
from checkpointless.worker.mesh import Layout  # noqa: E402
from launcher.recipe.load import RecipeError, load  # noqa: E402


def test_stages_are_outermost_so_a_stage_is_consecutive_ranks_and_twins_stay_in_their_stage():
    lay = Layout(8, 2, pp=2)  # 2 stages x (2 replica groups x dp_shard 2)
    assert lay.dims() == ("pp", "dp_replicate", "dp_shard")
    assert lay.mesh() == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert lay.stage_ranks(1) == [4, 5, 6, 7] and lay.pp_ranks(1) == [1, 5]
    assert lay.twins(5) == [7] and lay.twins(0) == [2]  # never the other stage's rank
    assert lay.coords(6) == {"pp": 1, "dp_replicate": 1, "dp_shard": 0, "tp": 0}
    assert [lay.data_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]  # a pipeline, one share
    groups = lay.all_groups()
    assert ("pp", [0, 4]) in groups and ("dp_shard", [4, 5]) in groups
    assert ("dp_replicate", [5, 7]) in groups
    # every rank is in exactly one group of each dimension
    for dim in ("pp", "dp_replicate", "dp_shard"):
        ranks = sorted(r for d, g in groups if d == dim for r in g)
        assert ranks == list(range(8)), dim


def test_ddp_stages_make_each_worker_a_replica_group_and_a_stage_on_one_node_is_lost_with_it():
    lay = Layout(4, 1, pp=2)  # ddp: 2 stages x 2 replicas
    assert lay.replicate_ranks(0) == [0, 1] and lay.replicate_ranks(1) == [2, 3]
    assert lay.twins(3) == [2] and lay.twins(0) == [1]
    assert lay.lost_with_a_node(ranks_per_node=2) == [0, 1]  # each node holds a whole stage
    assert lay.lost_with_a_node(ranks_per_node=1) == []
    with pytest.raises(ValueError):
        Layout(6, 1, pp=4)


def _brute(layers, parts, per, first, last):
    best = None
    for cut in itertools.combinations(range(1, layers), parts - 1):
        counts = [b - a for a, b in zip((0, *cut), (*cut, layers))]
        worst = max(n * per + (first if i == 0 else 0) + (last if i == parts - 1 else 0)
                    for i, n in enumerate(counts))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize("layers,parts,first,last", [(4, 2, 0, 0), (4, 2, 25, 0), (9, 3, 12, 30),
                                                     (12, 4, 7, 7), (5, 5, 100, 1)])
def test_the_split_minimizes_the_largest_stage_counting_embedding_and_head(layers, parts,
                                                                          first, last):
    from launcher.parallel.pipeline_split import split
    got = split(layers, parts, 10, first, last)
    assert sum(got) == layers and min(got) >= 1 and len(got) == parts
    worst = max(n * 10 + (first if i == 0 else 0) + (last if i == parts - 1 else 0)
                for i, n in enumerate(got))
    assert worst == _brute(layers, parts, 10, first, last)


def test_the_split_of_tiny_llama_and_of_405b_by_parameter_count():
    from launcher.parallel.pipeline_split import describe, layer_counts, split, summary
    from launcher.plan.model import hf_config
    cfg = load("tiny-llama", ["distributed.pp_size=2"])
    hf = hf_config(cfg)[0]
    counts = layer_counts(cfg, hf)
    assert sum(counts) == 4 and len(counts) == 2
    assert describe([2, 2], 2) == "stage 0: layers 0-1 +embed; stage 1: layers 2-3 +norm,head"
    s = summary(load("tiny-llama", ["distributed.pp_size=2",
                                    "distributed.pp_schedule=interleaved-1f1b",
                                    "distributed.pp_layers=[1,1,1,1]"]), hf)
    assert s["layers_by_worker_stage"] == [[0, 2], [1, 3]] and s["microbatches"] == 2
    # 126 layers over 16 stages with a large embedding and head: the ends hold fewer layers
    big = split(126, 16, 1000, 8000, 8000)
    assert sum(big) == 126 and big[0] < big[7] and big[-1] < big[7]


@pytest.mark.parametrize("overrides,key", [
    (["distributed.pp_size=3"], "distributed.pp_size=3: must divide"),
    (["distributed.pp_size=4"], "distributed.pp_size=4: leaves each stage one worker under ddp"),
    (["distributed.pp_size=2", "eval.every=5"], "eval.every=5: with distributed.pp_size=2"),
    (["distributed.pp_size=2", "distributed.pp_microbatches=3"],
     "distributed.pp_microbatches=3: must divide the 16 rows"),
    (["distributed.pp_size=2", "distributed.pp_schedule=interleaved-1f1b",
      "distributed.pp_microbatches=1"], "interleaved-1f1b runs microbatches in rounds"),
    (["distributed.pp_layers=[2,2]"], "distributed.pp_layers=[2, 2]: applies with"),
    (["distributed.pp_size=2", "peft.method=lora"], "peft.method='lora': with distributed.pp"),
    (["distributed.pp_size=2", "checkpointless.audit.every=2", "checkpoint.interval=4"],
     "checkpointless.audit.every=2: with distributed.pp_size=2"),
])
def test_pipeline_keys_that_cannot_apply_are_refused_before_launch_naming_the_key(overrides,
                                                                                  key):
    with pytest.raises(RecipeError) as exc:
        load("tiny-llama", overrides)
    assert key in str(exc.value) and "Fix" in str(exc.value), str(exc.value)


def test_models_without_a_pipeline_plan_or_layers_enough_are_refused_with_the_reason():
    from launcher.parallel.pipeline_split import refusal
    from launcher.plan.model import hf_config
    cfg = load("tiny-llama", ["distributed.pp_size=2"])
    assert refusal(cfg, hf_config(cfg)[0]) is None
    gpt2 = load("tiny-gpt2", ["distributed.pp_size=2"])
    assert "has no pipeline plan" in refusal(gpt2, hf_config(gpt2)[0])
    cfg = load("tiny-llama", ["distributed.pp_size=2", "distributed.pp_layers=[1,2]"])
    assert "pp_layers=[1, 2]: needs 2 entries" in refusal(cfg, hf_config(cfg)[0])


def test_the_stages_forward_in_sequence_gives_the_whole_models_logits_and_loss_to_the_bit():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from launcher.train.pipeline import StagePart, StageView
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=4, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=32))
    ids = torch.randint(0, 64, (2, 16))
    want = model(input_ids=ids, labels=ids)
    first = StagePart(model, [0, 2], True, False)  # interleaved: layers 0 and 2 on one worker
    last = StagePart(model, [1, 3], False, True)
    views = [StageView(first, [0], True, False), StageView(last, [1], False, False),
             StageView(first, [2], False, False), StageView(last, [3], False, True)]
    h = ids
    for v in views:
        h = v(h)
    assert torch.equal(h, want.logits)
    loss = last.loss_function(logits=h, labels=ids, vocab_size=64)
    assert torch.equal(loss, want.loss)
    names = {n for n, _ in model.named_parameters()}
    mine = [n for part in (first, last) for n, _ in part.named_parameters()]
    assert sorted(mine) == sorted(names)  # each parameter once, under the whole model's name


def test_a_replicated_restore_resumes_where_every_stage_has_a_source():
    stages = [[0, 1], [2, 3]]
    assert replicated_step([5, 4, 5, 5], stages) == 5  # rank 1 receives from rank 0
    assert replicated_step([-1, 3, 3, 3], stages) == 3  # a spare took rank 0
    with pytest.raises(RuntimeError, match="different steps"):
        replicated_step([5, 5, 4, 4], stages)
    with pytest.raises(RuntimeError, match="stage 1"):
        replicated_step([5, 5, -1, -1], stages)
