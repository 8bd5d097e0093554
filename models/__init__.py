"""Model builders by name, over transformers' Auto classes.

    build_model(name="llama", init="random", config={"hidden_size": 128, ...}, vocab_size=257)
    build_model(name="llama", id="meta-llama/Meta-Llama-3-8B", init="pretrained")

A registry name maps to a transformers `model_type`; any other model_type transformers knows
(mistral, qwen2, ...) works as a name too, and any hub id or local folder works through `id`.
"""
from __future__ import annotations

from .tokenizer import build_tokenizer, byte_tokenizer

# registry name -> the transformers model_type its config class is registered under
REGISTRY = {
    "llama": "llama",
    "gpt2": "gpt2",
    "gpt-oss": "gpt_oss",
    "gpt_oss": "gpt_oss",
}


class UnknownModel(ValueError):
    pass


def model_config(name: str, id: str | None = None, config: dict | None = None,
                 vocab_size: int | None = None, token_ids: dict | None = None):
    from transformers import AutoConfig
    overrides = dict(config or {})
    if vocab_size is not None and "vocab_size" not in overrides:
        overrides["vocab_size"] = vocab_size
    overrides.update(token_ids or {})
    if id:  # a real model's saved config, its own derived fields kept, the recipe's keys set
        cfg = AutoConfig.from_pretrained(id)
        _check_keys(cfg, config)
        for key, value in overrides.items():
            setattr(cfg, key, value)
        return cfg
    from transformers import CONFIG_MAPPING
    model_type = REGISTRY.get(name, name)
    if model_type not in CONFIG_MAPPING:
        raise UnknownModel(
            f"model.name={name!r} is neither a registry name ({', '.join(REGISTRY)}) nor a "
            "transformers model_type; set model.id to a hub id or folder instead")
    config_class = CONFIG_MAPPING[model_type]
    _check_keys(config_class(), config)
    # through the constructor: fields it derives from others (Llama's head_dim from hidden_size
    # and num_attention_heads) follow the recipe's keys instead of keeping the default shape's
    cfg = config_class(**overrides)
    return cfg


def _check_keys(cfg, config: dict | None) -> None:
    for key in config or {}:
        if not hasattr(cfg, key):
            raise UnknownModel(f"model.config.{key}: {type(cfg).__name__} has no such field")


def build_model(name: str, init: str = "random", id: str | None = None,
                config: dict | None = None, vocab_size: int | None = None,
                token_ids: dict | None = None, dtype=None, load_weights: bool = True):
    """A causal LM: random weights from a config, or pretrained weights from `id`.

    init="pretrained" with load_weights=False: the model of `id`'s config (the recipe's keys
    set on it), its weights left to the caller (read shard by shard, models/pretrained.py)."""
    from transformers import AutoModelForCausalLM
    if init == "pretrained" and load_weights:
        return AutoModelForCausalLM.from_pretrained(id, dtype=dtype, **(config or {}))
    if init == "pretrained":  # the checkpoint's own vocabulary and token ids
        from .mxfp4 import drop_quantization
        cfg = model_config(name, id, config)
        drop_quantization(cfg)  # read dequantized, trained in full precision
        return AutoModelForCausalLM.from_config(cfg, **({"dtype": dtype} if dtype else {}))
    cfg = model_config(name, id, config, vocab_size, token_ids)
    return AutoModelForCausalLM.from_config(cfg, **({"dtype": dtype} if dtype else {}))


__all__ = ["REGISTRY", "build_model", "model_config", "build_tokenizer",
           "byte_tokenizer", "UnknownModel"]
