"""`python -m launcher plan RECIPE [key=value ...]`: the memory one rank needs, before launch.

    python -m launcher plan llama3-8b
    python -m launcher plan llama3-70b distributed.strategy=ddp
    python -m launcher plan llama3.2-1b distributed.device_memory_gb=24

No weights are loaded and no data is read: the model is built on the meta device from its config
(the hub's, or a built-in table of the shipped recipes' models when the hub cannot be reached),
its parameters counted, and everything else computed from the recipe. `check_fits(cfg)` is the
same plan for the launcher: it raises RecipeError, with the numbers and the overrides that fit,
when the peak does not fit.

What is counted, per rank (GB = 10^9 bytes). The numerics are the project's as they are, not as
one might assume:

* Parameter dtype: trained parameters are fp32 masters (`model_setup.master_dtype`), whatever
  dtype the config names (the Llama 3 and gpt-oss configs say bfloat16): 16 bytes per trained
  parameter with its fp32 gradient and two AdamW moments (torch's AdamW keeps its state in the
  parameter's dtype). The one exception is a frozen LoRA base under ddp, kept in the config's
  dtype (transformers' `from_config`, or "auto" for `from_pretrained`: the checkpoint's).
  trainer.precision=bf16 autocasts matmuls to bf16. (`LoopFacts(fp32_masters=False)` plans the
  loop that kept bf16 parameters and moments for bf16 configs: 8 bytes per trained parameter.)
* parameters, gradients, optimizer state (AdamW: 2 moments per trained parameter): whole on
  every rank under ddp, divided by num_processes under fsdp (FSDP2 fully_shard). Under
  peft.method=lora only the adapters have gradients and optimizer state; an adapter on a linear
  layer (in, out) has r x (in + out) parameters, kept in fp32 by peft over a bf16 base; the
  targets are the named modules, or with all-linear every nn.Linear / GPT-2 Conv1D but lm_head.
* ddp: the all-reduce sums a copy of the gradients (checkpointless.DistributedDataParallel's
  bucket buffers become `.grad`, while the local gradients are kept for a redo of the step), so
  gradients are held twice at the end of backward.
* fsdp: the root unit (everything outside the decoder blocks: embeddings, final norm, lm_head)
  stays unsharded through forward and backward; two blocks are unsharded at a time (the one
  computing and the one prefetched), and a block's and the root's gradients exist unsharded
  until their reduce-scatter. The loop reduce-scatters every micro-batch into the sharded
  gradients. (`LoopFacts(fsdp_unsharded_accumulation=True)` plans a loop that turns gradient
  sync off for the earlier micro-batches, `set_requires_gradient_sync(False)`, as this one once
  did: FSDP2 then keeps the *unsharded* gradient of every parameter across micro-batches, the
  whole model's gradients on every rank.) `LoopFacts(lora_fsdp_one_unit=True)` plans a
  `shard()` that finds no blocks through the peft wrapper (the whole model one unit). At the
  end of the run `full_state()` gathers the whole model onto every device (cpu_offload=False).
* fsdp with trainer.precision=bf16: FSDP2's MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32) over fp32 master parameters (built in fp32 whatever the config's dtype):
  parameters, gradients and AdamW moments are 4 bytes and sharded; the unsharded units are bf16
  (2 bytes), the residual stream bf16, a gradient before its reduce-scatter fp32; autocast then
  sees bf16 weights and makes no copies of them.
* autocast (trainer.precision=bf16 over fp32 parameters): torch.autocast caches the bf16 copy of
  every weight that requires grad until the autocast block exits, i.e. for the whole forward,
  even under FSDP (the unsharded parameter is a leaf) and with gradient checkpointing; without
  checkpointing these copies (of frozen weights too) are also saved for backward.
* activations, an estimate. Megatron-LM's count (Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models") for one GPT layer in fp16 is
  s*b*h*(34 + 5*a*s/h) bytes: 11 s*b*h + 5 a*s^2*b for attention, 19 s*b*h for the 4h MLP,
  4 s*b*h for the two layer norms. This plan makes the same count term by term for the actual
  layer shapes, per token (s*b tokens), with p = bytes of a matmul activation (2 under bf16
  autocast or bf16 parameters, else 4) and r = bytes of the residual stream (the parameter
  dtype: the embeddings' output, which autocast does not touch):
      each norm (RMSNorm computes in fp32)     4h + r*h
      q, k, v kept by attention                 p*(q_dim + 2*kv_dim)
                                                (kv_dim = q_dim when a mask repeats k and v)
      attention output, o_proj input            2*p*q_dim
      SwiGLU MLP (gate, up, silu, product)      4*p*I; GPT-2's tanh GELU 5*p*I; gpt-oss's
                                                clamped GLU, per routed token, top_k*(7*p*I + ...)
      autocast copies of an fp32 input          p*h per linear reading it
      dropout masks (when dropout > 0)          1 byte per element
    Attention is assumed to run through sdpa with a memory-efficient kernel (flash or
    mem-efficient on CUDA), which keeps no s^2 matrix; a model without sdpa (gpt-oss: eager),
    or sdpa on CPU with a mask or attention dropout (its math path), keeps ~5*a*s^2*b*(p/2)
    bytes per layer, Megatron's term.
    With model.gradient_checkpointing the forward keeps one hidden state per layer boundary
    (r*h per token per layer) and backward recomputes one layer at a time; without it every
    layer's activations are kept. Backward of a layer needs about that layer's activations again
    for the gradients in flight.
  The logits and the loss: the lm_head output (p per logit), transformers' fp32 upcast for the
  loss (4), the log-softmax kept for backward (4); in backward the fp32 gradients (~12 bytes per
  logit at the peak). With a 128k vocabulary this is often the largest activation.
* The total is the peak over the phases of a step (end of forward, loss backward, layer
  backward, optimizer step) and the end of the run, each summing what is alive then, plus an
  allowance for the runtime (CUDA context, NCCL buffers, allocator slack: 2 GB; a CPU worker's
  Python, torch and transformers: 0.5 GB). All of it is an estimate: the per-layer formula is
  checked against what autograd keeps (tests/test_plan.py, within 15%); the rest is reasoned
  from the code paths named here, not measured on a GPU.
* Host memory (per rank, listed apart): under fsdp with checkpointless.replication.factor f,
  each rank holds f-1 copies of a peer's shard (parameters and optimizer state sent to a
  replacement) and a snapshot of its own, three versions of each (checkpointless.redundancy.KEEP:
  one exchange may be in flight beside the step, so the newest complete one can be two old).

Device memory: distributed.device_memory_gb when set; else the smallest visible CUDA device's
total memory when there is one; else 80 GB. Under distributed.device=cpu the budget is this
machine's memory (os.sysconf) divided by the processes on it (workers and spares), and the
host rows count against it too.
"""
from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from checkpointless.redundancy import KEEP as KEEP_VERSIONS  # versions of each replica kept

