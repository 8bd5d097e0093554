"""The model a recipe asks for is the model it gets: configs are built through the config class's
constructor, so fields it derives (Llama's head_dim) follow the recipe's keys."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from omegaconf import OmegaConf

from launcher.recipe.load import load, recipe_names
from models import build_tokenizer, model_config

FROM_CONFIG = [n for n in recipe_names() if load(n).model.config and not load(n).model.id]


def _config(name):
    rc = load(name)
    tok = build_tokenizer(rc.tokenizer.kind, rc.tokenizer.id)
    return rc, model_config(rc.model.name, None, OmegaConf.to_container(rc.model.config),
                            vocab_size=len(tok))


def _meta_model(cfg):
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("name", FROM_CONFIG)
def test_every_recipe_model_has_the_shapes_its_keys_ask_for(name):
    rc, cfg = _config(name)
    keys = OmegaConf.to_container(rc.model.config)
    for key, value in keys.items():
        assert getattr(cfg, key) == value, key
    model = _meta_model(cfg)
    if cfg.model_type == "llama":
        heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        head_dim = keys.get("head_dim", cfg.hidden_size // heads)
        attn = model.model.layers[0].self_attn
        assert attn.q_proj.weight.shape == (heads * head_dim, cfg.hidden_size)
        assert attn.k_proj.weight.shape == (kv * head_dim, cfg.hidden_size)
        assert model.model.layers[0].mlp.up_proj.weight.shape == (cfg.intermediate_size,
                                                                  cfg.hidden_size)
        assert len(model.model.layers) == cfg.num_hidden_layers
    if cfg.model_type == "gpt2":
        block = model.transformer.h[0]
        assert block.attn.c_attn.weight.shape == (cfg.n_embd, 3 * cfg.n_embd)
        assert block.mlp.c_fc.weight.shape == (cfg.n_embd, 4 * cfg.n_embd)
        assert len(model.transformer.h) == cfg.n_layer


def test_tiny_llama_has_the_parameter_count_of_its_shape():
    """hidden 128, 4 heads of 32, 2 key/value heads, MLP 352, 4 layers, untied head."""
    _, cfg = _config("tiny-llama")
    assert cfg.head_dim == 32
    v, h, kv_dim, mlp = cfg.vocab_size, 128, 2 * 32, 352
    per_layer = h * h + 2 * h * kv_dim + h * h + 3 * h * mlp + 2 * h
    expect = 2 * v * h + 4 * per_layer + h
    assert sum(p.numel() for p in _meta_model(cfg).parameters()) == expect


def test_a_key_the_config_class_lacks_is_refused():
    from models import UnknownModel
    with pytest.raises(UnknownModel, match="model.config.hiden_size"):
        model_config("llama", None, {"hiden_size": 64})
