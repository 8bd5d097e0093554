"""The steady-state overhead, from off and on (and plain, when asked) run at the same time and
taking turns.

Each job runs alone for `turn_s` while the others' processes are stopped (SIGSTOP). All see the
same machine, minute by minute, so its drifting speed (+-10% over tens of seconds on a small
shared box) does not land on one side only, as it does for runs one after the other. That is what
makes a 5% comparison (on against off, the recipe loop against torch's own DDP) readable here.
"""
from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import threading
import time

from checkpointless.control.detection import process_stopped

from launcher.bench.baseline import PLAIN_LOOP, RECIPE_LOOP, torchrun_cmd, tree_pids
from launcher.bench.modes import mode_recipe
from launcher.bench.records import read_records, run_digest, steps_in_turns


class Turns(threading.Thread):
    """Jobs take turns on the machine, in a fixed rotation, until one of them ends. `windows`
    records (job, start, end) of every turn; a step counts for its job only if it ran entirely
    inside one of its turns."""

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
        try:  # all start together; those that log a step first wait (stopped) for the rest
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
                me = turn % len(self.jobs)
                others = [pid for j, (_, pids, _) in enumerate(self.jobs) if j != me
                          for pid in pids()]
                self._signal(others, signal.SIGSTOP)  # stop the others first, and see them
                _wait_stopped(others)                 # stopped: a signal lands a little later
                self._signal(self.jobs[me][1](), signal.SIGCONT)
                t0 = time.time()
                self.stop.wait(self.turn_s)
                self.windows.append((me, t0, time.time()))
                turn += 1
        finally:  # never leave a job stopped
            for _, pids, _ in self.jobs:
                self._signal(pids(), signal.SIGCONT)