from .recipes import RecipeError

GB = 10 ** 9
DEFAULT_DEVICE_GB = 80.0
CUDA_RUNTIME = 2 * GB  # CUDA context, NCCL buffers, allocator slack: an allowance
CPU_RUNTIME = GB // 2  # Python, torch, transformers and datasets in one worker process


@dataclass(frozen=True)
class LoopFacts:
    """What launcher/loop.py does that decides memory (tests/test_plan.py reads loop.py to keep
    these true). Pass another LoopFacts to `plan` to see what a change to the loop would give."""
    autocast_cache: bool = True  # torch.autocast(...) with its default cache_enabled=True
    fsdp_unsharded_accumulation: bool = True  # set_requires_gradient_sync(False) in accumulation
    fsdp_mixed_precision: bool = False  # bf16 under fsdp: MixedPrecisionPolicy, fp32 master
    full_state_on_device: bool = True  # full_state(): get_model_state_dict(cpu_offload=False)
    # (the loop now streams the digest and the export one tensor at a time: False)
    lora_fsdp_one_unit: bool = True  # shard() looks for the blocks on the peft wrapper: none found
    fp32_masters: bool = False  # model_setup.master_dtype: trained parameters in fp32 whatever
    # the config's dtype (False: the config's, so bf16 parameters and moments for Llama 3)


# shard() looks through peft's wrapper and sets FSDP2's bf16 policy; the loop reduce-scatters
# every micro-batch; launcher/export.py streams the end-of-run state one tensor at a time
CURRENT_LOOP = LoopFacts(lora_fsdp_one_unit=False, fsdp_unsharded_accumulation=False,
                         fsdp_mixed_precision=True, full_state_on_device=False,
                         fp32_masters=True)

# Configs of the models the shipped recipes name, from their public config.json files, for when
# the hub cannot be reached (a plan needs shapes, not weights). Only what shapes the model.
_LLAMA3 = dict(model_type="llama", vocab_size=128256, num_key_value_heads=8, head_dim=128,
               rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=128000, eos_token_id=128001,
               hidden_act="silu", attention_bias=False, mlp_bias=False, dtype="bfloat16")
_GPT2 = dict(model_type="gpt2", vocab_size=50257, n_positions=1024, n_ctx=1024,
             activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
             layer_norm_epsilon=1e-5, bos_token_id=50256, eos_token_id=50256,
             tie_word_embeddings=True)
KNOWN_CONFIGS = {
    "meta-llama/Meta-Llama-3-8B": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336,
                                       num_hidden_layers=32, num_attention_heads=32,
                                       max_position_embeddings=8192, tie_word_embeddings=False),
    "meta-llama/Meta-Llama-3-70B": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672,
                                        num_hidden_layers=80, num_attention_heads=64,
                                        max_position_embeddings=8192, tie_word_embeddings=False),
    "meta-llama/Llama-3.2-1B": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192,
                                    num_hidden_layers=16, num_attention_heads=32, head_dim=64,
                                    max_position_embeddings=131072, tie_word_embeddings=True),
    "openai-community/gpt2": dict(_GPT2, n_embd=768, n_layer=12, n_head=12),
    "openai-community/gpt2-xl": dict(_GPT2, n_embd=1600, n_layer=48, n_head=25),
    "openai/gpt-oss-20b": dict(
        model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
        num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        num_local_experts=32, num_experts_per_tok=4, experts_per_token=4,
        attention_bias=True, attention_dropout=0.0, hidden_act="silu", swiglu_limit=7.0,
        sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12,
        max_position_embeddings=131072, initial_context_length=4096, rope_theta=150000.0,
        rms_norm_eps=1e-5, router_aux_loss_coef=0.9, tie_word_embeddings=False,
        eos_token_id=200002, pad_token_id=199999, dtype="bfloat16"),
}
# the same models under other names (the Instruct tokenizers' models share the base's shapes)
_ALIASES = {"gpt2": "openai-community/gpt2", "gpt2-xl": "openai-community/gpt2-xl",
            "meta-llama/Meta-Llama-3-8B-Instruct": "meta-llama/Meta-Llama-3-8B",
            "meta-llama/Meta-Llama-3-70B-Instruct": "meta-llama/Meta-Llama-3-70B",
            "meta-llama/Llama-3.2-1B-Instruct": "meta-llama/Llama-3.2-1B"}


