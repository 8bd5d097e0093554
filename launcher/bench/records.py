"""Figures from step records: every mode's numbers come from its metrics.jsonl, the same way.

A record is one committed attempt of a step (`step`, `t_start`, `t_end`, wall-clock seconds). A
step appears more than once when it was redone: after a restart from an older checkpoint, or a
rollback. The last attempt (by `t_end`) is the one that counts.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Optional

from checkpointless.control.report import goodput_from_steps


def read_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:  # a worker killed mid-write can leave a torn line: skip it
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "step" in rec:  # validation lines are not steps
                out.append(rec)
    return out


def final_attempts(records: list[dict]) -> dict[int, dict]:
    """step -> its last attempt."""
    final = {}
    for r in sorted(records, key=lambda r: r["t_end"]):
        final[r["step"]] = r
    return final


def goodput(records: list[dict]) -> Optional[float]:
    """The library's goodput of these records. The span starts at the earliest attempt even when
    that attempt was redone later (a restart that found no checkpoint): that time was spent."""
    if not records:
        return None
    final = final_attempts(records)
    return goodput_from_steps({s: (r["t_start"], r["t_end"]) for s, r in final.items()},
                              first_start=min(r["t_start"] for r in records))


def recovery_times(records: list[dict], kills: list[dict]) -> list[float]:
    """For each kill: seconds from it to the end of the first step started after it."""
    out = []
    for k in kills:
        after = [r for r in records if r["t_start"] >= k["t"]]
        if after:
            out.append(min(r["t_end"] for r in after) - k["t"])
    return out


def summarize(records: list[dict], kills: list[dict]) -> dict:
    if not records:
        return {"wall_s": None, "steps": 0, "goodput": None}
    final = final_attempts(records)
    t0 = min(r["t_start"] for r in records)
    t1 = max(r["t_end"] for r in records)
    recov = recovery_times(records, kills)
    durations = [r["t_end"] - r["t_start"] for r in records]
    return {
        "wall_s": round(t1 - t0, 3), "steps": len(final),
        "goodput": goodput(records),
        "recoveries": len(kills),
        "recovery_s_median": round(statistics.median(recov), 3) if recov else None,
        "recovery_s_max": round(max(recov), 3) if recov else None,
        "recovery_s_all": [round(x, 3) for x in recov],
        "steps_redone": len(records) - len(final),
        "step_s_median": round(statistics.median(durations), 5),
        "t0": t0,
    }


def run_digest(run_dir: Path) -> Optional[str]:
    """The params_sha256 every rank reported, "DISAGREE" if they differ, None if none did."""
    files = sorted((run_dir / "results").glob("rank*.json")) if (run_dir / "results").exists() \
        else []
    digests = {json.loads(f.read_text())["params_sha256"] for f in files}
    return digests.pop() if len(digests) == 1 else (None if not digests else "DISAGREE")


def steps_in_turns(records: list[dict], windows, job: int) -> list[float]:
    """Durations of the steps that ran entirely inside one of `job`'s turns (see paired.py)."""
    spans = [(a, b) for j, a, b in windows if j == job]
    return [r["t_end"] - r["t_start"] for r in records
            if any(a <= r["t_start"] and r["t_end"] <= b for a, b in spans)]
