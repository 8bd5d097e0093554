"""LoRA through peft: low-rank adapters on a frozen base model."""
from __future__ import annotations


def apply_lora(model, r: int, alpha: float, dropout: float, target_modules: list[str]):
    """Wrap `model` in peft's LoRA: only the adapters train; the base is frozen as loaded.

    `target_modules` are module names (q_proj, v_proj, ...) or ["all-linear"] (every linear
    layer but the output head). The adapters start as peft initializes them (B = 0, so the
    wrapped model computes exactly what the base does at step 0), drawn from torch's RNG:
    seed it the same on every worker."""
    from peft import LoraConfig, get_peft_model
    targets = "all-linear" if list(target_modules) == ["all-linear"] else list(target_modules)
    config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as exc:  # a target module that the model lacks, named by peft
        raise ValueError(f"peft.target_modules={list(target_modules)}: {exc}") from None


def base_of(model):
    """The transformers model under a peft wrapper (the model itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
