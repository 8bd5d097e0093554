"""Recipe loading: YAML files merged onto the schema, with command-line overrides.

    load("tiny-llama", ["trainer.max_steps=7", "~model.config.num_hidden_layers"])

A recipe names a base with `extends:` (merged first, so shared defaults live in one file): NAME.yaml
beside the recipe, else a shipped one in recipes/. Overrides are OmegaConf dotlist entries; `~key`
deletes the key so it falls back to the base or the schema. A recipe must choose its model
(model.name, model.id or model.config, itself or through `extends`); an empty file is refused.
Every problem raises RecipeError with the key, the value and the fix, before any worker starts.
"""
from __future__ import annotations

import difflib
import io
import math
import os
import types
import typing
from dataclasses import fields, is_dataclass
from pathlib import Path

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from checkpointless.faults import KINDS, PHASES, kinds_at, split_fault

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
        if p.is_dir():
            raise RecipeError(f"recipe path {name_or_path!r} is a folder, not a recipe file; give "
                              "a YAML file (e.g. my-recipe.yaml) or a recipe name "
                              "(`python -m launcher ls` lists them)")
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


_HOW_TO_WRITE = ("A recipe needs at least `extends: <recipe>` or a `model:` section, then the keys "
                 "it changes, e.g.\n    extends: tiny-llama\n    trainer: {max_steps: 50}\nor"
                 "\n    extends: _tiny\n    model: {name: gpt2, config: {n_layer: 2, n_embd: 64}}"
                 "\nRun `python -m launcher show tiny-llama` to see a complete one.")


def _blank(value) -> bool:
    """Nothing said: null, '', an empty list or mapping, or a mapping of only such values."""
    if value is None or value == "" or value == []:
        return True
    return isinstance(value, dict) and all(_blank(v) for v in value.values())


def _read_yaml(path: Path) -> DictConfig:
    """The file's own keys; refuses what cannot be read, is not a mapping, or says nothing."""
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise RecipeError(f"recipe {path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at "
                          f"offset {exc.start}); save the file as UTF-8") from None
    except OSError as exc:
        raise RecipeError(f"recipe {path}: cannot be read ({exc.strerror or exc}); check the "
                          "path and its permissions") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        own = OmegaConf.load(io.StringIO(text)) if isinstance(root, yaml.MappingNode) else None
    except Exception as exc:
        raise RecipeError(f"recipe {path}: not valid YAML: {exc}") from None
    if root is None or (isinstance(root, yaml.ScalarNode) and root.tag.endswith(":null")):
        raise RecipeError(f"recipe {path} is empty (no keys: only comments, blank lines or "
                          f"`null`). {_HOW_TO_WRITE}")
    if own is None:
        got = "a list" if isinstance(root, yaml.SequenceNode) else \
            f"the single value {root.value!r}"
        raise RecipeError(f"recipe {path}: the top level must be a mapping of keys (`key: value` "
                          f"lines), but it is {got}. {_HOW_TO_WRITE}")
    raw = OmegaConf.to_container(own, resolve=False)
    if _blank(raw):
        raise RecipeError(f"recipe {path} is empty: its keys ({', '.join(map(str, raw))}) have no "
                          f"values. {_HOW_TO_WRITE}")
    _check_shape(raw, Recipe, "", f"recipe {path}")
    return own


def _base_path(path: Path, base_name) -> Path:
    """`extends: NAME` is NAME.yaml beside the recipe, else a shipped recipe or base."""
    if not isinstance(base_name, str):
        raise RecipeError(f"recipe {path.name}: extends={base_name!r} must be the name of a recipe "
                          "or base, e.g. `extends: _tiny` or `extends: tiny-llama`")
    file = base_name if base_name.endswith((".yaml", ".yml")) else f"{base_name}.yaml"
    tried = [path.parent / file, RECIPES_DIR / file]
    for candidate in tried:
        if candidate.is_file():
            return candidate
    known = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))
    near = difflib.get_close_matches(base_name, known, n=1)
    hint = f" Did you mean {near[0]!r}?" if near else ""
    raise RecipeError(f"recipe {path.name}: extends={base_name!r} but neither "
                      f"{' nor '.join(str(t) for t in dict.fromkeys(tried))} exists.{hint} "
                      f"Shipped recipes and bases: {', '.join(known)}")


