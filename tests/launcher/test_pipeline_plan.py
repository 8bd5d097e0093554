"""The memory plan of pipelined recipes (launcher/plan/stages.py): one plan per worker stage, the
heaviest reported as the rank's. Meta device only: no weights, offline, no training process."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from functools import lru_cache

import pytest

from launcher import plan as P
from launcher.plan import stages as S
from launcher.recipe.load import load


@lru_cache(maxsize=None)
def facts(name: str):
    return P.model_facts(load(name))


def item(plan, name: str) -> int:
    return next(i.device_max for i in plan.items if i.name == name)


def test_the_405b_config_has_the_published_parameter_count():
    f = facts("llama3.1-405b")
    assert f.n_params == pytest.approx(405.85e9, rel=0.001) and f.n_layers == 126
    assert (f.hidden, f.heads, f.kv_dim // 128, f.intermediate, f.vocab) == \
        (16384, 128, 8, 53248, 128256) and f.lm_head_params == f.vocab * f.hidden  # untied


def test_the_405b_recipe_fits_80_gb_gpus_on_every_stage(capsys):
    cfg = load("llama3.1-405b", ["distributed.device_memory_gb=80"])
    result = P.plan(cfg, facts("llama3.1-405b"))
    assert result.fits and result.need <= 80e9
    assert len(result.stages) == 16 and max(result.stages) == result.need
    assert result.stages[result.heaviest] == result.need
    assert P.main(["llama3.1-405b", "distributed.device_memory_gb=80"]) == 0
    out = capsys.readouterr().out
    assert "fits:" in out and "by stage: 0 " in out


def test_the_summary_names_the_split_the_schedule_and_the_heaviest_stage():
    result = P.plan(load("llama3.1-405b"), facts("llama3.1-405b"))
    s = result.summary
    assert "pipeline: 16 stages of 16 ranks, 1f1b, 32 microbatches of 1 rows" in s
    assert "split: stage 0: layers 0-3 +embed; stage 1: layers 4-10;" in s
    assert "stage 15: layers 121-125 +norm,head" in s
    assert f"heaviest: stage {result.heaviest} " in s
    assert "by stage:" in result.report()


def test_a_stage_holds_about_one_pp_th_of_the_parameters_at_the_same_stage_dp_size():
    """llama3-8b fsdp over 8 ranks against 4 stages of 8 ranks: the stages' parameter bytes sum
    to the whole plan's, and the heaviest stage holds about a quarter."""
    f = facts("llama3-8b")
    whole = P.plan(load("llama3-8b", ["distributed.num_processes=8"]), f, search=False)
    cfg = load("llama3-8b", ["distributed.num_processes=32", "distributed.pp_size=4",
                             "trainer.grad_accum_steps=4"])
    counts = S.layer_split(cfg, f)
    per_stage = [item(S.stage_plan(cfg, f, P.CURRENT_LOOP, "cuda", counts, p), "parameters")
                 for p in range(4)]
    assert sum(per_stage) == pytest.approx(item(whole, "parameters"), rel=1e-3)
    piped = P.plan(cfg, f, search=False)
    assert item(piped, "parameters") == pytest.approx(item(whole, "parameters") / 4, rel=0.15)
    assert item(piped, "optimizer state") < 0.3 * item(whole, "optimizer state")


