"""Configs of the models the shipped recipes name, copied from their public config.json files.

The memory plan needs a model's shapes, not its weights; with these it can plan the shipped
recipes on a machine that cannot reach the hub (or before a gated model's license is accepted).
Only the fields that shape the model are kept.
"""
from __future__ import annotations

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
    "meta-llama/Llama-3.1-405B": dict(_LLAMA3, hidden_size=16384, intermediate_size=53248,
                                      num_hidden_layers=126, num_attention_heads=128,
                                      max_position_embeddings=131072, tie_word_embeddings=False),
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
# other names of the same models: the Instruct checkpoints keep their base model's shapes
ALIASES = {"gpt2": "openai-community/gpt2", "gpt2-xl": "openai-community/gpt2-xl",
           "meta-llama/Meta-Llama-3-8B-Instruct": "meta-llama/Meta-Llama-3-8B",
           "meta-llama/Meta-Llama-3-70B-Instruct": "meta-llama/Meta-Llama-3-70B",
           "meta-llama/Llama-3.1-405B-Instruct": "meta-llama/Llama-3.1-405B",
           "meta-llama/Llama-3.2-1B-Instruct": "meta-llama/Llama-3.2-1B"}


def known_config(model_id: str):
    """The transformers config of `model_id` from the table above, or None if it is not there."""
    from transformers import CONFIG_MAPPING  # late: `import models` should not cost transformers
    fields = KNOWN_CONFIGS.get(ALIASES.get(model_id, model_id))
    if fields is None:
        return None
    fields = dict(fields)
    return CONFIG_MAPPING[fields.pop("model_type")](**fields)
