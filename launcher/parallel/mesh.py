"""The job's mesh from the recipe's distributed section, computed in one place: its sizes
(report.json, the memory plan), where a rank sits in it, and whether tensor parallelism can
split a model (the pre-flight's refusal, before any worker starts)."""
from __future__ import annotations

from checkpointless.protocol import Layout

# the plan's words that map onto torch's styles; others (gpt-oss's embedding_rowwise, the packed
# experts) are refused with the reason
STYLES = ("colwise", "rowwise")
# what the head and KV split needs to divide, by the config's field names
_DIVIDES = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def mesh_sizes(d) -> dict[str, int]:
    """The job's mesh as report.json and the plan name it, from the recipe's distributed section:
    {"dp_replicate", "dp_shard", "tp", "pp"} (ddp: every worker a whole replica)."""
    pp = d.pp_size
    n, tp = d.num_processes // pp, d.tp_size  # the workers of one pipeline stage
    if d.strategy == "ddp":
        return {"dp_replicate": n, "dp_shard": 1, "tp": 1, "pp": pp}
    group = d.shard_size if d.strategy == "hsdp" and d.shard_size else n
    return {"dp_replicate": n // group, "dp_shard": group // tp, "tp": tp, "pp": pp}


def layout_of(d) -> Layout:
    """The launch's Layout (checkpointless.protocol.layout) of the recipe's distributed section."""
    m = mesh_sizes(d)
    return Layout(d.num_processes, m["dp_shard"] * m["tp"], m["tp"], m["pp"])


def coordinates(d, rank: int) -> dict[str, int]:
    """Where `rank` sits in the mesh (ddp: every worker a replica group of its own)."""
    return layout_of(d).coords(rank)


def refusal(tp: int, hf) -> str | None:
    """Why distributed.tp_size=`tp` cannot split the model of config `hf`, with the fix; None
    when it can (or tp is 1)."""
    if tp <= 1:
        return None
    key = f"distributed.tp_size={tp}"
    plan = getattr(hf, "base_model_tp_plan", None) or {}
    kind = type(hf).__name__
    if not plan:
        why = (" (GPT-2's attention is one fused Conv1D for q, k and v, which a column split "
               "would cut across the three)") if getattr(hf, "model_type", "") == "gpt2" else ""
        return (f"{key}: {kind} ships no tensor-parallel plan{why}. Fix: distributed.tp_size=1 "
                "with distributed.strategy=fsdp (sharding needs no plan)")
    other = sorted({v for v in plan.values() if v not in STYLES})
    if other:
        return (f"{key}: {kind}'s tensor-parallel plan uses {', '.join(other)} (its mixture of "
                "experts and embedding splits are not column or row splits of a linear layer). "
                "Fix: distributed.tp_size=1 with distributed.strategy=fsdp")
    for field in _DIVIDES:
        value = getattr(hf, field, None)
        if value and value % tp:
            fits = [t for t in range(2, value + 1) if value % t == 0][:4]
            return (f"{key}: the model's {field}={value} is not a multiple of {tp}, so its "
                    f"heads or columns cannot be split evenly. Fix: distributed.tp_size in "
                    f"{fits or [1]} (a divisor of every one of {', '.join(_DIVIDES)})")
    return None
