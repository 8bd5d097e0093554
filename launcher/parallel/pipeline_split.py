"""The pipeline's arithmetic (`distributed.pp_size`), shared by the memory plan, the pre-flight
and the workers: the schedules, which layers each stage holds (by parameter count or
`distributed.pp_layers`), how many rows a step takes and in how many microbatches, and why a
model cannot be split. The stages themselves run in launcher/train/pipeline.py."""
from __future__ import annotations

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B",
             "interleaved-1f1b": "ScheduleInterleaved1F1B"}
# the pipeline plan this loop knows how to run: a Llama-like decoder (rotary positions, one
# causal mask for every layer)
PLAN = ("embed_tokens", "layers", "norm")


def virtual_stages(d) -> int:
    """Stages per worker: two under interleaved 1F1B, else one."""
    return 2 if d.pp_schedule == "interleaved-1f1b" else 1


def rows_per_step(cfg) -> int:
    """The rows one pipeline trains on per step: those of its pp_size workers, as ddp would
    give them (micro_batch_size x grad_accum_steps each), so that turning pp on keeps the
    recipe's batch: a pipelined run trains the same rows as the same recipe under ddp."""
    t = cfg.trainer
    return cfg.distributed.pp_size * t.micro_batch_size * t.grad_accum_steps


def microbatches(cfg) -> int:
    """Pipeline microbatches per step: distributed.pp_microbatches, or one per micro-batch of
    the pipeline's workers (pp_size x grad_accum_steps, each micro_batch_size rows)."""
    d = cfg.distributed
    return d.pp_microbatches or d.pp_size * cfg.trainer.grad_accum_steps


def split(layers: int, parts: int, per_layer: int, first_extra: int = 0,
          last_extra: int = 0) -> list[int]:
    """Decoder layers per part, at least one each, summing to `layers`, so that the largest
    part's parameters (the first's with the embedding, the last's with the norm and head) are
    as few as possible; among equal choices the earlier parts take fewer layers."""
    if not 1 <= parts <= layers:
        raise ValueError(f"{layers} layers cannot be split into {parts} parts")

    def cost(i: int, n: int) -> int:
        return n * per_layer + (first_extra if i == 0 else 0) + \
            (last_extra if i == parts - 1 else 0)

    # best[i][k]: the least largest part when parts i.. hold the last k layers
    best = [[None] * (layers + 1) for _ in range(parts + 1)]
    choice = [[0] * (layers + 1) for _ in range(parts + 1)]
    best[parts][0] = 0
    for i in range(parts - 1, -1, -1):
        for k in range(parts - i, layers - i + 1):
            for n in range(1, k - (parts - i - 1) + 1):
                rest = best[i + 1][k - n]
                if rest is None:
                    continue
                worst = max(cost(i, n), rest)
                if best[i][k] is None or worst < best[i][k]:
                    best[i][k], choice[i][k] = worst, n
    out, k = [], layers
    for i in range(parts):
        out.append(choice[i][k])
        k -= out[-1]
    return out


def layer_counts(cfg, hf, params: dict[str, int] | None = None) -> list[int]:
    """Decoder layers per (virtual) stage, first to last: distributed.pp_layers when set, else
    `split` by parameter count (`params`: per-layer, embedding and head counts; estimated from
    the config when not given)."""
    d = cfg.distributed
    if d.pp_layers:
        return list(d.pp_layers)
    h, inter, vocab = hf.hidden_size, hf.intermediate_size, hf.vocab_size
    heads, kv = hf.num_attention_heads, getattr(hf, "num_key_value_heads", None) or \
        hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or h // heads
    p = params or {"layer": h * head_dim * (2 * heads + 2 * kv) + 3 * h * inter + 2 * h,
                   "embed": vocab * h,
                   "head": h + (0 if getattr(hf, "tie_word_embeddings", False) else vocab * h)}
    return split(hf.num_hidden_layers, d.pp_size * virtual_stages(d), p["layer"], p["embed"],
                 p["head"])


def refusal(cfg, hf) -> str | None:
    """Why distributed.pp_size cannot split the model of config `hf` as asked, with the fix;
    None when it can (or pp is 1)."""
    d = cfg.distributed
    if d.pp_size <= 1:
        return None
    key, kind = f"distributed.pp_size={d.pp_size}", type(hf).__name__
    plan = tuple(getattr(hf, "base_model_pp_plan", None) or ())
    if plan != PLAN:
        what = f"a pipeline plan over {', '.join(plan)}" if plan else "no pipeline plan"
        return (f"{key}: {kind} has {what}; this loop pipelines Llama-like decoders (a plan "
                f"over {', '.join(PLAN)}: Llama, Qwen2, Mistral). Fix: distributed.pp_size=1")
    stages = d.pp_size * virtual_stages(d)
    if hf.num_hidden_layers < stages:
        return (f"{key}: the model has {hf.num_hidden_layers} decoder layers, fewer than its "
                f"{stages} (virtual) stages. Fix: distributed.pp_size at most "
                f"{hf.num_hidden_layers // virtual_stages(d)}")
    if d.pp_layers:
        got = list(d.pp_layers)
        if len(got) != stages or min(got) < 1 or sum(got) != hf.num_hidden_layers:
            return (f"distributed.pp_layers={got}: needs {stages} entries of at least 1 (one "
                    f"per {'virtual ' if stages > d.pp_size else ''}stage) summing to the "
                    f"model's {hf.num_hidden_layers} decoder layers. Fix: e.g. "
                    f"distributed.pp_layers={split(hf.num_hidden_layers, stages, 1)}, or unset "
                    "it to split by parameter count")
    return None


def stage_layers(counts: list[int]) -> list[list[int]]:
    """The layer indices of each (virtual) stage, from its count of layers."""
    out, first = [], 0
    for n in counts:
        out.append(list(range(first, first + n)))
        first += n
    return out


def describe(counts: list[int], pp: int) -> str:
    """The split as the start line prints it: each worker stage's layers."""
    layers = stage_layers(counts)
    v = len(counts) // pp
    parts = []
    for p in range(pp):
        mine = [layers[p + i * pp] for i in range(v)]
        spans = "+".join(f"{m[0]}-{m[-1]}" if len(m) > 1 else f"{m[0]}" for m in mine)
        extra = (" +embed" if p == 0 else "") + (" +norm,head" if p == pp - 1 else "")
        parts.append(f"stage {p}: layers {spans}{extra}")
    return "; ".join(parts)


def summary(cfg, hf) -> dict:
    """What report.json and the plan say of the pipeline: schedule, microbatches, the split."""
    d = cfg.distributed
    counts = layer_counts(cfg, hf)
    layers = stage_layers(counts)
    v = virtual_stages(d)
    return {"stages": d.pp_size, "schedule": d.pp_schedule, "microbatches": microbatches(cfg),
            "virtual_stages_per_worker": v, "layers_per_stage": counts,
            "split": describe(counts, d.pp_size),
            "layers_by_worker_stage": [[i for k in range(v) for i in layers[p + k * d.pp_size]]
                                       for p in range(d.pp_size)]}
