"""The steady-state overhead, from off and on run at the same time and taking turns.

Each job runs alone for `turn_s` while the other's processes are stopped (SIGSTOP). Both see the
same machine, minute by minute, so its drifting speed (+-10% over tens of seconds on a small
shared box) does not land on one side only, as it does for runs one after the other.
"""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import threading
import time

from .baseline import torchrun_cmd, tree_pids
from .modes import mode_recipe
from .records import read_records, run_digest, steps_in_turns


class Turns(threading.Thread):
    """Two jobs take turns on the machine until one of them ends. `windows` records
    (job, start, end) of every turn; a step counts for its job only if it ran entirely inside
    one of its turns."""

    def __init__(self, jobs, turn_s: float):
        super().__init__(daemon=True)
        self.jobs, self.turn_s = jobs, turn_s  # [(run_dir, pids(), finished()), ...]
        self.windows: list[tuple[int, float, float]] = []
        self.stop = threading.Event()

    @staticmethod
    def _signal(pids, sig) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def run(self):
        try:  # both start together; the first to log a step waits (stopped) for the other
            while True:
                started = [bool(read_records(d)) for d, _, _ in self.jobs]
                if all(started):
                    break
                for (_, pids, _), go in zip(self.jobs, started):
                    if go:
                        self._signal(pids(), signal.SIGSTOP)
                if self.stop.wait(0.2) or any(done() for _, _, done in self.jobs):
                    return
            turn = 0
            while not self.stop.is_set() and not any(done() for _, _, done in self.jobs):
                me, other = turn % 2, 1 - turn % 2
                self._signal(self.jobs[other][1](), signal.SIGSTOP)
                self._signal(self.jobs[me][1](), signal.SIGCONT)
                t0 = time.time()
                self.stop.wait(self.turn_s)
                self.windows.append((me, t0, time.time()))
                turn += 1
        finally:  # never leave a job stopped
            for _, pids, _ in self.jobs:
                self._signal(pids(), signal.SIGCONT)


def run_paired(cfg, overrides: list[str]) -> dict:
    """off (torchrun) and on (supervisor + spare) at the same time, taking turns on the machine;
    returns the median step time of each over the steps that ran inside its own turns."""
    from ..launch import train  # imported late: it pulls in torch
    steps = cfg.paired_steps
    _, out_off = mode_recipe(cfg, overrides, "off", name="paired-off", steps=steps)
    # a stopped turn is a silence of turn_s: the hang detector must not take it for a hang
    rc_on, out_on = mode_recipe(cfg, overrides + [
        f"checkpointless.heartbeat_timeout_s={max(120.0, 10 * cfg.turn_s)}"], "on",
        name="paired-on", steps=steps)
    cmd = torchrun_cmd(cfg, out_off, 0)
    turns = None
    with open(out_off / "torchrun.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

        def on_start(sup):
            nonlocal turns
            turns = Turns([(out_off, lambda: tree_pids(proc.pid), lambda: proc.poll() is not None),
                           (out_on, lambda: [w.proc.pid for w in list(sup.workers.values())],
                            lambda: len(read_records(out_on)) >= steps)], cfg.turn_s)
            turns.start()

        try:
            train(rc_on, on_start=on_start)
        finally:
            if turns:
                turns.stop.set()
                turns.join()
            proc.wait(timeout=cfg.mode_timeout_s)
    off = steps_in_turns(read_records(out_off), turns.windows, 0)
    on = steps_in_turns(read_records(out_on), turns.windows, 1)
    if len(off) < 5 or len(on) < 5:
        return {}
    return {"turns": len(turns.windows), "turn_s": cfg.turn_s, "steps_counted_off": len(off),
            "steps_counted_on": len(on), "step_s_median_off": round(statistics.median(off), 5),
            "step_s_median_on": round(statistics.median(on), 5),
            "same_bits": run_digest(out_off) == run_digest(out_on) is not None}
