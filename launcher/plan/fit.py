"""The plan with its fix: the overrides that make a recipe fit, the launcher's refusal of one that
does not (`check_fits`), and `python -m launcher plan`."""
from __future__ import annotations

import copy

from omegaconf import OmegaConf

from models.hub import offline_unless_reachable
from launcher.recipe.load import RecipeError, load
from launcher.plan.budget import detect_device
from launcher.plan.items import CURRENT_LOOP, HOSTED_BYTES, LoopFacts, unpipelined_plan
from launcher.plan.model import ModelFacts, model_facts
from launcher.plan.report import Plan, fmt_gb
from launcher.plan.stages import pipeline_plan, splits_evenly


def build_plan(cfg, facts: ModelFacts, loop: LoopFacts, device: str) -> Plan:
    """The plan of a resolved recipe on `device` (cuda or cpu), without looking for a fix;
    pipelined (distributed.pp_size > 1), its heaviest stage's (stages.py)."""
    if cfg.distributed.pp_size > 1:
        return pipeline_plan(cfg, facts, loop, device)
    return unpipelined_plan(cfg, facts, loop, device)


def plan(cfg, facts: ModelFacts | None = None, loop: LoopFacts = CURRENT_LOOP,
         search: bool = True, device_type: str | None = None) -> Plan:
    """The memory plan of a resolved recipe, per rank; with `search`, the overrides that fit
    when it does not (`plan.fix`)."""
    facts = facts or model_facts(cfg)
    device_type = device_type or detect_device(cfg)
    result = build_plan(cfg, facts, loop, device_type)
    if search and not result.fits:
        result.fix, result.closest = find_fix(cfg, facts, loop, device_type)
        result.fix_tried = True
    return result


def _with(cfg, changes: dict):
    out = copy.deepcopy(cfg)
    for key, value in changes.items():
        OmegaConf.update(out, key, value, merge=False)
    return out


