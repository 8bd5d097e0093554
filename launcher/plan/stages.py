"""The plan of a pipelined recipe (`distributed.pp_size` > 1): one plan per worker stage, and the
heaviest of them is the rank's plan.

A stage's plan counts its own parameters (its decoder layers, the embedding on the first stage,
the final norm and lm_head on the last), sharded over the stage's ranks (num_processes /
pp_size), not the world; the activations of the microbatches its schedule keeps in flight; the
schedule's receive buffers; the logits on the last stage only. The layers of each stage are the
loop's (`pipeline.layer_counts`, from the same config fields). What is counted, and why:
docs/memory-plan.md, "Pipeline stages".
"""
from __future__ import annotations

import math
from dataclasses import replace
from types import SimpleNamespace

from launcher.parallel import pipeline_split as pipeline
from launcher.recipe.load import RecipeError
from launcher.plan.budget import device_budget, host_budget, ranks_per_node
from launcher.plan.items import _at, _end_items, _layer_bytes, _quadratic, _setup, _state_items, _summary
from launcher.plan.model import ModelFacts
from launcher.plan.report import PHASES, Item, Plan, fmt_gb

_PASSES = ("forward", "loss backward", "layer backward")


def config_of(facts: ModelFacts) -> SimpleNamespace:
    """The config fields `pipeline.layer_counts` reads, from the measured model: the plan
    splits the layers as the loop does (it estimates from the same fields)."""
    head_dim = facts.q_dim // facts.heads
    return SimpleNamespace(
        hidden_size=facts.hidden, intermediate_size=facts.intermediate, vocab_size=facts.vocab,
        num_attention_heads=facts.heads, num_key_value_heads=facts.kv_dim // head_dim,
        head_dim=head_dim, tie_word_embeddings=facts.lm_head_params == 0,
        num_hidden_layers=facts.n_layers)


def layer_split(cfg, facts: ModelFacts) -> list[int]:
    """Decoder layers per (virtual) stage, first to last, as the loop splits them."""
    d = cfg.distributed
    stages = d.pp_size * pipeline.virtual_stages(d)
    try:
        counts = pipeline.layer_counts(cfg, config_of(facts))
    except ValueError as exc:
        raise RecipeError(f"distributed.pp_size={d.pp_size}: {exc}. Fix: distributed.pp_size "
                          f"at most {facts.n_layers // (stages // d.pp_size)}") from None
    if len(counts) != stages or sum(counts) != facts.n_layers or min(counts) < 1:
        raise RecipeError(f"distributed.pp_layers={counts}: needs {stages} entries of at least "
                          f"1 summing to the model's {facts.n_layers} decoder layers")
    return counts


def splits_evenly(cfg) -> bool:
    """Whether the worker's rows per step divide into the pipeline's microbatches (and, under
    interleaved 1F1B, the microbatches into rounds of pp_size), as validation requires."""
    d = cfg.distributed
    if d.pp_size <= 1:
        return True
    rows, micro = pipeline.rows_per_step(cfg), pipeline.microbatches(cfg)
    return rows % micro == 0 and (d.pp_schedule != "interleaved-1f1b" or micro % d.pp_size == 0)


def in_flight(schedule: str, pp: int, p: int, n_micro: int, v: int) -> int:
    """(Chunk-)forwards whose activations stage p holds at once: every microbatch under GPipe;
    pp - p under 1F1B (its warm-up, then one forward per backward); under interleaved 1F1B
    about (v-1)*pp + 2*(pp-p-1) + 1 chunks, each of the stage's layers / v."""
    if schedule == "gpipe":
        return n_micro
    if schedule == "1f1b":
        return min(n_micro, pp - p)
    return min((v - 1) * pp + 2 * (pp - p - 1) + 1, n_micro * v)


def stage_facts(facts: ModelFacts, counts: list[int], p: int, pp: int) -> ModelFacts:
    """The model as worker stage p holds it: its layers, the embedding on the first stage, the
    final norm and head on the last. `head_matmul` becomes the largest tensor the stage holds
    (what the export gathers), `lm_head_params` the head's only on the last stage."""
    v = len(counts) // pp
    n = sum(counts[p + i * pp] for i in range(v))
    first, last = p == 0, p == pp - 1
    embed = facts.root_params - facts.lm_head_params - facts.hidden  # less the final norm
    head = facts.hidden + facts.head_matmul  # the final norm and the weight lm_head multiplies
    root = (embed if first else 0) + (head if last else 0)
    block_matmul = (facts.matmul_params - facts.head_matmul) // max(1, facts.n_layers)
    biggest = max((i * o for _, i, o, in_first in facts.linears if in_first), default=0)
    root_split = max(0, facts.tp_split_params - facts.n_layers * facts.tp_block_split)
    return replace(
        facts, n_params=n * facts.block_params + root, n_layers=n, root_params=root,
        lm_head_params=facts.lm_head_params if last else 0,
        head_matmul=max(biggest, embed if first else 0, facts.head_matmul if last else 0),
        matmul_params=n * block_matmul + (facts.head_matmul if last else 0),
        tp_split_params=n * facts.tp_block_split + (root_split if first else 0))