def known_config(model_id: str):
    """The built-in config of a model the shipped recipes name, or None."""
    from transformers import CONFIG_MAPPING
    fields_ = KNOWN_CONFIGS.get(_ALIASES.get(model_id, model_id))
    if fields_ is None:
        return None
    fields_ = dict(fields_)
    return CONFIG_MAPPING[fields_.pop("model_type")](**fields_)


# ---- the model: counted on the meta device ---------------------------------------------------

@dataclass
class ModelFacts:
    """Shapes and parameter counts of the model a recipe builds (before LoRA)."""
    name: str
    config_source: str
    n_params: int
    param_bytes: int  # bytes per parameter (2: bf16, 4: fp32)
    dtype_name: str
    n_layers: int
    block_params: int  # the largest decoder block
    root_params: int  # outside the blocks: embeddings, final norm, lm_head
    lm_head_params: int  # lm_head's own weight (0 when tied to the embeddings)
    head_matmul: int  # the weight lm_head multiplies by (its own or the tied embeddings')
    matmul_params: int  # weights and biases of nn.Linear / Conv1D (lm_head included)
    hidden: int
    heads: int
    q_dim: int
    kv_dim: int
    intermediate: int
    vocab: int
    mlp: str  # swiglu, gelu_tanh, gelu, moe
    experts_per_token: int
    dropout: float  # residual / hidden dropout
    attn_dropout: float
    attn_impl: str
    fused_qkv: bool
    linears: list = field(default_factory=list)  # (module name, in, out, in block 0) for LoRA


def _hf_config(cfg):
    """(transformers config, where it came from), as models.model_config builds it."""
    from models import model_config
    m = cfg.model
    overrides = OmegaConf.to_container(m.config) if m.config else {}
    vocab, token_ids = None, None
    if cfg.tokenizer.kind == "byte":  # built-in, offline: the size and ids the loop will use
        from models import byte_tokenizer
        tok = byte_tokenizer()
        vocab = len(tok)
        token_ids = {"eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id,
                     "pad_token_id": tok.pad_token_id}
    if not m.id:
        return model_config(m.name, None, overrides, vocab, token_ids), \
            f"built from model.name={m.name} and model.config"
    from pathlib import Path
    local = Path(m.id).expanduser().exists()
    try:
        hf = model_config(m.name, m.id, overrides, vocab, token_ids)
        return hf, (f"from the folder {m.id}" if local else "from the hub")
    except Exception as exc:  # noqa: BLE001  offline, gated, unknown: the table may know it
        hf = None if local else known_config(m.id)
        if hf is None:
            raise RecipeError(
                f"model.id={m.id}: its config cannot be loaded ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''}) and the built-in table knows "
                f"only {', '.join(KNOWN_CONFIGS)}; the plan needs the model's shapes") from None
    for key, value in overrides.items():  # as model_config sets the recipe's keys on a hub config
        if not hasattr(hf, key):
            raise RecipeError(f"model.config.{key}: {type(hf).__name__} has no such field")
        setattr(hf, key, value)
    for key, value in (token_ids or {}).items():
        setattr(hf, key, value)
    if vocab is not None and "vocab_size" not in overrides:
        hf.vocab_size = vocab
    return hf, "built-in table (offline)"


def _blocks(model):
    """The decoder blocks, found as launcher.model_setup.shard finds them."""
    for attr in ("model.layers", "transformer.h"):
        obj = model
        try:
            for part in attr.split("."):
                obj = getattr(obj, part)
            return list(obj)
        except AttributeError:
            continue
    return []


