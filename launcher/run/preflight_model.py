"""Pre-flight's checks of the model and the tokenizer a recipe names (preflight.py runs them):
a local folder that can hold them, a hub id that resolves, and the weight files that
model.init=pretrained reads, in the folder or, offline, in the local hub cache."""
from __future__ import annotations

import os
from pathlib import Path

from models.hub import hub_problem, looks_like_path
from launcher.recipe.schema import SHARDED


def folder_problem(key: str, ident: str, what: str) -> str | None:
    """A sentence for a local folder that cannot hold a Hugging Face model or tokenizer."""
    if not looks_like_path(ident):
        return None
    folder = Path(ident).expanduser()
    if not folder.exists():
        return (f"{key}={ident}: no such folder. Fix: point {key} at a folder written by "
                f"save_pretrained, or at a hub id ('org/name')")
    if ident.startswith("~"):
        return (f"{key}={ident}: transformers does not expand '~' in a path. Fix: write it in "
                f"full, {key}={folder}")
    if not folder.is_dir():
        return (f"{key}={ident}: not a folder. Fix: point {key} at the folder that holds the "
                f"{what}'s config.json (written by save_pretrained), or at a hub id ('org/name')")
    if not (folder / "config.json").is_file():
        return (f"{key}={ident}: the folder has no config.json (a Hugging Face model folder "
                f"written by save_pretrained has one). Fix: point {key} at the folder "
                f"save_pretrained wrote, or save the {what} there with save_pretrained")
    return None


# what AutoModelForCausalLM.from_pretrained reads from a local folder (transformers'
# SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME): the workers load
# a whole pretrained model this way under ddp; under fsdp each rank reads its shard from the
# safetensors files only (models/pretrained.py)
SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
FROM_PRETRAINED_FILES = SAFETENSORS_FILES + ("pytorch_model.bin", "pytorch_model.bin.index.json")


def weights_problem(cfg) -> str | None:
    """model.init=pretrained from a local folder without the files its loader reads."""
    folder = Path(cfg.model.id).expanduser()
    if cfg.model.init != "pretrained":
        return None
    if not folder.is_dir():
        return hub_weights_problem(cfg)
    fsdp = cfg.distributed.strategy in SHARDED
    accepted = SAFETENSORS_FILES if fsdp else FROM_PRETRAINED_FILES
    if any((folder / f).is_file() for f in accepted):
        return None
    if not fsdp:
        try:  # a config may name its weights file itself (transformers' transformers_weights)
            import json
            named = json.loads((folder / "config.json").read_text()).get("transformers_weights")
        except (OSError, ValueError):
            named = None
        if named and (folder / named).is_file():
            return None
    if fsdp:
        # each fsdp rank reads its own rows of each tensor, which safetensors allows
        return (f"model.id={cfg.model.id}: model.init=pretrained under distributed.strategy=fsdp "
                "reads the weights shard by shard from safetensors files, and this folder has "
                "no model.safetensors or model.safetensors.index.json. Save it with "
                "save_pretrained(..., safe_serialization=True), or use distributed.strategy=ddp")
    return (f"model.id={cfg.model.id}: model.init=pretrained reads the weights from this folder, "
            f"and it has none ({', '.join(accepted)}). Fix: save the model there with "
            "save_pretrained, or start from random weights with model.init=random")