def test_gpipe_holds_more_activations_than_1f1b():
    f = facts("llama3.1-405b")
    one = P.plan(load("llama3.1-405b"), f, search=False)
    gp = P.plan(load("llama3.1-405b", ["distributed.pp_schedule=gpipe"]), f, search=False)
    assert gp.need > one.need
    # stage 13 keeps 3 microbatches in flight under 1f1b, all 32 under gpipe
    cfg = load("llama3.1-405b", ["distributed.pp_schedule=gpipe"])
    counts = S.layer_split(cfg, f)
    kept = {sched: item(S.stage_plan(load("llama3.1-405b", [f"distributed.pp_schedule={sched}"]),
                                     f, P.CURRENT_LOOP, "cuda", counts, 13),
                        "activations kept for backward") for sched in ("gpipe", "1f1b")}
    assert kept["gpipe"] == pytest.approx(kept["1f1b"] * 32 / 3, rel=1e-6)
    # the last stage keeps every microbatch's logits under gpipe, one under 1f1b
    last = {sched: item(S.stage_plan(load("llama3.1-405b", [f"distributed.pp_schedule={sched}"]),
                                     f, P.CURRENT_LOOP, "cuda", counts, 15), "logits and loss")
            for sched in ("gpipe", "1f1b")}
    assert last["gpipe"] > 20 * last["1f1b"]


def test_microbatches_in_flight_per_schedule():
    assert [S.in_flight("1f1b", 4, p, 8, 1) for p in range(4)] == [4, 3, 2, 1]
    assert [S.in_flight("gpipe", 4, p, 8, 1) for p in range(4)] == [8] * 4
    assert [S.in_flight("interleaved-1f1b", 4, p, 8, 2) for p in range(4)] == [11, 9, 7, 5]
    assert S.in_flight("interleaved-1f1b", 4, 0, 2, 2) == 4  # capped by n_micro x v
    assert S.in_flight("1f1b", 8, 0, 2, 1) == 2


def test_only_the_first_stage_has_the_embedding_and_only_the_last_the_head_and_logits():
    f = facts("llama3.1-405b")
    cfg = load("llama3.1-405b")
    counts = S.layer_split(cfg, f)
    plans = [S.stage_plan(cfg, f, P.CURRENT_LOOP, "cuda", counts, p) for p in (0, 7, 15)]
    names = [{i.name for i in pl.items if i.device_max} for pl in plans]
    assert "logits and loss" in names[2] and "logits and loss" not in names[0] | names[1]
    assert "root unit unsharded" in names[0] and "root unit unsharded" in names[2]
    assert "root unit unsharded" not in names[1]
    first, middle = (S.stage_facts(f, counts, p, 16) for p in (0, 7))
    assert first.n_params - middle.n_params == pytest.approx(
        f.vocab * f.hidden - 4 * f.block_params, rel=1e-6)  # 4 layers + embed against 8 layers


def test_interleaved_gives_each_worker_two_virtual_stages():
    f = facts("llama3-8b")
    cfg = load("llama3-8b", ["distributed.num_processes=32", "distributed.pp_size=4",
                             "distributed.pp_schedule=interleaved-1f1b",
                             "trainer.grad_accum_steps=8"])
    counts = S.layer_split(cfg, f)
    assert len(counts) == 8 and sum(counts) == 32
    from launcher.parallel.pipeline_split import describe
    result = P.plan(cfg, f, search=False)
    assert len(result.stages) == 4 and describe(counts, 4) in result.summary
    assert "stage 1: layers " in result.summary and "+" in result.summary.split("stage 1:")[1]
    kept = next(i for i in result.items if i.name == "activations kept for backward")
    assert "chunk-forwards in flight" in kept.note


def test_the_fix_search_tries_only_valid_pipelined_candidates_and_suggests_1f1b():
    cfg = load("llama3.1-405b", ["distributed.pp_schedule=gpipe",
                                 "distributed.device_memory_gb=80"])
    cands = P.candidates(cfg)
    assert cands[0] == {"distributed.pp_schedule": "1f1b"}
    assert all(S.splits_evenly(load("llama3.1-405b", [f"{k}={v}" for k, v in c.items()]))
               for c in cands)
    assert {"trainer.micro_batch_size": 1, "trainer.grad_accum_steps": 1} not in cands
    result = P.plan(cfg, facts("llama3.1-405b"))
    assert not result.fits and result.fix == ["distributed.pp_schedule=1f1b"]
