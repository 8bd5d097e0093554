"""Values the resolved recipe takes from its other keys where the user left them unset.

Run by launcher/recipes.load after the schema's defaults are merged and interpolations resolved,
before the checks of launcher/recipe/validate.py: `show`, `plan`, `validate` and `train` all see the same
values. "Unset" is told from `given`, the recipe files and overrides merged before the schema (a
key there was written by the user, whatever its value); a value the user wrote is never changed
here, so a wrong one is still refused by validate.py, naming it.

Each function that derives something it would otherwise be asked to set by hand returns a note
(`key=value: why`) that the command line prints, so a derived value is never a silent surprise.
"""
from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf

from checkpointless.protocol import DEFAULTS as CL_DEFAULTS

from launcher.recipe.validate_shrink import refusal as shrink_refusal


def derive(cfg: DictConfig, given: DictConfig, overrides) -> list[str]:
    """Fill in `cfg`'s derived values in place; the notes of those worth saying."""
    world_from_nodes(cfg, overrides)
    sharding_defaults(cfg)
    shrink_default(cfg)
    notes = [confirm_under_etcd(cfg, given)]
    return [n for n in notes if n]


def was_set(given: DictConfig, dotted: str) -> bool:
    """Whether the recipe files or the overrides wrote `dotted` (a `~key` deletion unsets it)."""
    node = OmegaConf.to_container(given, resolve=False)  # an interpolation counts, unresolved
    for part in dotted.split("."):
        if not isinstance(node, dict) or node.get(part) is None:
            return False
        node = node[part]
    return True


def etcd_confirm_s(node_timeout_s: float, ttl_s: float) -> int:
    """The smallest whole number of seconds above node_timeout_s + etcd.ttl_s + 2, plus a second
    of margin: a survivor whose collective failed with the coordinator's node first waits for
    that node to be declared lost (node_timeout_s), for its lease to run out (ttl_s) and for the
    next coordinator to record the loss (the 2 s); short of it, the survivor would take a peer's
    loss for an error of its own. It also stays above node_timeout_s, as every multi-node run
    requires."""
    return math.ceil(node_timeout_s + ttl_s + 3)


def confirm_under_etcd(cfg: DictConfig, given: DictConfig) -> str | None:
    """Under coordinator=etcd, confirm_s's default (5 s, sized for a coordinator that never moves)
    is below what the role's move takes, and validate.py refuses it: derive it instead, unless
    the user set it (then theirs is checked as written)."""
    c = cfg.checkpointless
    if c.coordinator != "etcd" or was_set(given, "checkpointless.confirm_s"):
        return None
    c.confirm_s = float(etcd_confirm_s(c.node_timeout_s, c.etcd.ttl_s))
    return (f"checkpointless.confirm_s={c.confirm_s:g}: derived under "
            f"checkpointless.coordinator=etcd as node_timeout_s + etcd.ttl_s + 3 "
            f"({c.node_timeout_s:g} + {c.etcd.ttl_s:g} + 3, rounded up; the default "
            f"{CL_DEFAULTS.confirm_s:g} s is shorter than the coordinator's move). Set it to "
            "choose another")


def sharding_defaults(cfg: DictConfig) -> None:
    """hsdp's shard group is one node's processes unless given; peer copies default to none
    where replica groups already hold every slice twice or more, else to 2."""
    d, rep = cfg.distributed, cfg.checkpointless.replication
    stage = d.num_processes // max(1, d.pp_size)  # the workers of one pipeline stage
    if d.strategy == "hsdp" and d.shard_size == 0:
        d.shard_size = max(1, min(stage, d.num_processes // max(1, d.num_nodes)))
    if rep.factor is None:
        groups = stage // d.shard_size if d.strategy == "hsdp" and d.shard_size else 1
        rep.factor = 0 if groups >= 2 else CL_DEFAULTS.replication_factor


def shrink_default(cfg: DictConfig) -> None:
    """checkpointless.shrink=auto: exact where a shrink is built (ddp, one process per
    data-parallel rank, two or more processes; fsdp and hsdp with three or more, full training,
    not fp16), else off. exact's price on a
    failure-free step measured +2.3% against ddp's buckets (bench shrink, tiny-llama, 4 workers,
    2 cores: 290.1 vs 283.6 ms side by side), within the 3% that makes it the default. A torchrun
    run (checkpointless.enabled=false) reduces the same way, so its bits compare with a
    supervised run's; it never shrinks."""
    c = cfg.checkpointless
    if c.shrink != "auto":
        return
    # fsdp: FSDP's reduce-scatter in logical order, -1.7% beside fsdp-replicated's step; hsdp:
    # summed over the world and handed to the twins, -5.4% beside hsdp's own (bench fsdp-exact
    # and hsdp-exact, side by side). Where it is built is validate_shrink.py's to say
    c.shrink = "off" if shrink_refusal(cfg, "exact") else "exact"


def world_from_nodes(cfg: DictConfig, overrides) -> None:
    """With distributed.nproc_per_node given and num_processes not, the world is nodes x per
    node (a recipe's own num_processes is its one-node default, not a request)."""
    d = cfg.distributed
    asked = any(o.split("=", 1)[0].strip() == "distributed.num_processes" for o in overrides)
    if d.nproc_per_node > 0 and not asked:
        d.num_processes = d.num_nodes * d.nproc_per_node
