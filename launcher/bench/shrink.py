"""The shrink modes of the benchmark (checkpointless.shrink; docs/shrink.md).

shrink-exact, shrink-fast, shrink-off: the recipe with no spare at the start and refills on, so
a killed rank finds none ready. exact and fast shrink at once onto the survivors and grow back
when the refill is warm; off waits for the refill (today's behaviour). Each meets the same
failure schedule as checkpointless and restart, so their goodputs read side by side. The price
of exact on a failure-free step (every reduction in logical order) is taken beside the same
recipe's ddp step, taking turns on the machine.
"""
from __future__ import annotations

MODES = ("shrink-exact", "shrink-fast", "shrink-off")


def overrides(mode: str) -> list[str]:
    """The recipe overrides of a shrink mode."""
    return ["checkpointless.spares=0", "checkpointless.refill=true",
            f"checkpointless.shrink={mode[len('shrink-'):]}"]


def shrink_line(s: dict, paired: dict | None) -> str:
    """exact's failure-free step against ddp's (side by side), and each mode's goodput under the
    failure schedule beside restart's."""
    p = paired or {}
    a, b = p.get("step_s_median_shrink-exact"), p.get("step_s_median_ddp")
    cost = (f"exact's failure-free step {a * 1000:.1f} ms vs ddp {b * 1000:.1f} ms "
            f"({a / b - 1:+.1%}, side by side)" if a and b else
            "no side-by-side step time (bench.paired_steps=0)")
    if a and b:
        s["shrink-exact"]["step_vs_ddp"] = round(a / b - 1, 4)
    good = []
    for m in (*MODES, "restart"):
        if m in s:
            g = s[m].get("goodput")
            good.append(f"{m} {'-' if g is None else format(g, '.1%')}")
    return f"shrink: {cost}; goodput under the failure schedule: {', '.join(good)}"