def candidates(cfg) -> list[dict]:
    """Overrides to try, in order, each adding to the one before: distributed.strategy=fsdp
    (from ddp), model.gradient_checkpointing=true, then trainer.micro_batch_size halved down to
    1 (with trainer.grad_accum_steps doubled: the same tokens per step); last, with gradient
    accumulation, trainer.grad_accum_steps=1 (fewer tokens per step, but no gradients of earlier
    micro-batches alive through the next forward). Pipelined, distributed.pp_schedule=1f1b from
    gpipe (fewer microbatches in flight) comes after recomputation, and only the candidates
    whose rows split into whole microbatches are tried."""
    out, cur = [], {}
    d = cfg.distributed
    if d.strategy == "ddp":
        cur = {**cur, "distributed.strategy": "fsdp"}
        out.append(cur)
    if not cfg.model.gradient_checkpointing:
        cur = {**cur, "model.gradient_checkpointing": True}
        out.append(cur)
    if d.pp_size > 1 and d.pp_schedule == "gpipe":
        cur = {**cur, "distributed.pp_schedule": "1f1b"}
        out.append(cur)
    mbs, accum = cfg.trainer.micro_batch_size, cfg.trainer.grad_accum_steps
    base = dict(cur)
    while mbs > 1:
        mbs, accum = max(1, mbs // 2), accum * 2
        cur = {**base, "trainer.micro_batch_size": mbs, "trainer.grad_accum_steps": accum}
        out.append(cur)
    if cfg.trainer.grad_accum_steps > 1 or accum > 1:
        mbs = cfg.trainer.micro_batch_size
        while True:
            out.append({**base, "trainer.micro_batch_size": mbs, "trainer.grad_accum_steps": 1})
            if mbs == 1:
                break
            mbs = max(1, mbs // 2)
    unique = []
    for changes in out:  # the same settings reached twice are tried once
        if changes not in unique and splits_evenly(_with(cfg, changes)):
            unique.append(changes)
    return unique


def _format(cfg, changes: dict) -> list[str]:
    """key=value for each change that differs from the recipe."""
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in changes.items()
            if OmegaConf.select(cfg, k) != v]


def find_fix(cfg, facts, loop=CURRENT_LOOP, device_type=None):
    """(the first candidate override, see `candidates`, under which the plan fits, or None;
    (overrides, Plan) of the candidate needing the least when none fits)."""
    device_type = device_type or detect_device(cfg)
    closest = None
    for changes in candidates(cfg):
        tried = build_plan(_with(cfg, changes), facts, loop, device_type)
        if tried.fits:
            return _format(cfg, changes), None
        if closest is None or tried.need < closest[1].need:
            closest = (_format(cfg, changes), tried)
    return None, closest


def _host_refusal(result: Plan) -> RecipeError:
    return RecipeError(
        f"memory plan: the host memory of a node does not fit: its {result.ranks_per_node} "
        f"ranks hold {fmt_gb(result.host_per_node)} of peer replicas and snapshots "
        f"({fmt_gb(result.host)} each) beside their processes, and the node has "
        f"{fmt_gb(result.host_budget)} ({result.host_source}). Fix: "
        "checkpointless.replication.factor=1 (no peer copies: a lost rank's state then "
        "comes from the durable checkpoint), or more nodes for the same job, or set "
        "distributed.host_memory_gb if the nodes the job runs on have more")


def check_fits(cfg, loop: LoopFacts = CURRENT_LOOP) -> Plan:
    """The plan, for the launcher before it starts workers: cheap (meta device, no weights, no
    data); raises RecipeError with the numbers and the overrides that fit when it does not fit.
    On distributed.device=cpu the budget is this machine's memory per process."""
    result = plan(cfg, loop=loop)
    if result.fits and not result.host_fits:
        raise _host_refusal(result)
    if result.fits:
        return result
    peak = result.peak_phase
    lines = [f"memory plan: {result.verdict()}.",
             f"Per rank at the peak ({peak}): " + ", ".join(
                 f"{i.name} {fmt_gb(i.device[peak])}" for i in result.items
                 if i.device.get(peak)) + ".",
             f"Budget: {fmt_gb(result.budget)} ({result.budget_source}). "
             "See `python -m launcher plan RECIPE [key=value ...]` for the whole table"]
    if result.fix:
        lines.insert(1, "Add: " + " ".join(result.fix))
    raise RecipeError("\n    ".join(lines))


def max_hosted(result: Plan) -> int:
    """The most logical ranks one process may host after a shrink (checkpointless.shrink) that
    this plan leaves room for: each beyond the first keeps one more fp32 contribution to the
    step's end, at every phase; under fsdp the process also holds the whole model gathered
    for a shrunk step (hosted_base)."""
    per = max(1, result.trainable * HOSTED_BYTES)
    room = result.budget - result.peak - result.hosted_base
    return max(1, 1 + room // per) if room > 0 else 1


def min_shrunk_processes(cfg, loop: LoopFacts = CURRENT_LOOP) -> int:
    """Under fsdp or hsdp, the fewest processes a shrink may leave that the memory plan leaves
    room for: a shrunk generation cuts the model and optimizer state one chunk per process (or
    per shard position, where hsdp's groups still divide it), so each holds 1/P of it, and
    hosts ceil(L / P) logical ranks (`max_hosted`: the gathered model, a contribution each).
    The smallest P from 2 to L whose plan fits both ways (fewer processes only need more)."""
    d = cfg.distributed
    facts, device_type = model_facts(cfg), detect_device(cfg)
    logical, shard = d.num_processes, d.shard_size if d.strategy == "hsdp" else 0

    def fits(p: int) -> bool:
        grouped = bool(shard) and shard < p and p % shard == 0  # mesh.has_replica_groups
        changes = {"distributed.num_processes": p}
        if not grouped:
            changes.update({"distributed.strategy": "fsdp", "distributed.shard_size": 0})
        got = build_plan(_with(cfg, changes), facts, loop, device_type)
        return got.fits and max_hosted(got) >= -(-logical // p)

    lo, hi = 2, logical
    while lo < hi:  # memory per process only grows as processes are taken away
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return lo


def main(args: list[str]) -> int:
    """`python -m launcher plan RECIPE [key=value ...]`: print the plan and the start-up
    estimate; exit 1 if it does not fit or startup_timeout_s is below the estimate (2 for a
    recipe error)."""
    if not args:
        raise RecipeError("plan needs a recipe: python -m launcher plan RECIPE [key=value ...]")
    cfg = load(args[0], args[1:])
    offline_unless_reachable(cfg)  # an unreachable hub: the built-in table at once, no retries
    from launcher.plan.startup import estimate, startup_line
    facts = model_facts(cfg)
    result = plan(cfg, facts)
    result.overrides = list(args[1:])
    est = estimate(cfg, facts, result.device_type)
    print(result.report())
    # the other per-model figure the launcher checks before launch: start-up time
    print(startup_line(est, cfg.checkpointless.startup_timeout_s))
    return 0 if result.fits and est.seconds <= cfg.checkpointless.startup_timeout_s else 1