def hub_weights_problem(cfg) -> str | None:
    """A hub id, offline: its weights must already be in the local cache (online, the workers
    download what they need)."""
    if os.environ.get("HF_HUB_OFFLINE", "0") in ("", "0", "false"):
        return None
    from huggingface_hub import constants, try_to_load_from_cache
    ident = cfg.model.id
    revision = cfg.model.get("revision") or None
    fsdp = cfg.distributed.strategy in SHARDED

    def cached(name):
        got = try_to_load_from_cache(ident, name, revision=revision)
        return got if isinstance(got, str) else None

    for index, single in (("model.safetensors.index.json", "model.safetensors"),
                          ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if fsdp and single == "pytorch_model.bin":
            break
        if cached(single):
            return None
        if (path := cached(index)) is not None:
            import json
            shards = sorted(set(json.loads(Path(path).read_text())["weight_map"].values()))
            absent = [f for f in shards if not cached(f)]
            if not absent:
                return None
            return (f"model.id={ident}: model.init=pretrained needs {len(absent)} of its "
                    f"{len(shards)} weight files ({absent[0]}, ...) that are not in the local "
                    f"Hugging Face cache ({constants.HF_HUB_CACHE}), and the hub cannot be "
                    f"reached (HF_HUB_OFFLINE). Fix: where the hub is reachable, run "
                    f"huggingface-cli download {ident}, or start from model.init=random")
    return (f"model.id={ident}: model.init=pretrained needs its weights, which are not in the "
            f"local Hugging Face cache ({constants.HF_HUB_CACHE}), and the hub cannot be "
            f"reached (HF_HUB_OFFLINE). Fix: where the hub is reachable, run "
            f"huggingface-cli download {ident} (the workers read that cache), or start from "
            "random weights with model.init=random")


def model_problem(cfg) -> str | None:
    """model.id, when the recipe names one: its folder or hub id resolves, and its weights are
    there for model.init=pretrained."""
    if not cfg.model.id:
        return None
    if (msg := folder_problem("model.id", cfg.model.id, "model")) is not None:
        return msg
    from transformers import AutoConfig
    try:
        AutoConfig.from_pretrained(cfg.model.id)
    except Exception as exc:  # noqa: BLE001  every kind is told apart in hub_problem
        return hub_problem(exc, "model", "model.id", cfg.model.id)
    return weights_problem(cfg) or checkpoint_keys_problem(cfg)


def checkpoint_keys_problem(cfg) -> str | None:
    """model.init=pretrained read shard by shard (fsdp, hsdp, tp, pp) from a local folder: every
    parameter of the model the recipe builds must be in the checkpoint, in its shape. Said here,
    before any worker starts, rather than by every rank at its first step (a hub id's files are
    checked by the workers as they read them)."""
    folder = Path(cfg.model.id).expanduser()
    if cfg.model.init != "pretrained" or cfg.distributed.strategy not in SHARDED or \
            not folder.is_dir():
        return None
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    from models import model_config
    from models.pretrained import MissingWeights, SafetensorsFiles
    try:
        files = SafetensorsFiles(folder)
    except MissingWeights:
        return None  # weights_problem said it
    config = OmegaConf.to_container(cfg.model.config) if cfg.model.config else {}
    with torch.device("meta"):  # shapes only: nothing allocated
        model = AutoModelForCausalLM.from_config(model_config(cfg.model.name, str(folder),
                                                              config))
    prefixes, bad = (getattr(model, "base_model_prefix", ""),), []
    for name, p in model.named_parameters():
        key = files.key_for(name, prefixes)
        if key is None:
            bad.append(f"{name} is missing")
        elif files.shape(key) != tuple(p.shape):
            bad.append(f"{name} is {list(files.shape(key))} there, {list(p.shape)} here")
    files.close()
    if not bad:
        return None
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    return (f"model.id={cfg.model.id}: the checkpoint does not hold the model the recipe builds "
            f"({type(model).__name__} from its config and model.config): "
            f"{'; '.join(bad[:3])}{more}. Fix: point model.id at a checkpoint of this "
            "architecture written by save_pretrained, or drop the model.config keys that change "
            "its shapes")


def tokenizer_problem(cfg) -> str | None:
    """The hub tokenizer the recipe names (tokenizer.id, else model.id) can be loaded."""
    if cfg.tokenizer.kind != "hub":
        return None
    ident = cfg.tokenizer.id or cfg.model.id
    key = "tokenizer.id" if cfg.tokenizer.id else "model.id"
    if looks_like_path(ident) and not Path(ident).expanduser().is_dir():
        # said once, by model_problem, when it is model.id's folder
        return None if ident == cfg.model.id else folder_problem(key, ident, "tokenizer")
    from transformers import AutoTokenizer
    try:
        AutoTokenizer.from_pretrained(ident)
    except Exception as exc:  # noqa: BLE001
        if ident == cfg.model.id and folder_problem("model.id", ident, "model"):
            return None  # the folder's problem, said once by model_problem
        return hub_problem(exc, "tokenizer", key, ident)
    return None
