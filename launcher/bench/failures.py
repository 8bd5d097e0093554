"""Failures from outside the workers: a seeded schedule and a thread that carries it out.

The same schedule serves every mode, so checkpointless and restart meet the same failures at the
same offsets after their first step. Kills are SIGKILLs at wall-clock times, so they land at a
random point inside a step, as real failures do.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

from launcher.bench.records import read_records


def schedule(cfg, horizon_s: float) -> list[tuple[float, float]]:
    """(offset after the first step, rank draw in [0,1)) pairs, the same for every mode.

    Gaps are drawn uniformly in [0.5, 1.5] x MTBF: the mean is the MTBF, as with exponential
    gaps, but a short benchmark cannot draw zero failures (or five) by luck of the seed."""
    rng = random.Random(cfg.seed)
    out, t = [], 0.0
    while True:
        t += cfg.mtbf_s * rng.uniform(0.5, 1.5)
        if t > horizon_s:
            return out
        out.append((t, rng.random()))


class Killer(threading.Thread):
    """SIGKILLs the worker of a drawn rank at each scheduled time, until training ends.

    `targets()` gives rank -> pid of the workers training now; it is asked at each kill, since
    a restart or a recovery changes the processes behind the ranks."""

    def __init__(self, run_dir: Path, targets, plan, max_steps: int):
        super().__init__(daemon=True)
        self.run_dir, self.targets, self.plan, self.max_steps = run_dir, targets, plan, max_steps
        self.kills: list[dict] = []
        self.stop = threading.Event()

    def inside_training(self, plan, t0: float) -> list[tuple[float, float]]:
        """The plan's failures that fall inside the training, judged from the first steps' time:
        a kill within 3 steps of the end would hit the export, not training, and a schedule
        whose first failure lies past the end would measure nothing. With none inside, the first
        is moved to the middle of the run, and that is said. The steps are waited for no longer
        than the first failure's time: a plan that starts early is kept as it is."""
        recs = read_records(self.run_dir)
        while len(recs) < 4 and plan and time.time() < t0 + plan[0][0] and \
                not self.stop.wait(0.05):
            recs = read_records(self.run_dir)
        if len(recs) < 4:
            return plan
        times = sorted(r["t_end"] - r["t_start"] for r in recs[1:4])  # the first is warm-up
        span = (self.max_steps - 4) * times[1]
        inside = [(o, d) for o, d in plan if o < span]
        if plan and not inside:
            inside = [(span / 2, plan[0][1])]
            print(f"[bench] the schedule's first failure (+{plan[0][0]:.1f} s) falls after this "
                  f"run's training (about {span:.1f} s of steps): placed at +{span / 2:.1f} s",
                  flush=True)
        return inside

    def run(self):
        t0 = None  # offsets count from the first step, not from start-up
        while t0 is None and not self.stop.wait(0.05):
            recs = read_records(self.run_dir)
            t0 = recs[0]["t_start"] if recs else None
        for offset, draw in self.inside_training(self.plan, t0):
            while time.time() < t0 + offset:
                if self.stop.wait(min(0.05, t0 + offset - time.time())):
                    return
            recs = read_records(self.run_dir)
            if recs and max(r["step"] for r in recs) >= self.max_steps - 3:
                return  # the end is near: a kill now would hit the export, not training
            targets = self.targets()
            if len(targets) < 1:
                continue
            ranks = sorted(targets)
            rank = ranks[int(draw * len(ranks))]
            try:
                os.kill(targets[rank], signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append({"t": time.time(), "offset_s": round(offset, 3), "rank": rank})
            print(f"[bench] killed rank {rank} (pid {targets[rank]}) at +{offset:.1f} s",
                  flush=True)
