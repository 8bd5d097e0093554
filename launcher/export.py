"""The model written at the end of a run: `model/` (save_pretrained), or under LoRA `adapter/`,
`base/` and the merged `model/`."""
from __future__ import annotations

import json
from pathlib import Path

import torch

def export(model, state: dict, tokenizer, path: Path) -> None:
    """save_pretrained with the full (gathered) state, loadable by AutoModelForCausalLM."""
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
             for k, v in state.items()}
    model.save_pretrained(str(path), state_dict=state, safe_serialization=True)
    tokenizer.save_pretrained(str(path))


def export_lora(cfg, model, state: dict, tokenizer, out_dir: Path) -> None:
    """The adapter in `adapter/` (save_pretrained: loadable with PeftModel.from_pretrained on its
    base); the base in `base/` when it came from a seeded init rather than a model id (nothing
    else could rebuild it); with peft.merge=true the merged model in `model/`.

    The live model is left untouched (merging or unloading it would change this rank's
    parameters before the replicas are compared): copies are built on the CPU from `state`."""
    state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
             for k, v in state.items()}

    def copy():
        from .model_setup import build
        _, fresh, _ = build(cfg, torch.device("cpu"), sharded=False)  # whole, on the CPU
        fresh.load_state_dict(state)
        return fresh

    adapter_dir, base_dir = out_dir / "adapter", None if cfg.model.id else out_dir / "base"
    local = copy()
    local.save_pretrained(str(adapter_dir))
    tokenizer.save_pretrained(str(adapter_dir))
    if base_dir:  # the base beside the adapter, which points at it
        local.unload().save_pretrained(str(base_dir), safe_serialization=True)
        tokenizer.save_pretrained(str(base_dir))
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        config["base_model_name_or_path"] = str(base_dir.resolve())
        (adapter_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))
    if cfg.peft.merge:
        merged = (copy() if base_dir else local).merge_and_unload()
        merged.save_pretrained(str(out_dir / "model"), safe_serialization=True)
        tokenizer.save_pretrained(str(out_dir / "model"))
