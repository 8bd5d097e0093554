"""The two helpers every validation rule is written with: a refusal that names the key, the value
and the fix, and a dotted key's value."""
from __future__ import annotations

from launcher.recipe.schema import RecipeError


def need(ok, key: str, value, fix: str) -> None:
    """Refuse the recipe unless `ok`: `key=value: fix`."""
    if not ok:
        raise RecipeError(f"{key}={value!r}: {fix}")


def get(cfg, dotted: str):
    """cfg's value at a dotted key (`distributed.tp_size`)."""
    node = cfg
    for p in dotted.split("."):
        node = node[p]
    return node
