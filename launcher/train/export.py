"""The model written at the end of a run: `model/` (safetensors shards and their index, as
save_pretrained writes a large model), or under LoRA `adapter/`, `base/` and the merged `model/`.

The full model is never held by one rank: tensors are gathered one at a time (a collective under
fsdp), hashed for the run's digest, and kept only by the rank that writes the file they go to.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
import torch.distributed as dist

from checkpointless.worker import StateDigest
from checkpointless.worker import full_tensor

from launcher.recipe.schema import SHARDED

INDEX = "model.safetensors.index.json"


def local_state(model, strategy: str) -> dict:
    """This rank's view of the model state, nothing gathered (DTensors under fsdp), with the
    names get_model_state_dict gives: the digest's names."""
    if strategy in SHARDED:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return get_model_state_dict(model)
    return model.state_dict()


def saved_names(model, names: list[str]) -> list[str]:
    """The state names save_pretrained writes: without `_keys_to_ignore_on_save` and without
    the duplicates of tied weights (the one transformers re-ties on load is dropped)."""
    ignore = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    tied_patterns = []
    for prefix, sub in model.named_modules():
        for k in (getattr(sub, "_tied_weights_keys", None) or {}):
            tied_patterns.append(f"{prefix}.{k}" if prefix else k)
    by_param: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), []).append(name)
    drop = set()
    for group in by_param.values():
        if len(group) > 1:  # one tensor under several names: the declared tied ones go, as
            # transformers drops them (in sorted order, always leaving one name)
            tied = [n for n in sorted(group) if any(re.search(pat, n) for pat in tied_patterns)]
            drop.update(tied[:len(group) - 1])
    return [n for n in names if n not in ignore and n not in drop]


def split_files(sizes: dict[str, int], n_files: int) -> list[list[str]]:
    """Names in state order cut into `n_files` contiguous runs of about equal bytes."""
    total, files, acc = sum(sizes.values()), [[] for _ in range(n_files)], 0
    for name, size in sizes.items():
        i = min(n_files - 1, acc * n_files // max(1, total))
        files[i].append(name)
        acc += size
    return [f for f in files if f]


def digest_and_export(model, strategy: str, tokenizer, path: Path | None, rank: int,
                      world: int) -> tuple[str, int]:
    """(params_sha256, parameter count) of the full model, and with `path` the sharded export.

    Every rank calls this together (gathers under fsdp). Rank r writes the r-th file of the
    export, from the tensors it kept; rank 0 then writes the index, config and tokenizer."""
    state = local_state(model, strategy)
    names = sorted(state)
    files: list[list[str]] = []
    if path is not None:
        kept = saved_names(model, [n for n in state])  # in state order: layers stay together
        sizes = {n: state[n].numel() * state[n].element_size() for n in kept}
        files = split_files(sizes, max(1, min(world, len(kept))))
    mine = set(files[rank]) if rank < len(files) else set()
    digest, count, keep = StateDigest(), 0, {}
    for name in names:
        t = full_tensor(state[name])  # the one full tensor held at this moment
        digest.update(name, t)
        count += t.numel()
        if name in mine:
            keep[name] = t.detach().to("cpu", copy=True).contiguous()
        del t
    if path is not None:
        _write_files(model, tokenizer, Path(path), files, rank, keep, world)
    return digest.hexdigest(), count


def _file_name(i: int, n: int) -> str:
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def _write_files(model, tokenizer, path: Path, files, rank: int, keep: dict,
                 world: int) -> None:
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    if keep:
        try:  # a model whose layout on disk differs from the one in memory (transformers 5)
            from transformers.core_model_loading import revert_weight_conversion
            keep = revert_weight_conversion(model, keep)
        except ImportError:
            pass
        name = path / _file_name(rank, len(files))
        save_file(keep, str(name) + ".tmp", metadata={"format": "pt"})
        os.replace(str(name) + ".tmp", name)
    if world > 1:  # (an aborted group raises here: the failure is recovered, job.py)
        dist.barrier()  # every file is complete before the index names it
    if rank != 0:
        return
    _remove_stale_weights(path, {_file_name(i, len(files)) for i in range(len(files))})
    if len(files) > 1:
        _write_index(path, len(files))
    config = model.config  # what save_pretrained records: the class (FSDP2's subclass named as
    config.architectures = [type(model).__name__.removeprefix("FSDP")]  # the plain one) and
    config.dtype = str(model.dtype).removeprefix("torch.")  # the dtype from_pretrained restores
    config.save_pretrained(str(path))
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))


def _remove_stale_weights(path: Path, written: set[str]) -> None:
    """An output folder used before (the same run.output_dir resumed at another world size, or
    run again) may hold weight files of the earlier export: from_pretrained would prefer a stale
    single `model.safetensors` over the new index, or keep orphan shards beside it. Only files
    this export wrote remain."""
    for p in path.iterdir():
        stale = (p.name.startswith("model") and p.name.endswith((".safetensors", ".tmp"))
                 and p.name not in written)
        if stale or (p.name == INDEX and len(written) == 1):
            p.unlink(missing_ok=True)


def _write_index(path: Path, n: int) -> None:
    """The index from the files' own headers (names after any layout conversion)."""
    from safetensors import safe_open
    weight_map, total = {}, 0
    for i in range(n):
        name = _file_name(i, n)
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                weight_map[key] = name
                sl = f.get_slice(key)
                numel = 1
                for d in sl.get_shape():
                    numel *= d
                total += numel * torch.empty((), dtype=_DTYPES[sl.get_dtype()]).element_size()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


def export_lora(cfg, model, state: dict, tokenizer, out_dir: Path) -> None:
    """The adapter in `adapter/` (save_pretrained: loadable with PeftModel.from_pretrained on its
    base); the base in `base/` when it came from a seeded init rather than pretrained weights
    (nothing else could rebuild it); with peft.merge=true the merged model in `model/`.

    The live model is left untouched (merging or unloading it would change this rank's
    parameters before the replicas are compared): copies are built on the CPU from `state`."""
    state = {k: full_tensor(v).detach().cpu() for k, v in state.items()}

    def copy():
        from launcher.train.model_setup import build
        _, fresh, _ = build(cfg, torch.device("cpu"), sharded=False)  # whole, on the CPU
        fresh.load_state_dict(state)
        return fresh

    # a base from a seeded init (model.init=random, with or without a model.id for its config)
    # exists nowhere else: written beside the adapter; a pretrained one is model.id's
    adapter_dir = out_dir / "adapter"
    base_dir = None if cfg.model.init == "pretrained" else out_dir / "base"
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
