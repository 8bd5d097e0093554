"""Recipe loading: YAML files merged onto the schema, with command-line overrides.

    load("tiny-llama", ["trainer.max_steps=7", "~model.config.num_hidden_layers"])

A recipe names a base with `extends:` (merged first, so shared defaults live in one file). Overrides
are OmegaConf dotlist entries; `~key` deletes the key so it falls back to the base or the schema.
Every problem raises RecipeError with the key, the value and the fix, before any worker starts.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import fields, is_dataclass
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .schema import CHOICES, Recipe

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


class RecipeError(ValueError):
    pass


def recipe_names() -> list[str]:
    """Shipped recipes; files starting with '_' are bases, not recipes."""
    return sorted(p.stem for p in RECIPES_DIR.glob("*.yaml") if not p.stem.startswith("_"))


def recipe_path(name_or_path: str) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if not p.is_file():
            raise RecipeError(f"recipe file {name_or_path!r} does not exist")
        return p
    p = RECIPES_DIR / f"{name_or_path}.yaml"
    if not p.is_file():
        names = recipe_names()
        near = difflib.get_close_matches(name_or_path, names, n=1)
        hint = f" Did you mean {near[0]!r}?" if near else ""
        raise RecipeError(f"no recipe named {name_or_path!r}.{hint} Known recipes: "
                          f"{', '.join(names)} (or give a path to a YAML file)")
    return p


def _read_chain(path: Path, seen=()) -> DictConfig:
    """The YAML of `path` merged onto the chain of recipes it extends."""
    if path in seen:
        raise RecipeError(f"recipe {path.name}: `extends` forms a cycle")
    try:
        own = OmegaConf.load(path)
    except Exception as exc:
        raise RecipeError(f"recipe {path}: not valid YAML: {exc}") from None
    if not isinstance(own, DictConfig):
        raise RecipeError(f"recipe {path}: the top level must be a mapping of keys")
    base_name = own.get("extends")
    if not base_name:
        return own
    base_path = path.parent / f"{base_name}.yaml"
    if not base_path.is_file():
        raise RecipeError(f"recipe {path.name}: extends={base_name!r} but {base_path} does not "
                          "exist")
    merged = OmegaConf.merge(_read_chain(base_path, seen + (path,)), own)
    return merged


def _schema_keys(cls=Recipe, prefix="") -> list[str]:
    keys = []
    for f in fields(cls):
        full = f"{prefix}{f.name}"
        keys.append(full)
        default = f.default_factory() if callable(f.default_factory) else f.default
        if is_dataclass(default):
            keys += _schema_keys(type(default), full + ".")
    return keys


# Names people bring from other tools, mapped to ours.
_ALIASES = {"learning_rate": "lr", "batch_size": "micro_batch_size", "steps": "max_steps",
            "num_steps": "max_steps", "nproc": "num_processes", "world_size": "num_processes",
            "gradient_accumulation_steps": "grad_accum_steps", "max_grad_norm": "grad_clip",
            "warmup": "warmup_steps", "seed": "seed", "block_size": "seq_len"}


def _suggest(key: str) -> str:
    head, _, last = key.rpartition(".")
    if last in _ALIASES:
        alias = f"{head}.{_ALIASES[last]}" if head else _ALIASES[last]
        hits = [k for k in _schema_keys() if k == alias or k.endswith("." + _ALIASES[last])]
        if hits:
            best = alias if alias in hits else hits[0]
            return f" Did you mean '{best}'?"
    near = difflib.get_close_matches(key, _schema_keys(), n=1, cutoff=0.6)
    if not near:
        last = key.rsplit(".", 1)[-1]
        near = [k for k in _schema_keys() if k.rsplit(".", 1)[-1] == last][:1]
    return f" Did you mean '{near[0]}'?" if near else ""


def _delete(cfg: DictConfig, dotted: str) -> None:
    parts = dotted.split(".")
    node = cfg
    for p in parts[:-1]:
        if not isinstance(node, DictConfig) or p not in node:
            return
        node = node[p]
    if isinstance(node, DictConfig) and parts[-1] in node:
        del node[parts[-1]]
    elif dotted not in _schema_keys() and not dotted.startswith("model.config."):
        raise RecipeError(f"cannot delete '~{dotted}': no such key.{_suggest(dotted)}")


def _normalize_faults(cfg: DictConfig) -> None:
    """Accept 'kill:2:5' as shorthand for {kind: kill, rank: 2, step: 5}."""
    faults = cfg.get("faults")
    if not isinstance(faults, ListConfig):
        return
    out = []
    for item in faults:
        if isinstance(item, str):
            parts = item.split(":")
            if len(parts) != 3:
                raise RecipeError(f"faults: {item!r} is not kind:rank:step (e.g. kill:2:5)")
            try:
                item = {"kind": parts[0], "rank": int(parts[1]), "step": int(parts[2])}
            except ValueError:
                raise RecipeError(f"faults: {item!r}: rank and step must be integers") from None
        out.append(item)
    cfg.faults = out


def load(name_or_path: str, overrides: list[str] = ()) -> DictConfig:
    """The resolved recipe (interpolations done), validated; raises RecipeError."""
    cfg = _read_chain(recipe_path(name_or_path))
    sets = [o for o in overrides if not o.startswith("~")]
    for o in sets:
        if "=" not in o:
            raise RecipeError(f"override {o!r} is not key=value (use ~key to delete a key)")
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(sets))
    except OmegaConfBaseException as exc:
        raise RecipeError(f"override could not be parsed: {exc}") from None
    for o in overrides:
        if o.startswith("~"):
            _delete(cfg, o[1:])
    _normalize_faults(cfg)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Recipe), cfg)
    except OmegaConfBaseException as exc:
        raise _explain(exc, overrides) from None
    try:
        OmegaConf.resolve(merged)
    except OmegaConfBaseException as exc:
        raise RecipeError(f"recipe interpolation failed: {exc}") from None
    validate(merged)
    return merged


def _explain(exc: OmegaConfBaseException, overrides) -> RecipeError:
    key = getattr(exc, "full_key", None) or getattr(exc, "key", None) or "?"
    origin = next((o for o in overrides if o.split("=", 1)[0].lstrip("~") == key), None)
    where = f" (from override '{origin}')" if origin else ""
    name = type(exc).__name__
    if "ConfigKeyError" in name or "not in struct" in str(exc) or "Key '" in str(exc):
        return RecipeError(f"unknown recipe key '{key}'{where}.{_suggest(str(key))} "
                           "Run `python -m launcher show RECIPE` to see every key.")
    value = getattr(exc, "value", None)
    msg = str(exc).splitlines()[0]
    return RecipeError(f"recipe key '{key}' got {value!r}{where}: {msg}. Fix the value to the "
                       "type the schema expects (see launcher/schema.py).")


def _get(cfg, dotted):
    node = cfg
    for p in dotted.split("."):
        node = node[p]
    return node


def validate(cfg: DictConfig) -> None:
    """Checks that types alone cannot express."""
    for key, allowed in CHOICES.items():
        v = _get(cfg, key)
        if v not in allowed:
            raise RecipeError(f"{key}={v!r} is not allowed; choose one of {', '.join(allowed)} "
                              f"(e.g. {key}={allowed[0]})")

    def need(ok, key, value, fix):
        if not ok:
            raise RecipeError(f"{key}={value!r}: {fix}")

    t, d, c, o = cfg.trainer, cfg.distributed, cfg.checkpointless, cfg.optim
    need(t.max_steps >= 1, "trainer.max_steps", t.max_steps, "must be at least 1")
    need(t.micro_batch_size >= 1, "trainer.micro_batch_size", t.micro_batch_size, "must be >= 1")
    need(t.grad_accum_steps >= 1, "trainer.grad_accum_steps", t.grad_accum_steps, "must be >= 1")
    need(t.log_every >= 1, "trainer.log_every", t.log_every, "must be >= 1")
    need(d.num_processes >= 1, "distributed.num_processes", d.num_processes, "must be >= 1")
    need(0 <= d.master_port < 65536, "distributed.master_port", d.master_port, "0..65535")
    need(d.threads_per_worker >= 0, "distributed.threads_per_worker", d.threads_per_worker,
         "must be >= 0 (0 picks cores / processes)")
    need(c.spares >= 0, "checkpointless.spares", c.spares, "must be >= 0")
    need(c.heartbeat_timeout_s > 0, "checkpointless.heartbeat_timeout_s", c.heartbeat_timeout_s,
         "must be > 0 seconds")
    need(o.lr > 0, "optim.lr", o.lr, "must be > 0, e.g. optim.lr=3e-4")
    need(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
    need(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")
    need(cfg.data.seq_len >= 8, "data.seq_len", cfg.data.seq_len, "must be >= 8")
    if cfg.model.init == "pretrained":
        need(cfg.model.id, "model.id", cfg.model.id,
             "model.init=pretrained needs a hub id or local folder, e.g. model.id=gpt2")
    if cfg.tokenizer.kind == "hub":
        need(cfg.tokenizer.id or cfg.model.id, "tokenizer.id", cfg.tokenizer.id,
             "tokenizer.kind=hub needs tokenizer.id (or model.id)")
    if cfg.data.source == "hub":
        need(cfg.data.id, "data.id", cfg.data.id, "data.source=hub needs a dataset id")
    if cfg.data.source == "files":
        need(len(cfg.data.files) > 0, "data.files", list(cfg.data.files),
             "data.source=files needs at least one file")
    for i, f in enumerate(cfg.faults):
        need(f.kind in ("kill", "hang", "raise"), f"faults[{i}].kind", f.kind,
             "choose kill, hang or raise")
        need(0 <= f.rank < d.num_processes, f"faults[{i}].rank", f.rank,
             f"must be a rank in 0..{d.num_processes - 1}")
        need(0 <= f.step < t.max_steps, f"faults[{i}].step", f.step,
             f"must be a step in 0..{t.max_steps - 1}")
    rep = c.replication
    need(rep.factor >= 1, "checkpointless.replication.factor", rep.factor,
         "must be >= 1 (1: no peer copies; 2: one copy in a peer's memory)")
    need(rep.factor <= max(1, d.num_processes), "checkpointless.replication.factor", rep.factor,
         f"cannot exceed distributed.num_processes={d.num_processes}")
    need(rep.interval >= 1, "checkpointless.replication.interval", rep.interval, "must be >= 1")
    need(cfg.checkpoint.interval >= 0, "checkpoint.interval", cfg.checkpoint.interval,
         "must be >= 0 (0 disables durable checkpoints)")
    need(cfg.checkpoint.keep >= 1, "checkpoint.keep", cfg.checkpoint.keep, "must be >= 1")
    if cfg.faults:
        need(c.enabled, "checkpointless.enabled", c.enabled,
             "faults are injected but recovery is off; set checkpointless.enabled=true")


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg)
