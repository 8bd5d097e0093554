"""Recipe loading: YAML files merged onto the schema, with command-line overrides.

    load("tiny-llama", ["trainer.max_steps=7", "~model.config.num_hidden_layers"])

A recipe names a base with `extends:` (merged first, so shared defaults live in one file): NAME.yaml
beside the recipe, else a shipped one in recipes/. Overrides are OmegaConf dotlist entries; `~key`
deletes the key so it falls back to the base or the schema. A recipe must choose its model
(model.name, model.id or model.config, itself or through `extends`); an empty file is refused.
Every problem raises RecipeError with the key, the value and the fix, before any worker starts:
the shape of the YAML in launcher/recipe/shape.py, its values in launcher/recipe/validate.py.
"""
from __future__ import annotations

import difflib
import io
import os
from pathlib import Path

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from checkpointless.protocol import split_fault

from launcher.recipe.derive import derive
from launcher.recipe.rules import get
from launcher.recipe.schema import Recipe, RecipeError, leaves
from launcher.recipe.shape import check_shape, schema_keys, suggest
from launcher.recipe.validate import validate

# RecipeError and validate live below this module (no cycle) and are imported from here too
__all__ = ["RECIPES_DIR", "RecipeError", "load", "recipe_names", "recipe_path", "resolve",
           "to_yaml", "validate"]

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


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
    check_shape(raw, Recipe, "", f"recipe {path}")
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


def _delete(cfg: DictConfig, dotted: str) -> None:
    parts = dotted.split(".")
    node = cfg
    for p in parts[:-1]:
        if not isinstance(node, DictConfig) or p not in node:
            return
        node = node[p]
    if isinstance(node, DictConfig) and parts[-1] in node:
        del node[parts[-1]]
    elif dotted not in schema_keys() and not dotted.startswith("model.config."):
        raise RecipeError(f"cannot delete '~{dotted}': no such key.{suggest(dotted)}")


def _normalize_faults(cfg: DictConfig) -> None:
    """Accept 'kill:2:5' as shorthand for {kind: kill, rank: 2, step: 5}, 'kill:2:5@backward'
    for the same at another phase, and 'kill:2:5@random:7' for a seeded random moment (the
    grammar is checkpointless.protocol.faults.split_fault's)."""
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
    return resolve(name_or_path, overrides)[0]


def resolve(name_or_path: str, overrides: list[str] = ()) -> tuple[DictConfig, list[str]]:
    """(the resolved recipe, as `load` gives it; one line for each value it derived from others
    because the user left it unset, launcher/recipe/derive.py), for the commands that say so."""
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
        check_shape(OmegaConf.to_container(one, resolve=False), Recipe, "", f"override {o!r}")
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
    for fault in merged.faults:  # read-only, as Fault is frozen; an interpolation in it resolves
        OmegaConf.set_readonly(fault, False)
    try:
        OmegaConf.resolve(merged)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        where = f" in '{key}'" if key else ""
        raise RecipeError(f"recipe interpolation failed{where}: {str(exc).splitlines()[0]}. A "
                          "${...} reference must name another key, e.g. ${run.name}, and must "
                          "not refer to itself") from None
    _choice_words(merged)
    notes = derive(merged, cfg, overrides)  # cfg: what the files and overrides wrote
    validate(merged)
    return merged, notes


def _choice_words(cfg: DictConfig) -> None:
    """YAML reads a bare off / on (no / yes) as a boolean, which a string key then holds as
    'False' / 'True': where the key's choices include the word, it is the word that was meant
    (checkpointless.shrink=off, checkpointless.straggler.action=off)."""
    for key, f in leaves():
        allowed = f.metadata.get("choices") or ()
        word = {"False": "off", "True": "on"}.get(str(get(cfg, key)))
        if word in allowed:
            OmegaConf.update(cfg, key, word)


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


def _explain(exc: OmegaConfBaseException, overrides) -> RecipeError:
    key = getattr(exc, "full_key", None) or getattr(exc, "key", None) or "?"
    origin = next((o for o in overrides if o.split("=", 1)[0].lstrip("~") == key), None)
    where = f" (from override '{origin}')" if origin else ""
    name = type(exc).__name__
    if "ConfigKeyError" in name or "not in struct" in str(exc) or "Key '" in str(exc):
        return RecipeError(f"unknown recipe key '{key}'{where}.{suggest(str(key))} "
                           "Run `python -m launcher show RECIPE` to see every key.")
    value = getattr(exc, "value", None)
    msg = str(exc).splitlines()[0]
    return RecipeError(f"recipe key '{key}' got {value!r}{where}: {msg}. Fix the value to the "
                       "type the schema expects (see launcher/recipe/schema.py).")


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg)
