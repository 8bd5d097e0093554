"""The rows of the plan: what one rank holds, and in which phases of a step, for a recipe and its
model. Each function below adds one family of rows; docs/memory-plan.md says why each is counted
the way it is."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from checkpointless.worker import KEEP as KEEP_VERSIONS  # versions of each replica kept
from checkpointless.worker import ROLLBACK_KEEP as ROLLBACK_VERSIONS  # hsdp's own snapshots

from launcher.plan.budget import device_budget, host_budget, ranks_per_node
from launcher.plan.model import ModelFacts, lora_targets
from launcher.plan.report import PHASES, Item, Plan, fmt_gb
from launcher.recipe.schema import SHARDED
from launcher.parallel.mesh import mesh_sizes

CUDA_RUNTIME = 2 * 10 ** 9  # CUDA context, NCCL buffers, allocator slack: an allowance
CPU_RUNTIME = 10 ** 9 // 2  # Python, torch, transformers and datasets in one worker process
ADAPTER_BYTES = 4  # peft keeps adapters in fp32 (autocast_adapter_dtype) over any base
HOSTED_BYTES = 4  # a hosted logical rank's contribution: fp32 (worker/hosting.py)
# attention implementations with a kernel that keeps no s^2 matrix
_MEMORY_EFFICIENT = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


@dataclass(frozen=True)
class LoopFacts:
    """What the training loop does that decides memory and that the recipe does not say."""
    autocast_cache: bool = True  # accelerate's torch.autocast keeps its default cache_enabled


CURRENT_LOOP = LoopFacts()


@dataclass(frozen=True)
class _Setup:
    """The numbers every family of rows reads, derived once from the recipe and the model."""
    world: int
    ways: int  # ranks a parameter is sharded over: the world (fsdp), a replica group (hsdp)
    tp: int  # tensor parallel: the plan's linears split tp ways, the rest whole per tp group
    split: float  # share of the parameters the tp plan splits
    groups: int  # replica groups (hsdp; 1 otherwise): each holds every slice
    fsdp: bool
    lora: bool
    ckpt: bool  # model.gradient_checkpointing
    accum: int
    bf16: bool  # half-precision autocast: 2-byte activations
    mp: bool  # fsdp + bf16: FSDP2's bf16 policy over fp32 master state
    pb: int  # bytes of a stored parameter
    cb: int  # bytes of a parameter as forward and backward use it
    gb: int  # bytes of a gradient before its reduce-scatter (fp32 reduce_dtype under mp)
    p: int  # bytes of a matmul activation
    r: int  # bytes of the residual stream
    dname: str
    tokens: int  # per micro-batch
    masked: bool  # chat and instruction data carry an attention mask
    targets: list  # LoRA's adapted linears
    adapters: int
    trainable: int
    tb: int  # bytes of a trained parameter, its gradient and each AdamW moment
    n_params: int
    grad_sync_buckets: bool  # ddp's all-reduce starts in backward, bucket by bucket
    logical: bool = False  # ddp under checkpointless.shrink=exact: reduced by logical rank
    fsdp_logical: bool = False  # fsdp under shrink=exact: FSDP's reduce-scatter by logical rank

    def shard(self, n: int) -> int:
        """A rank's part of `n` parameters: the split share over every rank of a replica group,
        the rest over its dp_shard ranks (whole on each tp rank)."""
        if not self.fsdp:
            return n
        return math.ceil(n * self.split / self.ways + n * (1 - self.split) * self.tp / self.ways)

    def block(self, facts) -> int:
        """One decoder block as a tp rank computes it, unsharded."""
        return facts.block_params - facts.tp_block_split + facts.tp_block_split // self.tp

    @property
    def params_bytes(self) -> int:
        return self.shard(self.n_params) * self.pb + self.shard(self.adapters) * ADAPTER_BYTES

    @property
    def optim_bytes(self) -> int:
        return 2 * self.shard(self.trainable) * self.tb


def _setup(cfg, facts: ModelFacts) -> _Setup:
    d, t, pf = cfg.distributed, cfg.trainer, cfg.peft
    world, fsdp, lora = d.num_processes, d.strategy in SHARDED, pf.method == "lora"
    mp = fsdp and t.precision == "bf16"
    # trained parameters are fp32 masters (model_setup.master_dtype); only a frozen LoRA base
    # under ddp keeps the config's dtype
    pb = 4 if (fsdp or not lora) else facts.param_bytes
    bf16 = t.precision in ("bf16", "fp16")
    cb = 2 if mp else pb
    targets = lora_targets(facts, pf.target_modules) if lora else []
    adapters = sum(pf.r * (i + o) for _, i, o, _ in targets)
    trainable = adapters if lora else facts.n_params
    # the sharded state's slices over the whole world (a pipeline's stages are planned apart)
    ways = d.shard_size if d.strategy == "hsdp" and d.shard_size else world
    tp = d.tp_size
    return _Setup(
        world=world, ways=ways, groups=world // ways, tp=tp,
        split=facts.tp_split_params / facts.n_params if tp > 1 and facts.n_params else 0.0,
        fsdp=fsdp, lora=lora, ckpt=bool(cfg.model.gradient_checkpointing),
        accum=t.grad_accum_steps, bf16=bf16, mp=mp, pb=pb, cb=cb, gb=4 if mp else pb,
        p=2 if (bf16 or pb == 2) else 4, r=cb,
        dname="float32" if pb == 4 else facts.dtype_name,
        tokens=t.micro_batch_size * cfg.data.seq_len,
        masked=cfg.data.format in ("chat", "instruction"),
        targets=targets, adapters=adapters, trainable=trainable,
        tb=ADAPTER_BYTES if lora else pb, n_params=facts.n_params,
        grad_sync_buckets=d.grad_sync == "buckets" and cfg.checkpointless.shrink != "exact",
        logical=not fsdp and cfg.checkpointless.shrink == "exact",
        fsdp_logical=fsdp and cfg.checkpointless.shrink == "exact")


def _at(nbytes: int, *phases) -> dict:
    """nbytes in each of `phases` (all of them when none is named)."""
    return {ph: nbytes for ph in (phases or PHASES)} if nbytes else {}


def _state_items(s: _Setup) -> list:
    """Parameters, gradients, AdamW's moments, and ddp's summed copy of the gradients."""
    # gradients of earlier micro-batches are alive in the next forward
    grad_phases = (("forward", "loss backward") if s.accum > 1 else ()) \
        + ("layer backward", "optimizer step")
    moments = ("adapters' fp32" if s.lora else
               "fp32 master parameters'" if s.mp else f"parameters' {s.dname}")
    items = [
        Item("parameters", _at(s.params_bytes),
             note=("fp32 master, gathered in bf16" if s.mp else s.dname)
             + (f", 1/{s.ways} shard" if s.fsdp and s.tp == 1 else
                f", split 1/{s.ways}, the rest 1/{s.ways // s.tp}" if s.fsdp else ", whole")
             + (f", + {s.adapters:,} fp32 adapters" if s.lora else "")),
        Item("gradients", _at(s.shard(s.trainable) * s.tb, *grad_phases),
             note=("adapters only, " if s.lora else "")
             + (f"1/{s.ways} shard" if s.fsdp and s.tp == 1 else "as the parameters"
                if s.fsdp else "whole")),
        Item("optimizer state", _at(s.optim_bytes), note="AdamW, 2 moments in the " + moments),
    ]
    if not s.fsdp:  # the bucket buffers become .grad; the local gradients stay for a redo
        copy_phases = ("layer backward", "optimizer step") if s.grad_sync_buckets \
            else ("optimizer step",)
        items.append(Item("gradient all-reduce copy", _at(s.trainable * s.tb, *copy_phases),
                          note="ddp: summed in a copy, local kept for a redo"))
    if s.logical:  # each hosted rank's contribution, kept to the commit, and the sum's buffers
        items.append(Item("logical reduction", _at(2 * s.trainable * HOSTED_BYTES,
                                                   "optimizer step"),
                          note="shrink=exact: contribution kept + the sum, fp32; + "
                          f"{fmt_gb(s.trainable * HOSTED_BYTES)} per logical rank hosted"))
    return items


def hosted_base(s: _Setup) -> int:
    """What a process hosting a second logical rank needs before that rank's contribution:
    under fsdp, the whole model gathered for the step (fsdp_logical.py)."""
    return s.n_params * s.cb if s.fsdp_logical else 0


def _fsdp_items(s: _Setup, facts: ModelFacts) -> list:
    """What fsdp holds unsharded: the root unit, two blocks, and their gradients until their
    reduce-scatter (every micro-batch, so never the whole model's)."""
    if not s.fsdp:
        return []
    items = [Item("root unit unsharded", _at(facts.root_params * s.cb, "forward",
                                              "loss backward", "layer backward"),
                  note="fsdp: embeddings, final norm, lm_head"),
             Item("two blocks unsharded", _at(2 * s.block(facts) * s.cb, "forward",
                                               "layer backward"),
                  note="fsdp: computing + prefetched" +
                  (f", their split linears 1/{s.tp}" if s.tp > 1 else ""))]
    if not s.lora:  # a frozen base has no gradients; the adapters' are too small to count
        items.append(Item("root unit gradients unsharded",
                          _at(facts.lm_head_params * s.gb, "loss backward", "layer backward"),
                          note="fsdp: lm_head's, before reduce-scatter"))
        items.append(Item("block gradients unsharded",
                          _at(s.block(facts) * s.gb, "layer backward"),
                          note="fsdp: before reduce-scatter"))
    return items


def _autocast_items(s: _Setup, facts: ModelFacts, loop: LoopFacts) -> list:
    """autocast's bf16 copies of fp32 weights; under FSDP2's bf16 policy the weights it sees are
    bf16 already, so it makes none."""
    if not (s.bf16 and s.pb == 4 and not s.mp):
        return []
    head = 2 * facts.head_matmul
    if not s.ckpt:
        return [Item("bf16 weight copies", _at(2 * (facts.matmul_params + s.adapters),
                                               "forward", "loss backward", "layer backward"),
                     note="autocast, saved for backward")]
    # lm_head is not checkpointed: its copy is saved for backward in any case
    cached = 2 * (s.adapters if s.lora else facts.matmul_params) if loop.autocast_cache else head
    return [Item("bf16 weight copies", {"forward": max(cached, head), "loss backward": head},
                 note="autocast cache, held through the forward" if loop.autocast_cache
                 else "lm_head's, saved for backward")]


def _quadratic(facts: ModelFacts, device: str, masked: bool) -> bool:
    """Whether attention keeps its s^2 matrix: no memory-efficient kernel, or sdpa on CPU with a
    mask or attention dropout, which takes its math path."""
    return facts.attn_impl not in _MEMORY_EFFICIENT or (
        device == "cpu" and (masked or facts.attn_dropout > 0))


def _layer_bytes(s: _Setup, facts: ModelFacts, cfg, quadratic: bool) -> int:
    """Activations of one decoder layer for one micro-batch (under tp, a tp rank's: its heads
    and MLP columns split, the residual stream and norms whole)."""
    pf = cfg.peft
    if s.tp > 1:
        facts = replace(facts, heads=facts.heads // s.tp, q_dim=facts.q_dim // s.tp,
                        kv_dim=facts.kv_dim // s.tp, intermediate=facts.intermediate // s.tp)
    lora_in = sum(i for _, i, _, in_first in s.targets if in_first)
    lora_r = pf.r * sum(1 for *_, in_first in s.targets if in_first)
    per_token = layer_bytes_per_token(facts, s.p, s.r, s.masked, lora_in, lora_r,
                                      pf.dropout if s.lora else 0.0)
    layer = int(per_token * s.tokens)
    if quadratic:  # the attention matrix is stored: Megatron's 5*a*s^2*b bytes in fp16
        layer += int(2.5 * s.p * facts.heads * cfg.data.seq_len ** 2
                     * cfg.trainer.micro_batch_size)
    return layer


def _activation_items(s: _Setup, facts: ModelFacts, cfg, quadratic: bool) -> list:
    """What forward keeps for backward, the layer backward recomputes, the mask and the logits."""
    layer = _layer_bytes(s, facts, cfg, quadratic)
    final_norm = (4 + s.r) * facts.hidden * s.tokens
    if s.ckpt:
        saved = facts.n_layers * s.r * facts.hidden * s.tokens + final_norm
        saved_note = "one hidden state per layer boundary"
    else:
        saved = facts.n_layers * layer + final_norm
        saved_note = "every layer's activations"
    items = [Item("activations kept for backward", _at(saved, "forward", "loss backward",
                                                       "layer backward"),
                  note=f"{saved_note}, {facts.n_layers} layers"),
             Item("one layer in backward", _at(layer * (2 if s.ckpt else 1), "layer backward"),
                  note=("recomputed + " if s.ckpt else "") + "its gradients"
                  + (", attention s^2 stored" if quadratic else ""))]
    if s.masked:
        b, seq = cfg.trainer.micro_batch_size, cfg.data.seq_len
        items.append(Item("attention mask", _at(b * seq ** 2, "forward", "loss backward",
                                                "layer backward"),
                          note="b x s x s booleans"))
    logits = s.tokens * facts.vocab
    items.append(Item("logits and loss", {"forward": logits * (s.p + (4 if s.p != 4 else 0) + 4),
                                          "loss backward": logits * 12},
                      note=f"{facts.vocab:,} x {s.tokens:,} tokens, fp32 for the loss"))
    return items


def _end_items(s: _Setup, facts: ModelFacts, cfg, device: str) -> list:
    """The optimizer step's temporaries, the end-of-run export, the runtime allowance, and the
    host rows: peer replicas and snapshots of this rank's shard (fsdp)."""
    items = [Item("optimizer step temporaries", _at(s.shard(s.trainable) * s.tb,
                                                    "optimizer step"), note="foreach AdamW")]
    if s.fsdp:  # digest and export gather one tensor at a time; each rank keeps its file's
        items.append(Item("export, one tensor gathered",
                          _at(facts.head_matmul * s.pb, "end of run"),
                          host=-(-facts.n_params * s.pb // s.world),
                          note="the largest on the device; this rank's file on the host"))
    cuda = device == "cuda"
    items.append(Item("runtime allowance", _at(CUDA_RUNTIME if cuda else CPU_RUNTIME),
                      note="CUDA context, NCCL, allocator" if cuda else
                      "Python, torch, transformers"))
    factor = cfg.checkpointless.replication.factor
    sent = s.shard(s.trainable) * s.tb * 3 if s.lora else s.params_bytes + s.optim_bytes
    if s.fsdp and cfg.checkpointless.enabled and factor > 1:
        items.append(Item("peer replicas", {}, host=KEEP_VERSIONS * (factor - 1) * sent,
                          note=f"{factor - 1} peer shard(s) x {KEEP_VERSIONS} versions"))
        items.append(Item("own shard snapshots", {}, host=KEEP_VERSIONS * sent,
                          note=f"{KEEP_VERSIONS} versions"))
    elif s.fsdp and cfg.checkpointless.enabled and s.groups >= 2:
        # hsdp: the other replica groups hold each slice live; only the rollback snapshots
        items.append(Item("own shard snapshots", {}, host=ROLLBACK_VERSIONS * sent,
                          note=f"{ROLLBACK_VERSIONS} versions, for rollback; no peer replicas "
                               f"(the {s.groups} replica groups are the copies)"))
    return items


def _summary(s: _Setup, cfg, facts: ModelFacts, device: str, quadratic: bool) -> str:
    t = cfg.trainer
    attn = ("sdpa (memory-efficient kernel assumed: no s^2 matrix kept)" if not quadratic else
            f"{facts.attn_impl} (the s^2 attention matrix is kept)")
    mesh = " x ".join(f"{k} {v}" for k, v in mesh_sizes(cfg.distributed).items() if v > 1)
    return (f"{cfg.distributed.strategy} over {s.world} processes on {device} (mesh "
            f"{mesh or 'one process'}); micro_batch_size "
            f"{t.micro_batch_size} x seq_len {cfg.data.seq_len}, grad_accum_steps {s.accum}; "
            f"gradient checkpointing {'on' if s.ckpt else 'off'}; precision {t.precision} "
            f"(activations {s.p} bytes, residual stream {s.r}); attention {attn}")


def unpipelined_plan(cfg, facts: ModelFacts, loop: LoopFacts, device: str) -> Plan:
    """The plan of a resolved recipe without stages on `device` (cuda or cpu)."""
    budget, budget_source = device_budget(cfg, device)
    s = _setup(cfg, facts)
    quadratic = _quadratic(facts, device, s.masked)
    items = [*_state_items(s), *_fsdp_items(s, facts), *_autocast_items(s, facts, loop),
             *_activation_items(s, facts, cfg, quadratic), *_end_items(s, facts, cfg, device)]
    host, host_source = host_budget(cfg, device)
    return Plan(recipe=cfg.run.name, facts=facts, overrides=[], device_type=device,
                budget=budget, budget_source=budget_source, items=items,
                trainable=s.trainable, hosted_base=hosted_base(s),
                phases={ph: sum(i.device.get(ph, 0) for i in items) for ph in PHASES},
                summary=_summary(s, cfg, facts, device, quadratic),
                host_budget=host, host_source=host_source, ranks_per_node=ranks_per_node(cfg))


def layer_bytes_per_token(f: ModelFacts, p: int, r: int, masked: bool, lora_in: int,
                          lora_r: int, lora_dropout: float) -> float:
    """Activations one decoder layer keeps for backward, per token (docs/memory-plan.md)."""
    h, q = f.hidden, f.q_dim
    kv = q if masked else f.kv_dim  # with a mask transformers repeats k and v to every head
    cast = p * h if r != p else 0  # autocast's bf16 copy of an fp32 input, per linear reading it
    norm = 4 * h + r * h
    mask = 1 if f.dropout > 0 else 0
    attn = norm + (1 if f.fused_qkv else 3) * cast + p * (q + 2 * kv) + 2 * p * q + mask * h
    inter = f.intermediate
    if f.mlp == "moe":  # each token runs top_k experts on its own copy of the input
        routed = r * h + p * h + 7 * p * inter + 2 * p * h
        mlp = norm + f.experts_per_token * routed
    elif f.mlp == "swiglu":
        mlp = norm + 2 * cast + 4 * p * inter
    elif f.mlp == "gelu_tanh":
        mlp = norm + cast + 5 * p * inter + mask * h
    else:
        mlp = norm + cast + 2 * p * inter + mask * h
    lora = (p + (1 if lora_dropout > 0 else 0)) * lora_in + p * lora_r
    return attn + mlp + lora