def _wait_stopped(pids, timeout_s: float = 0.2) -> None:
    """Until every live one of `pids` shows as stopped in /proc (or `timeout_s`)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and not all(
            process_stopped(pid) or not os.path.exists(f"/proc/{pid}") for pid in pids):
        time.sleep(0.001)


PAIRABLE = ("off", "flat", "plain", "on")  # the failure-free modes; on runs under the supervisor


def paired_modes(cfg) -> list[str]:
    """The modes of the paired run: the failure-free ones asked for, plus plain unless
    bench.paired_plain=false and flat (beside off) unless bench.paired_flat=false; none without
    paired_steps, or when neither off nor on was asked."""
    modes = cfg.modes.split(",")
    extra = {"plain": cfg.paired_plain, "flat": cfg.paired_flat and "off" in modes}
    pair = [m for m in PAIRABLE if m in modes or extra.get(m)]
    if not cfg.paired_steps or not {"off", "on"} & set(modes) or len(pair) < 2:
        return []
    return pair


def run_paired(cfg, overrides: list[str], modes=("off", "on")) -> dict:
    """Two to four of off (torchrun), flat (off without overlap), plain (torchrun, torch-only
    loop) and on (supervisor + spare) at the same time, taking turns on the machine; returns the median step time of each
    over the steps that ran inside its own turns (keys step_s_median_<mode>,
    steps_counted_<mode>), or {} if a mode had fewer than 5 such steps."""
    from launcher.run.launch import train  # imported late: it pulls in torch
    steps = cfg.paired_steps
    modules = {"off": RECIPE_LOOP, "flat": RECIPE_LOOP, "plain": PLAIN_LOOP}
    runs = [m for m in PAIRABLE if m in modes and m in modules]  # torchrun jobs
    names = runs + (["on"] if "on" in modes else [])  # the order of Turns' jobs
    dirs = {m: mode_recipe(cfg, overrides, m, name=f"paired-{m}", steps=steps)[1] for m in runs}
    rc_on = None
    if "on" in names:  # a stopped turn is a silence of (jobs - 1) x turn_s: not a hang
        rc_on, dirs["on"] = mode_recipe(cfg, overrides + [
            f"checkpointless.heartbeat_timeout_s={max(120.0, 10 * len(runs) * cfg.turn_s)}"],
            "on", name="paired-on", steps=steps)
    turns = None
    with contextlib.ExitStack() as stack:
        procs = {}
        for m in runs:
            log = stack.enter_context(open(dirs[m] / "torchrun.log", "w"))
            procs[m] = subprocess.Popen(torchrun_cmd(cfg, dirs[m], 0, modules[m]), stdout=log,
                                        stderr=subprocess.STDOUT)

        def start_turns(sup=None):
            nonlocal turns
            jobs = [(dirs[m], lambda p=procs[m]: tree_pids(p.pid),
                     lambda p=procs[m]: p.poll() is not None) for m in runs]
            if sup is not None:
                jobs.append((dirs["on"], lambda: [w.proc.pid for w in list(sup.workers.values())],
                             lambda: len(read_records(dirs["on"])) >= steps))
            turns = Turns(jobs, cfg.turn_s)
            turns.start()

        try:
            if rc_on is not None:
                train(rc_on, on_start=start_turns)
            else:
                start_turns()
                for p in procs.values():
                    p.wait(timeout=cfg.mode_timeout_s)
        finally:
            if turns:
                turns.stop.set()
                turns.join()
            for p in procs.values():
                p.wait(timeout=cfg.mode_timeout_s)
    if turns is None:
        return {}
    counted = {m: steps_in_turns(read_records(dirs[m]), turns.windows, i)
               for i, m in enumerate(names)}
    if any(len(v) < 5 for v in counted.values()):
        return {}
    out = {"turns": len(turns.windows), "turn_s": cfg.turn_s}
    for m in names:
        out[f"steps_counted_{m}"] = len(counted[m])
        out[f"step_s_median_{m}"] = round(statistics.median(counted[m]), 5)
    digests = {m: run_digest(dirs[m]) for m in names}
    if "off" in names and "on" in names:
        out["same_bits"] = digests["off"] == digests["on"] is not None
    if "off" in names and "plain" in names:  # equal only if torch's sums add in the same order
        out["same_bits_plain_off"] = digests["off"] == digests["plain"] is not None
    return out


def run_paired_launchers(cfg, overrides: list[str], modes=("fsdp", "fsdp-replicated")) -> dict:
    """Modes that each run under their own supervisor (fsdp, fsdp-replicated), started as
    `python -m launcher train` processes at the same time and taking turns like run_paired:
    replication's few percent are readable only this way on a drifting machine. Returns
    step_s_median_<mode> and steps_counted_<mode>, or {} when a mode had fewer than 5 steps
    inside its turns."""
    import sys
    steps = cfg.paired_steps
    # a stopped turn is a silence of (jobs - 1) x turn_s, for the supervisor too: not a hang
    quiet = f"checkpointless.heartbeat_timeout_s={max(120.0, 10 * len(modes) * cfg.turn_s)}"
    dirs = {m: mode_recipe(cfg, overrides + [quiet], m, name=f"paired-{m}", steps=steps)[1]
            for m in modes}
    turns = None
    with contextlib.ExitStack() as stack:
        procs = {}
        for m in modes:
            log = stack.enter_context(open(dirs[m] / "launcher.log", "w"))
            procs[m] = subprocess.Popen(
                [sys.executable, "-m", "launcher", "train", str(dirs[m] / "recipe.yaml")],
                stdout=log, stderr=subprocess.STDOUT)
        jobs = [(dirs[m], lambda p=procs[m]: tree_pids(p.pid), lambda p=procs[m]: p.poll()
                 is not None) for m in modes]
        turns = Turns(jobs, cfg.turn_s)
        turns.start()
        deadline = time.time() + cfg.mode_timeout_s
        try:
            for p in procs.values():
                p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:  # the steps that ran inside turns still count
            print(f"[bench] {' and '.join(modes)} still running after bench.mode_timeout_s="
                  f"{cfg.mode_timeout_s:g}: stopped", flush=True)
        finally:
            turns.stop.set()
            turns.join()
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
    counted = {m: steps_in_turns(read_records(dirs[m]), turns.windows, i)
               for i, m in enumerate(modes)}
    if any(len(v) < 5 for v in counted.values()):
        return {}
    out = {"turns": len(turns.windows), "turn_s": cfg.turn_s}
    for m in modes:
        out[f"steps_counted_{m}"] = len(counted[m])
        out[f"step_s_median_{m}"] = round(statistics.median(counted[m]), 5)
        out[f"params_sha256_{m}"] = run_digest(dirs[m])
    return out
