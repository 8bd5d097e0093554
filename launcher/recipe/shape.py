"""The shape of a recipe's YAML against the schema (launcher/recipe/schema.py): every key known,
sections as mappings, lists as lists, single values elsewhere; an unknown key gets the closest
known one suggested (or the name another tool gives it mapped to ours).

The loader (launcher/recipe/load.py) checks each file and override here before merging; the
values themselves are launcher/recipe/validate.py's."""
from __future__ import annotations

import difflib
import types
import typing
from dataclasses import fields, is_dataclass

from launcher.recipe.schema import Recipe, RecipeError


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


def check_shape(node, cls, prefix: str, origin: str) -> None:
    """Mappings where the schema has sections, lists where it has lists, single values elsewhere;
    named by key and by where they came from (a recipe file or an override)."""
    hints = typing.get_type_hints(cls)
    for key, value in node.items():
        full = f"{prefix}{key}"
        if not isinstance(key, str) or key not in hints:
            hint = suggest(full) if "[" not in full else ""
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
        check_shape(value, inner, full + ".", origin)
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
                continue  # kind:rank:step shorthand, expanded by load._normalize_faults
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


def schema_keys(cls=Recipe, prefix="") -> list[str]:
    """Every key of the schema, dotted (trainer.max_steps), each section before its keys."""
    keys = []
    for f in fields(cls):
        full = f"{prefix}{f.name}"
        keys.append(full)
        default = f.default_factory() if callable(f.default_factory) else f.default
        if is_dataclass(default):
            keys += schema_keys(type(default), full + ".")
    return keys


# Names people bring from other tools, mapped to ours.
_ALIASES = {"learning_rate": "lr", "batch_size": "micro_batch_size", "steps": "max_steps",
            "num_steps": "max_steps", "nproc": "num_processes", "world_size": "num_processes",
            "gradient_accumulation_steps": "grad_accum_steps", "max_grad_norm": "grad_clip",
            "warmup": "warmup_steps", "seed": "seed", "block_size": "seq_len"}


def suggest(key: str) -> str:
    """" Did you mean 'KEY'?" for an unknown key (the name other tools give it mapped to ours, or
    the closest schema key), or "" when none is close."""
    head, _, last = key.rpartition(".")
    if last in _ALIASES:
        alias = f"{head}.{_ALIASES[last]}" if head else _ALIASES[last]
        hits = [k for k in schema_keys() if k == alias or k.endswith("." + _ALIASES[last])]
        if hits:
            best = alias if alias in hits else hits[0]
            return f" Did you mean '{best}'?"
    near = difflib.get_close_matches(key, schema_keys(), n=1, cutoff=0.6)
    if not near:
        last = key.rsplit(".", 1)[-1]
        near = [k for k in schema_keys() if k.rsplit(".", 1)[-1] == last][:1]
    return f" Did you mean '{near[0]}'?" if near else ""
