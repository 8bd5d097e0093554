"""The recipe's model, measured on the meta device: shapes and parameter counts, no weights."""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from models.known_configs import KNOWN_CONFIGS, known_config

from launcher.recipe.load import RecipeError


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
    # parameters of the linears the model's tensor-parallel plan splits (base_model_tp_plan),
    # in all and in the largest block; the rest is whole on every tp rank
    tp_split_params: int = 0
    tp_block_split: int = 0


def _tokenizer_shape(cfg):
    """(vocabulary size, token ids) the byte tokenizer gives the loop, or (None, None): known
    offline, so the plan sets them as the loop will."""
    if cfg.tokenizer.kind != "byte":
        return None, None
    from models import byte_tokenizer
    tok = byte_tokenizer()
    return len(tok), {"eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id,
                      "pad_token_id": tok.pad_token_id}


def hf_config(cfg):
    """(transformers config, where it came from), as models.model_config builds it; when the
    hub cannot give model.id's config, the built-in table's (models/known_configs.py)."""
    from models import model_config
    m = cfg.model
    overrides = OmegaConf.to_container(m.config) if m.config else {}
    vocab, token_ids = _tokenizer_shape(cfg)
    if not m.id:
        return model_config(m.name, None, overrides, vocab, token_ids), \
            f"built from model.name={m.name} and model.config"
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
    """The decoder blocks, found as launcher.train.model_setup.shard finds them."""
    for attr in ("model.layers", "transformer.h"):
        obj = model
        try:
            for part in attr.split("."):
                obj = getattr(obj, part)
            return list(obj)
        except AttributeError:
            continue
    return []


def _meta_model(cfg):
    """(the recipe's model built on the meta device, its config, where the config came from)."""
    import torch
    from transformers import AutoModelForCausalLM
    hf, source = hf_config(cfg)
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
    return model, hf, source


def _matmuls(model, out, blocks):
    """(parameters of every nn.Linear / Conv1D, each shared one once; the (name, in, out, in
    block 0) of each but the output layer, which is what LoRA may adapt)."""
    import torch
    from transformers.pytorch_utils import Conv1D
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
        if isinstance(mod, Conv1D):  # GPT-2 stores its weights (in, out)
            fan_in, fan_out = mod.weight.shape
        else:
            fan_in, fan_out = mod.in_features, mod.out_features
        linears.append((name, int(fan_in), int(fan_out), id(mod) in first_block))
    return matmul, linears


def _mlp_kind(hf, names: set, experts) -> str:
    """The MLP's shape, which decides what its activations cost (see docs/memory-plan.md)."""
    act = str(getattr(hf, "hidden_act", None) or getattr(hf, "activation_function", "") or "")
    if experts:
        return "moe"
    if "gate_proj" in names or "w1" in names:
        return "swiglu"
    if act in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return "gelu_tanh"
    return "gelu"


def _dropout(hf, keys) -> float:
    return max(float(getattr(hf, k, 0.0) or 0.0) for k in keys)


def model_facts(cfg) -> ModelFacts:
    """Build the recipe's model on the meta device (no memory, no weights) and measure it."""
    model, hf, source = _meta_model(cfg)
    params = list(model.parameters())  # shared (tied) parameters once
    first = next(p for p in params if p.is_floating_point())
    blocks = _blocks(model)
    block_ids = {id(p) for b in blocks for p in b.parameters()}
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    tied = out is not None and inp is not None and out.weight is inp.weight
    matmul, linears = _matmuls(model, out, blocks)
    h, heads = hf.hidden_size, hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or h // heads
    kv_heads = getattr(hf, "num_key_value_heads", None) or heads
    experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None)
    names = {n_.rsplit(".", 1)[-1] for n_, _ in (blocks[0].named_modules() if blocks else [])}
    return ModelFacts(
        name=cfg.model.id or cfg.model.name, config_source=source,
        n_params=sum(p.numel() for p in params),
        param_bytes=first.element_size(), dtype_name=str(first.dtype).replace("torch.", ""),
        n_layers=len(blocks) or hf.num_hidden_layers,
        block_params=max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0),
        root_params=sum(p.numel() for p in params if id(p) not in block_ids),
        lm_head_params=0 if out is None or tied else out.weight.numel(),
        head_matmul=out.weight.numel() if out is not None else 0,
        matmul_params=matmul, hidden=h, heads=heads,
        q_dim=heads * head_dim, kv_dim=kv_heads * head_dim,
        intermediate=getattr(hf, "intermediate_size", None) or getattr(hf, "n_inner", None)
        or 4 * h,
        vocab=hf.vocab_size, mlp=_mlp_kind(hf, names, experts),
        experts_per_token=(getattr(hf, "num_experts_per_tok", None) or 1) if experts else 1,
        dropout=_dropout(hf, ("resid_pdrop", "hidden_dropout", "hidden_dropout_prob", "dropout")),
        attn_dropout=_dropout(hf, ("attn_pdrop", "attention_dropout")),
        attn_impl=str(getattr(model.config, "_attn_implementation", "eager")),
        fused_qkv="c_attn" in names, linears=linears, **_tp_split(model, hf, blocks))


def _tp_split(model, hf, blocks) -> dict:
    """What the model's tensor-parallel plan splits: its linears matched by the plan's patterns
    (names relative to the base model, as transformers writes them)."""
    import fnmatch
    plan = getattr(hf, "base_model_tp_plan", None) or {}
    base = getattr(model, getattr(model, "base_model_prefix", ""), None) or model
    split = {id(m) for n, m in base.named_modules()
             if any(fnmatch.fnmatchcase(n, pat) for pat in plan)}

    def count(mods) -> int:
        return sum(p.numel() for m in mods if id(m) in split for p in m.parameters(recurse=False))
    return {"tp_split_params": count(base.modules()),
            "tp_block_split": max((count(b.modules()) for b in blocks), default=0)}


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
