"""Goodput: the share of wall time spent on training steps that count.

    goodput = sum over committed steps of (step end - step start)
              / (end of the last step - start of the first step)

A step counts once, in its final committed attempt: the attempt cut short by a failure, the time
spent detecting it, regrouping, moving state and any step redone after a rollback all fall in the
denominator only. Start-up (imports, model build) is left out on purpose: it is the same for every
method and says nothing about fault tolerance.

This is the one place goodput is computed: the supervisor's report and the benchmark both call it.
"""
from __future__ import annotations


def goodput_from_steps(steps: dict[int, tuple[float, float]], *,
                       first_start: float | None = None) -> float | None:
    """`steps`: step -> (start, end) of its final attempt.

    `first_start`: when the earliest attempt of any step began, if earlier than every final
    attempt. That happens when the first steps themselves were redone (a restart that found no
    checkpoint): the time since then was spent, so the span must start there, not at the redo.
    """
    if not steps:
        return None
    useful = sum(t1 - t0 for t0, t1 in steps.values())
    start = min(t0 for t0, _ in steps.values())
    if first_start is not None:
        start = min(start, first_start)
    end = max(t1 for _, t1 in steps.values())
    return round(useful / (end - start), 4) if end > start else 1.0
