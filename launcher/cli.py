"""The command line.

    python -m launcher ls                              the shipped recipes
    python -m launcher show RECIPE [key=value ...]     the fully resolved recipe, as YAML
    python -m launcher validate [RECIPE [key=value ...]]  check a recipe with overrides, or
                                                       every shipped one when none is given
                                                       (its keys, and startup_timeout_s against
                                                       the model's start-up here)
    python -m launcher plan RECIPE [key=value ...]     memory per rank before launch (no weights)
                                                       and a worker's start-up time
    python -m launcher prepare RECIPE [key=value ...]  tokenize the recipe's data into its cache
    python -m launcher train RECIPE [key=value ...]    train (workers + spares, supervised)
    python -m launcher coordinator RECIPE [...]        a stand-alone coordinator for many nodes
    python -m launcher smoke [RECIPE ...] [key=value ...]  each recipe in its own shape, shrunk
                                                       to this CPU, 3 steps and a kill, from a
                                                       saved tiny checkpoint (launcher/run/smoke.py)
    python -m launcher bench [key=value ...]           goodput benchmark (see launcher/bench/)

RECIPE is a name in recipes/ or a path to a YAML file. Overrides use OmegaConf dotlist syntax
(`trainer.max_steps=7`, `'faults=[kill:2:5]'`); `~key` deletes a key.
"""
from __future__ import annotations

import sys

from launcher.recipe.load import RecipeError, load, recipe_names, resolve, to_yaml
from launcher.run.exits import PREEMPTED

USAGE = __doc__


def cmd_ls(_args) -> int:
    rows = [("recipe", "model", "size", "strategy", "workers+spares", "description")]
    for name in recipe_names():
        c = load(name)
        rows.append((name, c.model.id or c.model.name, c.model.size, c.distributed.strategy,
                     f"{c.distributed.num_processes}+{c.checkpointless.spares}", c.description))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)) + "  " + r[-1])
    return 0


def cmd_show(args) -> int:
    if not args:
        raise RecipeError("show needs a recipe: python -m launcher show RECIPE [key=value ...]")
    cfg, notes = resolve(args[0], args[1:])
    # YAML comments: what was derived stays said, and the output still loads as a recipe
    print("".join(f"# {n}\n" for n in notes) + to_yaml(cfg), end="")
    return 0


def cmd_validate(args) -> int:
    if args and args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    # like show and plan: one recipe and its overrides (key=value, ~key); without any, all
    overrides = [a for a in args[1:] if "=" in a or a.startswith("~")]
    names = ([args[0]] + [a for a in args[1:] if a not in overrides]) if args \
        else recipe_names()
    bad = 0
    for name in names:
        try:
            cfg, notes = resolve(name, overrides)
            _startup(cfg)
            print(f"ok      {name}" + "".join(f"\n        {n}" for n in notes))
        except RecipeError as exc:
            bad += 1
            print(f"INVALID {name}: {exc}")
    return 1 if bad else 0


def _startup(cfg) -> None:
    """The one check of the pre-flight that validate makes too, as it judges a key's value
    (startup_timeout_s) rather than the machine's contents: it measures the model on the meta
    device, so it imports torch and transformers (late: ls and show stay fast)."""
    from models.hub import offline_unless_reachable
    from launcher.plan.startup import startup_problem
    offline_unless_reachable(cfg)  # an unreachable hub: the built-in configs, no retries
    problem = startup_problem(cfg)
    if problem:
        raise RecipeError(problem)


def cmd_plan(args) -> int:
    from launcher.plan import main as plan_main  # imported late: it imports torch and transformers
    return plan_main(args)


def cmd_train(args) -> int:
    if not args:
        raise RecipeError("train needs a recipe: python -m launcher train RECIPE [key=value ...]")
    from launcher.recipe.cluster_env import from_environment
    extra, said = from_environment(args[1:])
    cfg, notes = resolve(args[0], extra + args[1:])  # the command line's own overrides win
    if extra:
        print("[launcher] this node's place in the job:\n  " + "\n  ".join(said), flush=True)
    for note in notes:
        print(f"[launcher] {note}", flush=True)
    from launcher.run.launch import train  # imported late: ls/show stay fast
    report = train(cfg)
    if report is not None and report.get("status") == "preempted":
        return PREEMPTED
    return 0 if report is not None else 1


def cmd_smoke(args) -> int:
    from launcher.run.smoke import main as smoke_main  # imported late: torch and transformers
    return smoke_main(args)


def cmd_prepare(args) -> int:
    """Build a recipe's data caches here, as `train` does before its workers start. Run ahead of
    a multi-node job (on each node, or once where all share data.cache_dir), so that no node's
    launcher is still tokenizing while the others wait for it to join."""
    if not args:
        raise RecipeError("prepare needs a recipe: python -m launcher prepare RECIPE "
                          "[key=value ...]")
    cfg = load(args[0], args[1:])
    from launcher.data.prepare import prepare_node
    from launcher.run.preflight import preflight_data
    preflight_data(cfg)  # the tokenizer and the dataset, each problem in one sentence
    prepare_node(cfg)
    return 0


def cmd_coordinator(args) -> int:
    """A stand-alone coordinator (on a login node): the store and the membership, no workers;
    every node's launcher, node 0's included, serves it as an agent."""
    if not args:
        raise RecipeError("coordinator needs a recipe: python -m launcher coordinator RECIPE "
                          "distributed.num_nodes=N distributed.master_port=PORT [key=value ...]")
    cfg = load(args[0], args[1:] + ["distributed.standalone_coordinator=true"])
    from launcher.run.launch import train
    report = train(cfg, coordinator=True)
    if report is not None and report.get("status") == "preempted":
        return PREEMPTED
    return 0 if report is not None else 1


def cmd_bench(args) -> int:
    from launcher.bench import bench
    return bench(args)


COMMANDS = {"ls": cmd_ls, "show": cmd_show, "validate": cmd_validate, "plan": cmd_plan,
            "coordinator": cmd_coordinator, "prepare": cmd_prepare,
            "train": cmd_train, "smoke": cmd_smoke, "bench": cmd_bench}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    cmd = COMMANDS.get(argv[0])
    if cmd is None:
        print(f"unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}\n\n{USAGE}",
              file=sys.stderr)
        return 2
    try:
        return cmd(argv[1:])
    except RecipeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