def _read_chain(path: Path, seen=()) -> DictConfig:
    """The YAML of `path` merged onto the chain of recipes it extends."""
    if path.resolve() in seen:
        raise RecipeError(f"recipe {path.name}: `extends` forms a cycle")
    own = _read_yaml(path)
    base_name = own.get("extends")
    if base_name is None or base_name == "":
        return own
    base_path = _base_path(path, base_name)
    merged = OmegaConf.merge(_read_chain(base_path, seen + (path.resolve(),)), own)
    return merged


def _kind(hint):
    """(kind, inner, optional) of a schema type: map (a dataclass), dict, list or scalar."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(args) < len(typing.get_args(hint))
        hint = args[0] if len(args) == 1 else typing.Any
    if is_dataclass(hint):
        return "map", hint, optional
    origin = typing.get_origin(hint)
    if origin in (dict, typing.Dict):
        return "dict", None, optional
    if origin in (list, typing.List):
        return "list", (typing.get_args(hint) or (typing.Any,))[0], optional
    return "scalar", hint, optional


def _describe(value) -> str:
    kind = "mapping" if isinstance(value, dict) else "list" if isinstance(value, list) else \
        type(value).__name__
    return f"{kind} {value!r}"


def _check_shape(node, cls, prefix: str, origin: str) -> None:
    """Mappings where the schema has sections, lists where it has lists, single values elsewhere;
    named by key and by where they came from (a recipe file or an override)."""
    hints = typing.get_type_hints(cls)
    for key, value in node.items():
        full = f"{prefix}{key}"
        if not isinstance(key, str) or key not in hints:
            hint = _suggest(full) if "[" not in full else ""
            if prefix and (not hint or hint == f" Did you mean '{prefix[:-1]}'?"):
                hint = f" The keys of {prefix[:-1]} are: {', '.join(hints)}."
            raise RecipeError(f"unknown recipe key '{full}' in {origin}.{hint} "
                              "Run `python -m launcher show RECIPE` to see every key.")
        _check_value(value, hints[key], full, origin)


def _check_value(value, hint, full: str, origin: str) -> None:
    kind, inner, optional = _kind(hint)
    if isinstance(value, str) and "${" in value:
        return  # an interpolation; checked once resolved
    if value is None:
        if optional:
            return
        example = {"map": f"`{full}: {{...}}`", "dict": f"`{full}: {{}}`",
                   "list": f"`{full}: []`"}.get(kind, f"`{full}: <value>`")
        raise RecipeError(f"recipe key '{full}' is blank (null) in {origin}; give it a value "
                          f"(e.g. {example}) or delete it to keep the default")
    if kind == "map":
        if not isinstance(value, dict):
            names = [f.name for f in fields(inner)]
            first = names[0]
            raise RecipeError(
                f"recipe key '{full}' must be a mapping of keys ({', '.join(names)}), "
                f"not {_describe(value)}, in {origin}. Write e.g. `{full}: {{{first}: ...}}` in "
                f"YAML or `{full}.{first}=...` on the command line")
        _check_shape(value, inner, full + ".", origin)
    elif kind == "dict":
        if not isinstance(value, dict):
            raise RecipeError(f"recipe key '{full}' must be a mapping of keys, not "
                              f"{_describe(value)}, in {origin}. Write e.g. `{full}: "
                              f"{{hidden_size: 128}}` in YAML or `{full}.hidden_size=128` on the "
                              "command line")
    elif kind == "list":
        if not isinstance(value, list):
            example = "'faults=[kill:1:5]'" if full == "faults" else f"'{full}=[a.jsonl,b.jsonl]'"
            raise RecipeError(f"recipe key '{full}' must be a list, not {_describe(value)}, in "
                              f"{origin}. Write e.g. `{full}: [...]` in YAML or {example} on the "
                              "command line")
        for i, item in enumerate(value):
            if is_dataclass(inner) and isinstance(item, str) and full == "faults":
                continue  # kind:rank:step shorthand, expanded by _normalize_faults
            if is_dataclass(inner) and not isinstance(item, dict):
                names = ", ".join(f.name for f in fields(inner))
                raise RecipeError(f"recipe key '{full}[{i}]' must be a mapping ({names}) or "
                                  "kind:rank:step, "
                                  f"not {_describe(item)}, in {origin}; e.g. "
                                  "{kind: kill, rank: 1, step: 5} or kill:1:5")
            _check_value(item, inner, f"{full}[{i}]", origin)
    elif isinstance(value, (dict, list)):
        expects = getattr(inner, "__name__", str(inner))
        raise RecipeError(f"recipe key '{full}' must be a single value ({expects}), not "
                          f"{_describe(value)}, in {origin}")


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
    """Accept 'kill:2:5' as shorthand for {kind: kill, rank: 2, step: 5}, 'kill:2:5@backward'
    for the same at another phase, and 'kill:2:5@random:7' for a seeded random moment (the
    grammar is checkpointless.faults.split_fault's)."""
    faults = cfg.get("faults")
    if not isinstance(faults, ListConfig):
        return
    out = []
    for item in faults:
        if isinstance(item, str):
            try:
                item = split_fault(item)
            except ValueError as exc:
                raise RecipeError(f"faults: {exc}") from None
        out.append(item)
    cfg.faults = out


def load(name_or_path: str, overrides: list[str] = ()) -> DictConfig:
    """The resolved recipe (interpolations done), validated; raises RecipeError."""
    path = recipe_path(name_or_path)
    cfg = _read_chain(path)
    for o in overrides:
        key = o.lstrip("~").split("=", 1)[0].strip()
        if not o.startswith("~") and "=" not in o:
            raise RecipeError(f"override {o!r} is not key=value (use ~key to delete a key)")
        if not key:
            raise RecipeError(f"override {o!r} names no key; write key=value, e.g. "
                              "trainer.max_steps=50")
        if o.startswith("~"):
            continue
        try:
            one = OmegaConf.from_dotlist([o])
        except OmegaConfBaseException as exc:
            raise RecipeError(f"override {o!r} could not be parsed: {exc}") from None
        _check_shape(OmegaConf.to_container(one, resolve=False), Recipe, "", f"override {o!r}")
        cfg = OmegaConf.merge(cfg, one)
    for o in overrides:
        if o.startswith("~"):
            _delete(cfg, o[1:])
    _require_model(cfg, path)
    _normalize_faults(cfg)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Recipe), cfg)
    except OmegaConfBaseException as exc:
        raise _explain(exc, overrides) from None
    try:
        OmegaConf.resolve(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        where = f" in '{key}'" if key else ""
        raise RecipeError(f"recipe interpolation failed{where}: {str(exc).splitlines()[0]}. A "
                          "${...} reference must name another key, e.g. ${run.name}, and must "
                          "not refer to itself") from None
    _world_from_nodes(merged, overrides)
    validate(merged)
    return merged


def _world_from_nodes(cfg: DictConfig, overrides) -> None:
    """With distributed.nproc_per_node given and num_processes not, the world is nodes x per
    node (a recipe's own num_processes is its one-node default, not a request)."""
    d = cfg.distributed
    asked = any(o.split("=", 1)[0].strip() == "distributed.num_processes" for o in overrides)
    if d.nproc_per_node > 0 and not asked:
        d.num_processes = d.num_nodes * d.nproc_per_node


def _require_model(cfg: DictConfig, path: Path) -> None:
    """The schema's default model is a full-size Llama (7B parameters with transformers' defaults):
    a recipe must choose its model - model.name, model.id or model.config, set in the file, in a
    recipe it extends or by an override - rather than fall back to that default."""
    model = cfg.get("model")
    raw = OmegaConf.to_container(model, resolve=False) if isinstance(model, DictConfig) else {}
    if any(not _blank(raw.get(k)) for k in ("name", "id", "config")):
        return
    raise RecipeError(
        f"recipe {path} does not say which model to train: none of model.name, model.id or "
        "model.config is set (by the file, a recipe it extends or an override), and the "
        "default is a full-size Llama (~7B parameters) that runs the workers out of memory. "
        "Set one (e.g. `model: {name: llama, config: {hidden_size: 128, num_hidden_layers: 4}}` "
        "or `model: {id: openai-community/gpt2}`), or extend a recipe that does "
        "(`extends: tiny-llama`). Run `python -m launcher show tiny-llama` to see a complete "
        "recipe.")


def _check_dir(key: str, value: str, example: str) -> None:
    """`value` is a folder that exists or can be created, and written; nothing is created here."""
    fix = f"choose a folder you can write, e.g. {key}={example}"
    if not str(value).strip():
        raise RecipeError(f"{key}={value!r}: must name a folder; {fix}")
    target = Path(value).absolute()
    for existing in (target, *target.parents):
        if os.path.lexists(existing):
            break
    if not existing.exists():
        raise RecipeError(f"{key}={value!r}: {existing} is a broken symbolic link; remove it or "
                          f"{fix}")
    if not existing.is_dir():
        what = "names an existing file, not a folder" if existing == target else \
            f"cannot be created: {existing} is a file, not a folder"
        raise RecipeError(f"{key}={value!r} {what}; move the file away or {fix}")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is a folder you cannot write to" if existing == target else \
            f"cannot be created: {existing} is not writable (permission denied)"
        raise RecipeError(f"{key}={value!r} {what}; {fix}")


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


TRACKERS = ("tensorboard", "wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab",
            "trackio")  # accelerate.tracking.LOGGER_TYPE_TO_CLASS, without importing accelerate


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

    for key in _schema_keys():
        v = _get(cfg, key)
        if isinstance(v, float) and not math.isfinite(v):
            raise RecipeError(f"{key}={v!r}: must be a finite number")

    t, d, c, o = cfg.trainer, cfg.distributed, cfg.checkpointless, cfg.optim
    need(t.max_steps >= 1, "trainer.max_steps", t.max_steps, "must be at least 1")
    need(t.micro_batch_size >= 1, "trainer.micro_batch_size", t.micro_batch_size, "must be >= 1")
    need(t.grad_accum_steps >= 1, "trainer.grad_accum_steps", t.grad_accum_steps, "must be >= 1")
    need(t.log_every >= 1, "trainer.log_every", t.log_every, "must be >= 1")
    if t.precision == "fp16":  # accelerate would silently train fp32 on CPU
        on_cpu = "distributed.device=cpu" if d.device == "cpu" else \
            "distributed.backend=gloo" if d.backend == "gloo" else None
        need(on_cpu is None, "trainer.precision", t.precision,
             f"fp16 needs a GPU (float16 autocast with a GradScaler) and this recipe runs on CPU "
             f"({on_cpu}); use trainer.precision=bf16 on CPU (or fp32)")
        need(d.strategy == "ddp", "trainer.precision", t.precision,
             "fp16 is supported under distributed.strategy=ddp only; under fsdp use "
             "trainer.precision=bf16")
    need(d.num_processes >= 1, "distributed.num_processes", d.num_processes, "must be >= 1")
    need(0 <= d.master_port < 65536, "distributed.master_port", d.master_port, "0..65535")
    need(d.bucket_cap_mb > 0, "distributed.bucket_cap_mb", d.bucket_cap_mb, "must be > 0 MB")
    need(d.threads_per_worker >= 0, "distributed.threads_per_worker", d.threads_per_worker,
         "must be >= 0 (0 picks cores / processes)")
    need(c.spares >= 0, "checkpointless.spares", c.spares, "must be >= 0")
    need(c.heartbeat_timeout_s > 0, "checkpointless.heartbeat_timeout_s", c.heartbeat_timeout_s,
         "must be > 0 seconds")
    need(o.lr > 0, "optim.lr", o.lr, "must be > 0, e.g. optim.lr=3e-4")
    need(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
    need(o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "must be >= 0")
    need(0 <= o.beta1 < 1, "optim.beta1", o.beta1, "must be in [0, 1), e.g. 0.9")
    need(0 <= o.beta2 < 1, "optim.beta2", o.beta2, "must be in [0, 1), e.g. 0.95")
    need(o.eps > 0, "optim.eps", o.eps, "must be > 0, e.g. 1e-8")
    need(o.grad_clip >= 0, "optim.grad_clip", o.grad_clip, "must be >= 0 (0 disables clipping)")
    need(c.pg_timeout_s > 0, "checkpointless.pg_timeout_s", c.pg_timeout_s, "must be > 0 seconds")
    need(c.spare_wait_s > 0, "checkpointless.spare_wait_s", c.spare_wait_s, "must be > 0 seconds")
    need(c.confirm_s >= 0, "checkpointless.confirm_s", c.confirm_s, "must be >= 0 seconds")
    need(c.consistency_every >= 0, "checkpointless.consistency_every", c.consistency_every,
         "must be >= 0 steps (0 checks only at the end)")
    need(c.max_replacement_failures >= 1, "checkpointless.max_replacement_failures",
         c.max_replacement_failures, "must be >= 1")
    need(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "must be in [0, 1]")
    need(cfg.data.seq_len >= 8, "data.seq_len", cfg.data.seq_len, "must be >= 8")
    need(cfg.data.num_proc >= 0, "data.num_proc", cfg.data.num_proc,
         "must be >= 0 processes (0: all of this node's cores, e.g. data.num_proc=0)")
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
    nodes = d.num_nodes
    need(nodes >= 1, "distributed.num_nodes", nodes, "must be >= 1")
    need(c.spare_nodes >= 0, "checkpointless.spare_nodes", c.spare_nodes, "must be >= 0")
    need(c.node_timeout_s > 0, "checkpointless.node_timeout_s", c.node_timeout_s,
         "must be > 0 seconds")
    per = d.nproc_per_node or (d.num_processes // nodes)
    need(per * nodes == d.num_processes, "distributed.num_processes", d.num_processes,
         f"must equal distributed.num_nodes x distributed.nproc_per_node = {nodes} x {per} = "
         f"{nodes * per}; set one consistent pair (or leave num_processes to follow)")
    need(0 <= d.node_rank < nodes + c.spare_nodes, "distributed.node_rank", d.node_rank,
         f"must be in 0..{nodes + c.spare_nodes - 1} (0..{nodes - 1} active, then spare nodes)")
    if nodes > 1 or c.spare_nodes > 0 or d.standalone_coordinator:
        need(d.master_port > 0, "distributed.master_port", d.master_port,
             "several nodes need a fixed port for the coordinator, e.g. distributed.master_port="
             "29400, the same on every node")
        need(c.node_timeout_s < c.confirm_s, "checkpointless.node_timeout_s", c.node_timeout_s,
             f"must be below checkpointless.confirm_s={c.confirm_s:g}: survivors whose "
             "collectives failed with a lost node wait that long to hear of the loss")
    for i, name in enumerate(cfg.logging.trackers):
        need(name in TRACKERS, f"logging.trackers[{i}]", name,
             f"choose among accelerate's trackers: {', '.join(TRACKERS)}")
    ev, pf = cfg.eval, cfg.peft
    need(ev.every >= 0, "eval.every", ev.every, "must be >= 0 steps (0: no validation)")
    need(ev.max_batches >= 1, "eval.max_batches", ev.max_batches, "must be >= 1")
    if ev.every > 0 and not ev.files:
        need(cfg.data.source != "files", "eval.files", list(ev.files),
             "validation of a data.source=files recipe needs its own files, e.g. "
             "eval.files=[val.jsonl] (or eval.every=0)")
        need(cfg.data.source != "hub" or ev.split, "eval.split", ev.split,
             f"validation of hub data needs a split of {cfg.data.id} other than the training "
             "one, e.g. eval.split=validation, or eval.files=[...] (or eval.every=0)")
    need(not (ev.split and cfg.data.source == "hub" and ev.split == cfg.data.split),
         "eval.split", ev.split, f"is the training split (data.split={cfg.data.split}): "
         "validating on training rows says nothing; name another split")
    if pf.method == "lora":
        need(pf.r >= 1, "peft.r", pf.r, "must be >= 1 (a rank of 8 or 16 is typical)")
        need(pf.alpha > 0, "peft.alpha", pf.alpha, "must be > 0 (often 2 x peft.r)")
        need(0 <= pf.dropout < 1, "peft.dropout", pf.dropout, "must be in [0, 1)")
        need(len(pf.target_modules) > 0, "peft.target_modules", list(pf.target_modules),
             "name the modules to adapt, e.g. peft.target_modules=[q_proj,v_proj], or "
             "[all-linear]")
    need(not pf.merge or pf.method == "lora", "peft.merge", pf.merge,
         "only applies to peft.method=lora (a full fine-tune already exports the whole model)")
    for i, f in enumerate(cfg.faults):
        need(f.kind in KINDS, f"faults[{i}].kind", f.kind,
             f"choose one of {', '.join(KINDS)}")
        need(0 <= f.rank < d.num_processes, f"faults[{i}].rank", f.rank,
             f"must be a rank in 0..{d.num_processes - 1}")
        need(0 <= f.step < t.max_steps, f"faults[{i}].step", f.step,
             f"must be a step in 0..{t.max_steps - 1}")
        need(f.phase in PHASES, f"faults[{i}].phase", f.phase,
             f"choose one of {', '.join(PHASES)}")
        need(f.phase not in PHASES or f.kind not in KINDS or f.kind in kinds_at(f.phase),
             f"faults[{i}].kind", f.kind, f"cannot strike @{f.phase}; use one of "
             f"{', '.join(kinds_at(f.phase))}")
        need(f.seed == 0 or f.phase == "random", f"faults[{i}].seed", f.seed,
             "only phase=random takes a seed (kill:2:5@random:7); delete it")
    rep = c.replication
    need(rep.factor >= 1, "checkpointless.replication.factor", rep.factor,
         "must be >= 1 (1: no peer copies; 2: one copy in a peer's memory)")
    need(rep.factor <= max(1, d.num_processes), "checkpointless.replication.factor", rep.factor,
         f"cannot exceed distributed.num_processes={d.num_processes} (each copy is held by "
         f"another worker). Fix: set checkpointless.replication.factor={max(1, d.num_processes)}"
         f"{' (no peer copies)' if d.num_processes <= 1 else ''} or use more processes "
         f"(distributed.num_processes={rep.factor})")
    need(rep.interval >= 1, "checkpointless.replication.interval", rep.interval, "must be >= 1")
    need(cfg.checkpoint.interval >= 0, "checkpoint.interval", cfg.checkpoint.interval,
         "must be >= 0 (0 disables durable checkpoints)")
    need(cfg.checkpoint.keep >= 1, "checkpoint.keep", cfg.checkpoint.keep, "must be >= 1")
    # faults with checkpointless.enabled=false are allowed: they rehearse what a failure costs
    # without recovery (the run stops; durable checkpoints are what is left)
    _check_dir("run.output_dir", cfg.run.output_dir, f"runs/{cfg.run.name}")
    _check_dir("data.cache_dir", cfg.data.cache_dir, ".cache/data")
    if cfg.checkpoint.interval > 0:
        _check_dir("checkpoint.dir", cfg.checkpoint.dir, f"runs/{cfg.run.name}/checkpoints")


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg)