def model_facts(cfg) -> ModelFacts:
    """Build the recipe's model on the meta device (no memory, no weights) and measure it."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.pytorch_utils import Conv1D
    hf, source = _hf_config(cfg)
    hf = copy.deepcopy(hf)
    if getattr(hf, "quantization_config", None) is not None:  # the checkpoint's storage format
        del hf.quantization_config
        if getattr(hf, "dtype", None) is None:  # transformers dequantizes it to bf16 (MXFP4)
            hf.dtype = torch.bfloat16
    elif cfg.model.init == "pretrained" and getattr(hf, "dtype", None) is None:
        # from_pretrained's dtype="auto" takes the checkpoint's, which a plan cannot read
        source += "; no dtype in the config: the checkpoint's, assumed fp32"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    params = list(model.parameters())  # shared (tied) parameters once
    first = next(p for p in params if p.is_floating_point())
    blocks = _blocks(model)
    block_ids = {id(p) for b in blocks for p in b.parameters()}
    n = sum(p.numel() for p in params)
    out = model.get_output_embeddings()
    inp = model.get_input_embeddings()
    tied = out is not None and inp is not None and out.weight is inp.weight
    lm_head = 0 if out is None or tied else out.weight.numel()
    seen, matmul, linears = set(), 0, []
    first_block = {id(m) for m in blocks[0].modules()} if blocks else set()
    for name, mod in model.named_modules():
        if not isinstance(mod, (torch.nn.Linear, Conv1D)):
            continue
        for p in mod.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                matmul += p.numel()
        if mod is out:
            continue
        if isinstance(mod, Conv1D):
            fan_in, fan_out = mod.weight.shape
        else:
            fan_in, fan_out = mod.in_features, mod.out_features
        linears.append((name, int(fan_in), int(fan_out), id(mod) in first_block))
    h = hf.hidden_size
    heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or h // heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None)
    inter = getattr(hf, "intermediate_size", None) or getattr(hf, "n_inner", None) or 4 * h
    act = str(getattr(hf, "hidden_act", None) or getattr(hf, "activation_function", "") or "")
    names = {n_.rsplit(".", 1)[-1] for n_, _ in (blocks[0].named_modules() if blocks else [])}
    if experts:
        mlp = "moe"
    elif "gate_proj" in names or "w1" in names:
        mlp = "swiglu"
    elif act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        mlp = "gelu_tanh"
    else:
        mlp = "gelu"
    dropout = max(float(getattr(hf, k, 0.0) or 0.0)
                  for k in ("resid_pdrop", "hidden_dropout", "hidden_dropout_prob", "dropout"))
    return ModelFacts(
        name=cfg.model.id or cfg.model.name, config_source=source, n_params=n,
        param_bytes=first.element_size(), dtype_name=str(first.dtype).replace("torch.", ""),
        n_layers=len(blocks) or hf.num_hidden_layers,
        block_params=max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0),
        root_params=sum(p.numel() for p in params if id(p) not in block_ids),
        lm_head_params=lm_head, head_matmul=out.weight.numel() if out is not None else 0,
        matmul_params=matmul, hidden=h, heads=heads,
        q_dim=heads * head_dim, kv_dim=kv_heads * head_dim, intermediate=inter,
        vocab=hf.vocab_size, mlp=mlp,
        experts_per_token=(getattr(hf, "num_experts_per_tok", None) or 1) if experts else 1,
        dropout=dropout, attn_dropout=max(float(getattr(hf, k, 0.0) or 0.0) for k in
                                          ("attn_pdrop", "attention_dropout")),
        attn_impl=str(getattr(model.config, "_attn_implementation", "eager")),
        fused_qkv="c_attn" in names, linears=linears)


def lora_targets(facts: ModelFacts, target_modules) -> list:
    """The linear layers peft adapts: a module named in target_modules (its full name or its
    last dotted part), or every linear but the output layer for all-linear."""
    targets = list(target_modules)
    if targets == ["all-linear"]:
        return list(facts.linears)
    return [lin for lin in facts.linears
            if lin[0] in targets or any(lin[0].endswith("." + t) for t in targets)]


def lora_params(facts: ModelFacts, r: int, target_modules) -> int:
    """Adapter parameters: r x (in + out) per adapted linear layer."""
    return sum(r * (fan_in + fan_out) for _, fan_in, fan_out, _ in
               lora_targets(facts, target_modules))


# ---- the plan --------------------------------------------------------------------------------

PHASES = ("forward", "loss backward", "layer backward", "optimizer step", "end of run")
_SHORT = {"forward": "F", "loss backward": "L", "layer backward": "B", "optimizer step": "O",
          "end of run": "E"}


@dataclass
class Item:
    name: str
    device: dict  # phase -> bytes on the device
    host: int = 0  # bytes of host memory
    note: str = ""

    @property
    def device_max(self) -> int:
        return max(self.device.values(), default=0)


@dataclass
class Plan:
    recipe: str
    facts: ModelFacts
    overrides: list  # the command line's key=value, shown in the report
    device_type: str  # cuda or cpu
    budget: int  # bytes one rank may use (device memory, or host memory per process on cpu)
    budget_source: str
    items: list
    trainable: int
    phases: dict  # phase -> device bytes
    summary: str
    fix: list | None = None  # overrides that fit, when this plan does not
    host_budget: int | None = None  # one node's host memory (None: not known here)
    host_source: str = ""
    ranks_per_node: int = 1  # ranks whose host rows share that memory
    fix_tried: bool = False
    closest: tuple | None = None  # (overrides, Plan) needing the least, when none fits

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def peak(self) -> int:
        return self.phases[self.peak_phase]

    @property
    def host(self) -> int:
        return sum(i.host for i in self.items)

    @property
    def need(self) -> int:
        """Bytes compared with the budget: the device peak (plus the host rows on cpu)."""
        return self.peak + (self.host if self.device_type == "cpu" else 0)

    @property
    def fits(self) -> bool:
        return self.need <= self.budget

    @property
    def host_per_node(self) -> int:
        return self.host * self.ranks_per_node

    @property
    def host_fits(self) -> bool:
        """The host rows of a node's ranks (peer replicas, snapshots: held besides each process
        itself) within its host memory; true when that memory is not known, and on cpu, where
        the host rows are counted with the device's."""
        return (self.device_type == "cpu" or self.host_budget is None
                or self.host_per_node <= self.host_budget)

    @property
    def headroom(self) -> float:
        return (self.budget - self.need) / self.budget

    def over(self) -> list[str]:
        """Each phase over the budget, with its largest item."""
        extra = self.host if self.device_type == "cpu" else 0
        out = []
        for ph, total in self.phases.items():
            if total + extra > self.budget:
                big = max(self.items, key=lambda i: i.device.get(ph, 0))
                out.append(f"{ph} {_gb(total + extra)} (largest: {big.name} "
                           f"{_gb(big.device[ph])})")
        return out

    def verdict(self) -> str:
        where = "per device" if self.device_type == "cuda" else "per process (host memory)"
        if self.fits:
            return (f"fits: {_gb(self.need)} of {_gb(self.budget)} {where} at the peak "
                    f"({self.peak_phase}), {self.headroom:.0%} headroom")
        line = (f"does not fit: {_gb(self.need)} needed at the peak ({self.peak_phase}), "
                f"{_gb(self.budget)} {where}; over in " + ", ".join(self.over()))
        if self.fix:
            return line + "; fits with: " + " ".join(self.fix)
        if self.fix_tried:
            line += ("; no override tried fits (distributed.strategy=fsdp, "
                     "model.gradient_checkpointing=true, a smaller trainer.micro_batch_size, "
                     "trainer.grad_accum_steps=1)")
            if self.closest is not None:
                changes, best = self.closest
                line += (f"; the closest, {' '.join(changes) or 'the recipe as it is'}, needs "
                         f"{_gb(best.need)}, over in " + ", ".join(best.over()))
        return line

    def table(self) -> str:
        rows = [("item", "device/rank", "bytes", "host/rank", "live in")]
        for it in self.items:
            if not it.device_max and not it.host:
                continue
            live = "".join(_SHORT[p] for p in PHASES if it.device.get(p))
            rows.append((it.name + (f" ({it.note})" if it.note else ""),
                         _gb(it.device_max) if it.device_max else "-",
                         f"{it.device_max:,}" if it.device_max else "-",
                         _gb(it.host) if it.host else "-", live or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(v.ljust(w) if i == 0 else v.rjust(w) if i < 4 else v
                           for i, (v, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
        lines.insert(1, "-" * len(lines[0]))
        return "\n".join(lines)

    def report(self) -> str:
        f = self.facts
        phases = ", ".join(f"{_SHORT[p]} {p} {_gb(b)}" for p, b in self.phases.items())
        if not self.host:
            host = "host per rank: nothing planned beyond the process (no peer replicas)"
        else:
            host = f"host per rank: {_gb(self.host)} ({self.host:,} bytes)"
            if self.device_type == "cpu":
                host += " (on cpu: counted with the device rows)"
            elif self.host_budget is None:
                host += (" (not compared: no GPU here to say what a node holds; set "
                         "distributed.host_memory_gb)")
            else:
                host += (f"; {self.ranks_per_node} ranks per node: {_gb(self.host_per_node)} "
                         f"of {_gb(self.host_budget)} ({self.host_source})"
                         + ("" if self.host_fits else ": DOES NOT FIT"))
        return "\n".join([
            f"plan: {self.recipe}" + (f" with {' '.join(self.overrides)}" if self.overrides
                                      else ""),
            f"model: {f.name}, {f.n_params / 1e9:.3f}B parameters ({f.n_params:,}) in "
            f"{f.dtype_name}, {self.trainable:,} trained; config: {f.config_source}",
            self.summary,
            f"budget: {_gb(self.budget)} per rank ({self.budget_source})",
            "",
            self.table(),
            "",
            f"peak per rank: {_gb(self.peak)} ({self.peak:,} bytes) during {self.peak_phase}",
            f"by phase: {phases}",
            host,
            self.verdict(),
        ])


def _gb(n: int) -> str:
    return f"{n / GB:,.2f} GB"


def _layer_bytes_per_token(f: ModelFacts, p: int, r: int, masked: bool, lora_in: int,
                           lora_r: int, lora_dropout: float) -> float:
    """Activations one decoder layer keeps for backward, per token (see the module docstring)."""
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


def _device(cfg) -> str:
    d = cfg.distributed.get("device", "auto")
    if d in ("cpu", "cuda"):
        return d
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _budget(cfg, device_type: str) -> tuple[int, str]:
    d = cfg.distributed
    given = float(d.get("device_memory_gb", 0.0) or 0.0)
    if given < 0:
        raise RecipeError(f"distributed.device_memory_gb={given}: must be >= 0 (0: the real "
                          "device's memory, else 80)")
    if given > 0:
        return int(given * GB), "distributed.device_memory_gb"
    if device_type == "cpu":
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        nodes = max(1, int(d.get("num_nodes", 1) or 1))
        workers = int(d.get("nproc_per_node", 0) or 0) or math.ceil(d.num_processes / nodes)
        procs = workers + (cfg.checkpointless.spares if cfg.checkpointless.enabled else 0)
        return total // procs, (f"this machine's {_gb(total)} of memory / {procs} processes "
                                "(workers and spares)")
    import torch
    if torch.cuda.is_available() and torch.cuda.device_count():
        props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        small = min(props, key=lambda pr: pr.total_memory)
        return int(small.total_memory), f"this machine's {small.name}"
    return int(DEFAULT_DEVICE_GB * GB), (f"default {DEFAULT_DEVICE_GB:.0f} GB: no GPU here; set "
                                         "distributed.device_memory_gb for other devices")


def _host_budget(cfg, device_type: str) -> tuple[int | None, str]:
    """One node's host memory: distributed.host_memory_gb, or this machine's when it has GPUs
    (the launcher runs on the node its workers use); otherwise unknown."""
    given = float(cfg.distributed.get("host_memory_gb", 0.0) or 0.0)
    if given < 0:
        raise RecipeError(f"distributed.host_memory_gb={given}: must be >= 0 (0: this machine's "
                          "when it has GPUs, else not compared)")
    if given > 0:
        return int(given * GB), "distributed.host_memory_gb"
    import torch
    if device_type == "cuda" and torch.cuda.is_available():
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return total, "this machine's memory"
    return None, ""


def plan(cfg, facts: ModelFacts | None = None, loop: LoopFacts = CURRENT_LOOP,
         search: bool = True, device_type: str | None = None) -> Plan:
    """The memory plan of a resolved recipe, per rank; with `search`, the overrides that fit
    when it does not (`plan.fix`)."""
    facts = facts or model_facts(cfg)
    device_type = device_type or _device(cfg)
    budget, budget_source = _budget(cfg, device_type)
    d, t, m, pf = cfg.distributed, cfg.trainer, cfg.model, cfg.peft
    world = d.num_processes
    fsdp = d.strategy == "fsdp"
    lora = pf.method == "lora"
    ckpt = bool(m.gradient_checkpointing)
    accum = t.grad_accum_steps
    pb = facts.param_bytes
    bf16 = t.precision in ("bf16", "fp16")  # half-precision autocast: 2-byte activations
    # fsdp + bf16: fp32 master state (sharded), units gathered and computed in bf16
    mp = fsdp and t.precision == "bf16" and loop.fsdp_mixed_precision
    # fp32 masters (model_setup.master_dtype): all but a frozen LoRA base under ddp
    if mp or (loop.fp32_masters and (fsdp or not lora)):
        pb = 4
    dname = "float32" if pb == 4 else facts.dtype_name
    cb = 2 if mp else pb  # bytes of a parameter as forward and backward use it
    gb = 4 if mp else pb  # bytes of a gradient before its reduce-scatter (fp32 reduce_dtype)
    p = 2 if (bf16 or pb == 2) else 4
    r = cb
    tokens = t.micro_batch_size * cfg.data.seq_len
    masked = cfg.data.format in ("chat", "instruction")

    def shard(n: int) -> int:
        return math.ceil(n / world) if fsdp else n

    # parameters and what trains
    targets = lora_targets(facts, pf.target_modules) if lora else []
    adapters = sum(pf.r * (i + o) for _, i, o, _ in targets)
    ab = 4  # peft keeps adapters in fp32 (autocast_adapter_dtype) over a bf16 or fp32 base
    trainable = adapters if lora else facts.n_params
    tb = ab if lora else pb  # bytes of a trained parameter, its gradient, each AdamW moment
    params_bytes = shard(facts.n_params) * pb + shard(adapters) * ab
    grads = shard(trainable) * tb
    optim = 2 * shard(trainable) * tb
    one_unit = fsdp and lora and loop.lora_fsdp_one_unit  # shard() finds no blocks under peft
    unsharded_accum = fsdp and accum > 1 and loop.fsdp_unsharded_accumulation
    # gradients of earlier micro-batches are alive in the next forward (unless held unsharded)
    grad_phases = (("forward", "loss backward") if accum > 1 and not unsharded_accum else ()) \
        + ("layer backward", "optimizer step")

    def at(nbytes: int, *phases) -> dict:
        return {ph: nbytes for ph in (phases or PHASES)} if nbytes else {}

    items = [
        Item("parameters", at(params_bytes),
             note=("fp32 master, gathered in bf16" if mp else dname)
             + (f", 1/{world} shard" if fsdp else ", whole")
             + (f", + {adapters:,} fp32 adapters" if lora else "")),
        Item("gradients", at(grads, *grad_phases),
             note=("adapters only, " if lora else "") + ("1/%d shard" % world if fsdp else
                                                        "whole")),
        Item("optimizer state", at(optim), note="AdamW, 2 moments in the "
             + ("adapters' fp32" if lora else ("fp32 master parameters'" if mp else f"parameters' {dname}"))),
    ]
    if not fsdp:
        copy_phases = ("layer backward", "optimizer step") if d.grad_sync == "buckets" \
            else ("optimizer step",)
        items.append(Item("gradient all-reduce copy", at(trainable * tb, *copy_phases),
                          note="ddp: summed in a copy, local kept for a redo"))
    # fsdp: unsharded units and gradients
    if fsdp:
        if one_unit:
            items.append(Item("whole model unsharded", at(facts.n_params * cb + adapters * ab,
                                                          "forward", "loss backward",
                                                          "layer backward"),
                              note="fsdp: shard() finds no blocks under peft"))
        else:
            items.append(Item("root unit unsharded", at(facts.root_params * cb, "forward",
                                                        "loss backward", "layer backward"),
                              note="fsdp: embeddings, final norm, lm_head"))
            items.append(Item("two blocks unsharded", at(2 * facts.block_params * cb, "forward",
                                                         "layer backward"),
                              note="fsdp: computing + prefetched"))
        if unsharded_accum:
            items.append(Item("unsharded gradient accumulation",
                              at(trainable * tb, "forward", "loss backward", "layer backward"),
                              note=f"fsdp, grad_accum_steps={accum}: whole-model gradients"))
        elif not lora:
            items.append(Item("root unit gradients unsharded",
                              at(facts.lm_head_params * gb, "loss backward", "layer backward"),
                              note="fsdp: lm_head's, before reduce-scatter"))
            items.append(Item("block gradients unsharded",
                              at(facts.block_params * gb, "layer backward"),
                              note="fsdp: before reduce-scatter"))
    # autocast's bf16 copies of fp32 weights (none under FSDP2's bf16 policy: already bf16)
    if bf16 and pb == 4 and not mp:
        if ckpt:  # lm_head is not checkpointed: its copy is saved for backward in any case
            cached = 2 * (adapters if lora else facts.matmul_params) if loop.autocast_cache \
                else 2 * facts.head_matmul
            items.append(Item("bf16 weight copies",
                              {"forward": max(cached, 2 * facts.head_matmul),
                               "loss backward": 2 * facts.head_matmul},
                              note="autocast cache, held through the forward"
                              if loop.autocast_cache else "lm_head's, saved for backward"))
        else:
            items.append(Item("bf16 weight copies", at(2 * (facts.matmul_params + adapters),
                                                       "forward", "loss backward",
                                                       "layer backward"),
                              note="autocast, saved for backward"))
    # activations
    lora_in = sum(i for _, i, _, in_first in targets if in_first)
    lora_r = pf.r * sum(1 for *_, in_first in targets if in_first)
    per_token = _layer_bytes_per_token(facts, p, r, masked, lora_in, lora_r,
                                       pf.dropout if lora else 0.0)
    # on CPU, sdpa takes its math path (s^2 kept) with a mask or attention dropout
    quadratic = facts.attn_impl not in ("sdpa", "flash_attention_2", "flash_attention_3",
                                        "flex_attention") or (
        device_type == "cpu" and (masked or facts.attn_dropout > 0))
    layer = int(per_token * tokens)
    if quadratic:  # the attention matrix is stored: Megatron's 5*a*s^2*b bytes in fp16
        layer += int(2.5 * p * facts.heads * cfg.data.seq_len ** 2 * t.micro_batch_size)
    final_norm = (4 + r) * facts.hidden * tokens
    if ckpt:
        saved = facts.n_layers * r * facts.hidden * tokens + final_norm
        saved_note = "one hidden state per layer boundary"
    else:
        saved = facts.n_layers * layer + final_norm
        saved_note = "every layer's activations"
    items.append(Item("activations kept for backward", at(saved, "forward", "loss backward",
                                                          "layer backward"),
                      note=f"{saved_note}, {facts.n_layers} layers"))
    items.append(Item("one layer in backward", at(layer * (2 if ckpt else 1), "layer backward"),
                      note=("recomputed + " if ckpt else "") + "its gradients"
                      + (", attention s^2 stored" if quadratic else "")))
    if masked:
        items.append(Item("attention mask", at(t.micro_batch_size * cfg.data.seq_len ** 2,
                                               "forward", "loss backward", "layer backward"),
                          note="b x s x s booleans"))
    logits = tokens * facts.vocab
    items.append(Item("logits and loss", {"forward": logits * (p + (4 if p != 4 else 0) + 4),
                                          "loss backward": logits * 12},
                      note=f"{facts.vocab:,} x {tokens:,} tokens, fp32 for the loss"))
    items.append(Item("optimizer step temporaries", at(shard(trainable) * tb, "optimizer step"),
                      note="foreach AdamW"))
    if fsdp and loop.full_state_on_device:
        items.append(Item("full state gathered", at(facts.n_params * pb + adapters * ab,
                                                    "end of run"),
                          note="loop.full_state: whole model on every device"))
    elif fsdp:  # digest and export gather one tensor at a time; each rank keeps its file's
        items.append(Item("export, one tensor gathered", at(facts.head_matmul * pb, "end of run"),
                          host=-(-facts.n_params * pb // world),
                          note="the largest on the device; this rank's file on the host"))
    runtime = CUDA_RUNTIME if device_type == "cuda" else CPU_RUNTIME
    items.append(Item("runtime allowance", at(runtime),
                      note="CUDA context, NCCL, allocator" if device_type == "cuda" else
                      "Python, torch, transformers"))
    # host: peer replicas of this rank's shard (fsdp)
    factor = cfg.checkpointless.replication.factor
    if fsdp and cfg.checkpointless.enabled and factor > 1:
        sent = (shard(trainable) * tb * 3 if lora else params_bytes + optim)
        items.append(Item("peer replicas", {}, host=KEEP_VERSIONS * (factor - 1) * sent,
                          note=f"{factor - 1} peer shard(s) x {KEEP_VERSIONS} versions"))
        items.append(Item("own shard snapshots", {}, host=KEEP_VERSIONS * sent,
                          note=f"{KEEP_VERSIONS} versions"))
    phases = {ph: sum(i.device.get(ph, 0) for i in items) for ph in PHASES}
    attn = ("sdpa (memory-efficient kernel assumed: no s^2 matrix kept)" if not quadratic else
            f"{facts.attn_impl} (the s^2 attention matrix is kept)")
    summary = (f"{d.strategy} over {world} processes on {device_type}; micro_batch_size "
               f"{t.micro_batch_size} x seq_len {cfg.data.seq_len}, grad_accum_steps {accum}; "
               f"gradient checkpointing {'on' if ckpt else 'off'}; precision {t.precision} "
               f"(activations {p} bytes, residual stream {r}); attention {attn}")
    host_budget, host_source = _host_budget(cfg, device_type)
    nodes = max(1, int(d.get("num_nodes", 1) or 1))
    result = Plan(recipe=cfg.run.name, facts=facts, overrides=[],
                  device_type=device_type, budget=budget, budget_source=budget_source,
                  items=items, trainable=trainable, phases=phases, summary=summary,
                  host_budget=host_budget, host_source=host_source,
                  ranks_per_node=int(d.get("nproc_per_node", 0) or 0)
                  or math.ceil(world / nodes))
    if search and not result.fits:
        result.fix, result.closest = find_fix(cfg, facts, loop, device_type)
        result.fix_tried = True
    return result


def _with(cfg, changes: dict):
    out = copy.deepcopy(cfg)
    for key, value in changes.items():
        OmegaConf.update(out, key, value, merge=False)
    return out


def candidates(cfg) -> list[dict]:
    """Overrides to try, in order, each adding to the one before: distributed.strategy=fsdp
    (from ddp), model.gradient_checkpointing=true, then trainer.micro_batch_size halved down to
    1 (with trainer.grad_accum_steps doubled: the same tokens per step); last, under fsdp with
    gradient accumulation, trainer.grad_accum_steps=1 (fewer tokens per step: the loop keeps
    whole-model gradients across micro-batches)."""
    out, cur = [], {}
    if cfg.distributed.strategy == "ddp":
        cur = {**cur, "distributed.strategy": "fsdp"}
        out.append(cur)
    if not cfg.model.gradient_checkpointing:
        cur = {**cur, "model.gradient_checkpointing": True}
        out.append(cur)
    mbs, accum = cfg.trainer.micro_batch_size, cfg.trainer.grad_accum_steps
    base = dict(cur)
    while mbs > 1:
        mbs, accum = max(1, mbs // 2), accum * 2
        cur = {**base, "trainer.micro_batch_size": mbs, "trainer.grad_accum_steps": accum}
        out.append(cur)
    if cfg.trainer.grad_accum_steps > 1 or accum > 1:
        mbs = cfg.trainer.micro_batch_size
        while True:
            out.append({**base, "trainer.micro_batch_size": mbs, "trainer.grad_accum_steps": 1})
            if mbs == 1:
                break
            mbs = max(1, mbs // 2)
    unique = []
    for changes in out:  # the same settings reached twice are tried once
        if changes not in unique:
            unique.append(changes)
    return unique


def _format(cfg, changes: dict) -> list[str]:
    """key=value for each change that differs from the recipe."""
    from omegaconf import OmegaConf as _oc
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changes.items()
            if _oc.select(cfg, k) != v]


def find_fix(cfg, facts, loop=CURRENT_LOOP, device_type=None):
    """(the first candidate override, see `candidates`, under which the plan fits, or None;
    (overrides, Plan) of the candidate needing the least when none fits)."""
    closest = None
    for changes in candidates(cfg):
        tried = plan(_with(cfg, changes), facts, loop, search=False, device_type=device_type)
        if tried.fits:
            return _format(cfg, changes), None
        if closest is None or tried.need < closest[1].need:
            closest = (_format(cfg, changes), tried)
    return None, closest


def check_fits(cfg, loop: LoopFacts = CURRENT_LOOP) -> Plan:
    """The plan, for the launcher before it starts workers: cheap (meta device, no weights, no
    data); raises RecipeError with the numbers and the overrides that fit when it does not fit.
    On distributed.device=cpu the budget is this machine's memory per process."""
    result = plan(cfg, loop=loop)
    if result.fits and not result.host_fits:
        raise RecipeError(
            f"memory plan: the host memory of a node does not fit: its {result.ranks_per_node} "
            f"ranks hold {_gb(result.host_per_node)} of peer replicas and snapshots "
            f"({_gb(result.host)} each) beside their processes, and the node has "
            f"{_gb(result.host_budget)} ({result.host_source}). Fix: "
            "checkpointless.replication.factor=1 (no peer copies: a lost rank's state then "
            "comes from the durable checkpoint), or more nodes for the same job, or set "
            "distributed.host_memory_gb if the nodes the job runs on have more")
    if result.fits:
        return result
    lines = [f"memory plan: {result.verdict()}.",
             f"Per rank at the peak ({result.peak_phase}): " + ", ".join(
                 f"{i.name} {_gb(i.device[result.peak_phase])}" for i in result.items
                 if i.device.get(result.peak_phase)) + ".",
             f"Budget: {_gb(result.budget)} ({result.budget_source}). "
             "See `python -m launcher plan RECIPE [key=value ...]` for the whole table"]
    if result.fix:
        lines.insert(1, "Add: " + " ".join(result.fix))
    raise RecipeError("\n    ".join(lines))


def main(args: list[str]) -> int:
    """`python -m launcher plan RECIPE [key=value ...]`: print the plan; exit 1 if it does not
    fit (2 for a recipe error)."""
    from .recipes import load
    if not args:
        raise RecipeError("plan needs a recipe: python -m launcher plan RECIPE [key=value ...]")
    cfg = load(args[0], args[1:])
    try:
        from .preflight import _offline_unless_reachable
        _offline_unless_reachable(cfg)  # an unreachable hub: the table at once, no retries
    except ImportError:
        pass
    result = plan(cfg)
    result.overrides = list(args[1:])
    print(result.report())
    return 0 if result.fits else 1