def _stage_setup(cfg, sf: ModelFacts, n_micro: int):
    """The rows' shared numbers for a stage: sharded over the stage's ranks, a microbatch's
    tokens, gradients accumulated over the microbatches, no ddp buckets (a stage's gradients
    are all-reduced flat after the schedule)."""
    d = cfg.distributed
    world = d.num_processes // d.pp_size
    ways = d.shard_size if d.strategy == "hsdp" and d.shard_size else world
    tokens = math.ceil(pipeline.rows_per_step(cfg) * cfg.data.seq_len / n_micro)
    return replace(_setup(cfg, sf), world=world, ways=ways, groups=max(1, world // ways),
                   accum=n_micro, tokens=tokens, grad_sync_buckets=False)


def _state(s, gpipe: bool) -> list:
    """Parameters, gradients and moments of the stage. Under fsdp the sharded gradients exist
    from the step's one reduce-scatter (after every microbatch's backward) to the optimizer;
    under ddp they accumulate from the first backward (which 1F1B runs between forwards)."""
    items = _state_items(s)
    for it in items:
        if it.name == "gradients":
            phases = ("optimizer step",) if s.fsdp else \
                ((() if gpipe else ("forward",)) + _PASSES[1:] + ("optimizer step",))
            it.device = _at(it.device_max, *phases)
    return items


def _fsdp(s, sf: ModelFacts, gpipe: bool) -> list:
    """torch's pipeline schedules run each microbatch's backward with FSDP's resharding after
    backward and its gradient reduction off, and reduce once after the last: from the first
    backward on, the stage's blocks stay gathered and their gradients accumulate unsharded."""
    if not s.fsdp:
        return []
    blocks = sf.n_layers * s.block(sf)
    kept = ("loss backward", "layer backward") + (() if gpipe else ("forward",))
    items = [Item("root unit unsharded", _at(sf.root_params * s.cb, *_PASSES),
                  note="fsdp: the first stage's embedding, the last's norm and lm_head"),
             Item("stage's blocks unsharded",
                  {"forward": (2 * s.block(sf) if gpipe else blocks) * s.cb,
                   "loss backward": blocks * s.cb, "layer backward": blocks * s.cb},
                  note=f"pipelined fsdp: {sf.n_layers} blocks kept gathered from a backward to "
                  "the step's reduce-scatter" + (f", split linears 1/{s.tp}" if s.tp > 1 else ""))]
    if not s.lora:
        items.append(Item("stage's gradients unsharded",
                          _at((blocks + sf.root_params) * s.gb, *kept),
                          note="accumulated over the microbatches, reduce-scattered once"))
    return items


def _autocast(s, sf: ModelFacts, loop, held: int) -> list:
    """autocast's bf16 copies of fp32 weights (ddp): the schedule's step runs inside one
    autocast region, so its cache holds one copy of each of the stage's weights throughout."""
    if not (s.bf16 and s.pb == 4 and not s.mp):
        return []
    if loop.autocast_cache:
        return [Item("bf16 weight copies", _at(2 * sf.matmul_params, *_PASSES),
                     note="autocast cache, held through the schedule's step")]
    per = sf.lm_head_params if s.ckpt else sf.matmul_params
    return [Item("bf16 weight copies", _at(2 * per * held, *_PASSES),
                 note=f"saved for backward by each of {held} forwards in flight")]


def _activations(s, sf: ModelFacts, cfg, where: dict) -> list:
    """What the stage's forwards in flight keep for backward, one layer's backward, the
    schedule's receive buffers and, on the last stage, the logits (every microbatch's under
    GPipe, which computes each loss in forward)."""
    held, v, n_micro = where["held"], where["v"], where["n_micro"]
    h, tokens = sf.hidden, s.tokens
    layer = _layer_bytes(s, sf, cfg, False)
    if where["quadratic"]:
        layer += int(2.5 * s.p * (sf.heads // s.tp) * cfg.data.seq_len * tokens)
    per_chunk = (sf.n_layers / v) * (s.r * h * tokens if s.ckpt else layer)
    held_logits = (n_micro if where["gpipe"] else 1) if where["last"] else 0
    saved = int(held * per_chunk) + held_logits * (4 + s.r) * h * tokens
    items = [Item("activations kept for backward", _at(saved, *_PASSES),
                  note=f"{held} {'chunk-' if v > 1 else ''}forwards in flight x "
                  f"{sf.n_layers / v:g} layers, " + ("one hidden state per layer boundary"
                                                       if s.ckpt else "every layer's")),
             Item("one layer in backward", _at(layer * (2 if s.ckpt else 1), "layer backward"),
                  note=("recomputed + " if s.ckpt else "") + "its gradients")]
    if where["buffers"]:
        items.append(Item("pipeline receive buffers", _at(where["buffers"] * s.r * h * tokens),
                          note=f"{where['buffers']} microbatch buffers (activations in, "
                          "gradients in), kept by the stage"))
    if held_logits:
        logits = tokens * sf.vocab
        fwd = logits * (s.p + (4 if s.p != 4 else 0) + 4)
        items.append(Item("logits and loss", {"forward": held_logits * fwd,
                                              "loss backward": logits * 12
                                              + (held_logits - 1) * fwd},
                          note=f"{sf.vocab:,} x {tokens:,} tokens a microbatch, x {held_logits} "
                          "held, fp32 for the loss"))
    return items


def stage_plan(cfg, facts: ModelFacts, loop, device: str, counts: list[int], p: int) -> Plan:
    """Worker stage p's plan, per rank."""
    d = cfg.distributed
    pp, v, n_micro = d.pp_size, len(counts) // d.pp_size, pipeline.microbatches(cfg)
    sf = stage_facts(facts, counts, p, pp)
    s = _stage_setup(cfg, sf, n_micro)
    gpipe = d.pp_schedule == "gpipe"
    held = in_flight(d.pp_schedule, pp, p, n_micro, v)
    mine = [p + i * pp for i in range(v)]  # this worker's virtual stages
    where = {"held": held, "v": v, "n_micro": n_micro, "gpipe": gpipe, "last": p == pp - 1,
             "quadratic": _quadratic(sf, device, s.masked),
             "buffers": n_micro * sum((i != 0) + (i != len(counts) - 1) for i in mine)}
    items = [*_state(s, gpipe), *_fsdp(s, sf, gpipe), *_autocast(s, sf, loop, held),
             *_activations(s, sf, cfg, where), *_end_items(s, sf, cfg, device)]
    budget, budget_source = device_budget(cfg, device)
    host, host_source = host_budget(cfg, device)
    return Plan(recipe=cfg.run.name, facts=facts, overrides=[], device_type=device,
                budget=budget, budget_source=budget_source, items=items, trainable=facts.n_params,
                phases={ph: sum(i.device.get(ph, 0) for i in items) for ph in PHASES},
                summary=_summary(replace(s, world=d.num_processes,
                                         accum=cfg.trainer.grad_accum_steps),
                                 cfg, facts, device, where["quadratic"]),
                host_budget=host, host_source=host_source, ranks_per_node=ranks_per_node(cfg))


def pipeline_plan(cfg, facts: ModelFacts, loop, device: str) -> Plan:
    """The plan of each worker stage; the heaviest (by what it needs of the budget) is returned
    as the rank's plan, its summary naming the split, the schedule and each stage's need."""
    d = cfg.distributed
    counts = layer_split(cfg, facts)
    plans = [stage_plan(cfg, facts, loop, device, counts, p) for p in range(d.pp_size)]
    worst = max(range(d.pp_size), key=lambda p: plans[p].need)
    result = plans[worst]
    result.stages = [pl.need for pl in plans]
    result.heaviest = worst
    n_micro = pipeline.microbatches(cfg)
    rows = pipeline.rows_per_step(cfg) / n_micro
    result.summary += (
        f"; pipeline: {d.pp_size} stages of {d.num_processes // d.pp_size} ranks, "
        f"{d.pp_schedule}, {n_micro} microbatches of {rows:g} rows; split: "
        f"{pipeline.describe(counts, d.pp_size)}; heaviest: stage {worst} "
        f"({fmt_gb(result.need)}; the table is its rank's)")
    return result
