"""The job's parallelism from the recipe's distributed section, computed in one place
(`Parallelism`): its mesh's sizes (report.json, the memory plan), where a rank sits in it, what
the supervisor is told; and whether tensor parallelism can split a model (the pre-flight's
refusal, before any worker starts)."""
from __future__ import annotations

from dataclasses import dataclass

from checkpointless.protocol import Layout

# the plan's words that map onto torch's styles; others (gpt-oss's embedding_rowwise, the packed
# experts) are refused with the reason
STYLES = ("colwise", "rowwise")
# what the head and KV split needs to divide, by the config's field names
_DIVIDES = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


@dataclass(frozen=True)
class Parallelism:
    """The degrees of parallelism of a recipe, computed once from its distributed section: what
    the supervisor is told, the memory plan counts and the report names."""
    processes: int
    nodes: int
    strategy: str  # ddp, fsdp or hsdp
    tp: int = 1
    pp: int = 1
    shard_size: int = 0  # hsdp: processes per replica group of one stage (dp_shard x tp)

    @property
    def per_node(self) -> int:
        return self.processes // self.nodes

    @property
    def stage(self) -> int:
        """The processes of one pipeline stage (all of them without pp)."""
        return self.processes // self.pp

    @property
    def ways(self) -> int:
        """Into how many slices a stage's sharded state is cut (1 under ddp)."""
        if self.strategy == "ddp":
            return 1
        return self.shard_size if self.strategy == "hsdp" and self.shard_size else self.stage

    @property
    def groups(self) -> int:
        """Replica groups of a stage, each holding the whole stage (ddp: every process)."""
        return self.stage // self.ways

    @property
    def data_world(self) -> int:
        """Shares of a step's batch: a tp group trains on one, a pipeline's stages on the
        pipeline's (launcher/train/pipeline.py: its first stage reads pp_size of them)."""
        return self.processes // self.tp

    @property
    def replica_group_size(self) -> int:
        """The Spec's `shard_size`: hsdp's replica group; under ddp with stages every process
        a replica group of its own (1); else 0, no replica groups (mesh.py)."""
        if self.strategy == "hsdp":
            return self.shard_size
        return 1 if self.strategy == "ddp" and self.pp > 1 else 0

    def sizes(self) -> dict[str, int]:
        """The mesh as report.json and the plan name it: {"dp_replicate", "dp_shard", "tp",
        "pp"} (ddp: every worker a whole replica)."""
        if self.strategy == "ddp":
            return {"dp_replicate": self.stage, "dp_shard": 1, "tp": 1, "pp": self.pp}
        return {"dp_replicate": self.groups, "dp_shard": self.ways // self.tp, "tp": self.tp,
                "pp": self.pp}

    def layout(self) -> Layout:
        """The launch's Layout (checkpointless.protocol.layout): ranks to coordinates."""
        m = self.sizes()
        return Layout(self.processes, m["dp_shard"] * m["tp"], m["tp"], m["pp"])


def parallelism_of(d) -> Parallelism:
    """The Parallelism of a recipe's (resolved) distributed section."""
    return Parallelism(d.num_processes, max(1, d.num_nodes), d.strategy, d.tp_size, d.pp_size,
                       d.shard_size if d.strategy == "hsdp" else 0)


def mesh_sizes(d) -> dict[str, int]:
    """The job's mesh from the recipe's distributed section (Parallelism.sizes)."""
    return parallelism_of(d).sizes()


def coordinates(d, rank: int) -> dict[str, int]:
    """Where `rank` sits in the mesh (ddp: every worker a replica group of its own)."""
    return parallelism_of(d).layout().coords(rank)


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
