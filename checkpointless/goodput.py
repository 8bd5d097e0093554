"""Goodput: the share of wall time spent on training steps that count.

    goodput = sum over committed steps of (step end - step start)
              / (end of the last step - start of the first step)

A step counts once, in its final committed attempt: the attempt cut short by a failure, the time
spent detecting it, regrouping, moving state and any step redone after a rollback all fall in the
denominator only. Start-up (imports, model build) is left out on purpose: it is the same for every
method and says nothing about fault tolerance.
"""
from __future__ import annotations


def goodput_from_steps(steps: dict[int, tuple[float, float]]) -> float | None:
    if not steps:
        return None
    useful = sum(t1 - t0 for t0, t1 in steps.values())
    start = min(t0 for t0, _ in steps.values())
    end = max(t1 for _, t1 in steps.values())
    return round(useful / (end - start), 4) if end > start else 1.0
