"""A discrete-event goodput simulator: one seeded failure trace, handled twice, by this project's
in-process recovery (with S spare nodes) and by checkpoint-restart. A simulation fed with stated
inputs (goodput_inputs.py: each with its source), not a measurement. Stdlib only;
`python -m launcher.bench.goodput_sim --help`.

Failures arrive as a Poisson process in wall time (idle spares are taken not to fail). Each is a
lost process, a lost node, or a lost rack of nodes. In-process: a process goes to its node's spare
process, a node (or rack) to ready spare nodes; the cost is detection + control plane + regroup +
state transfer, plus the elapsed part of the step in flight. A failure that finds too few spare
nodes, or that takes the coordinator's node, falls back to a restart from the newest durable
checkpoint. Checkpoint-restart: every failure does that. A restart costs the work since the last
completed save plus the restart time; a failure during a restart starts it again. Saves block for
their cost after every interval of work. The job's replacement nodes after a restart come from the
cluster's scheduler, inside the restart time, in both methods.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field

# the inputs and their sources (goodput_inputs.py), importable from here as before
from launcher.bench.goodput_inputs import (  # noqa: F401  (every input, read from here too)
    BOUNDARY_S, BYTES_PER_PARAM, CHECKPOINT_MIN, CONTROL_PLANE_S, DETECT_NODE_S, DETECT_PROCESS_S,
    FLOPS_PER_GPU, LINK_BPS, LLAMA3_PER_GPU_HOUR, NODES_PER_RACK, NODE_SHARE, RACK_SHARE,
    REFILL_H, REGROUP_POINTS, RESTART_POINTS, WRITE_BPS_PER_GPU, Inputs, by_scale,
    young_interval_s)


@dataclass(frozen=True)
class Failure:
    t: float  # seconds from the start
    nodes: int  # 0: one process; k: k whole nodes
    coordinator: bool  # the coordinator's node is among them


def trace(inp: Inputs, rng: random.Random) -> list[Failure]:
    """Seeded failures over inp.days: Poisson in wall time, each a process, node or rack loss."""
    rate_s = inp.failures_per_gpu_hour * inp.gpus / 3600
    end, t, out = inp.days * 86400, 0.0, []
    while True:
        t += rng.expovariate(rate_s)
        if t >= end:
            return out
        if rng.random() >= inp.node_share:
            out.append(Failure(t, 0, False))
            continue
        k = min(inp.nodes_per_rack, inp.nodes) if rng.random() < inp.rack_share else 1
        first = rng.randrange(inp.nodes) // k * k  # the hit node's rack, or the node itself
        coord = first == 0 and not inp.standalone_coordinator
        out.append(Failure(t, min(k, inp.nodes - first), coord))


@dataclass
class Outcome:
    goodput: float
    in_process: int = 0
    restarts: int = 0
    down_s: float = 0.0
    lost_work_s: float = 0.0
    saves: int = 0


@dataclass
class Job:
    """Progress of one method along the trace: work, saves every `interval` s of work (save_s
    each), the newest durable progress, and whether it is down (recovering or restarting)."""
    interval: float
    save_s: float
    step_s: float
    work: float = 0.0
    phase: float = 0.0  # work done in the step in flight
    durable: float = 0.0
    cyc: float = 0.0  # position in the current work + save cycle
    down_until: float = 0.0
    restarting: bool = False
    out: Outcome = field(default_factory=lambda: Outcome(0.0))

    def run(self, dt: float):
        """dt seconds of running: work, and the saves that fall in it."""
        if dt <= 0:
            return
        before = self.work
        self.saves_in(dt)
        if self.step_s > 0:
            self.phase = (self.phase + self.work - before) % self.step_s

    def saves_in(self, dt: float):
        """Work and completed saves over dt seconds of the work + save cycle."""
        if math.isinf(self.interval):
            self.work += dt
            return
        cycle = self.interval + self.save_s
        full, rem = divmod(self.cyc + dt, cycle)
        if full:
            self.durable = self.work + (self.interval - min(self.cyc, self.interval)) \
                + (full - 1) * self.interval
            self.out.saves += int(full)
        before = min(self.cyc, self.interval)
        self.work += full * self.interval + min(rem, self.interval) - before
        self.cyc = rem

    def advance(self, t0: float, t1: float):
        """From wall time t0 to t1: down until down_until, then running."""
        start = max(t0, self.down_until)
        self.out.down_s += max(0.0, min(t1, self.down_until) - t0)
        self.run(t1 - start)

    def restart(self, t: float, restart_s: float):
        """Back to the newest durable progress; down for restart_s from t."""
        if not self.restarting or t >= self.down_until:
            self.out.restarts += 1
        self.out.lost_work_s += self.work - self.durable
        self.work, self.cyc, self.phase = self.durable, 0.0, 0.0
        self.down_until, self.restarting = max(self.down_until, t + restart_s), True

    def recover(self, t: float, cost_s: float):
        """In place: the step in flight is lost (or the save in flight starts again)."""
        if self.cyc > self.interval:
            self.cyc = self.interval
        else:
            lost = self.phase if math.isinf(self.interval) else min(self.phase, self.cyc)
            self.work -= lost
            self.cyc = max(0.0, self.cyc - lost)
            self.out.lost_work_s += lost
        self.phase = 0.0
        self.out.in_process += 1
        if t >= self.down_until:
            self.restarting = False
        self.down_until = max(self.down_until, t + cost_s)


def simulate(inp: Inputs, failures: list[Failure], spares: int | None) -> Outcome:
    """One method along one trace: spares=None is checkpoint-restart, else in-process with that
    many spare nodes. Goodput = work / wall time, less the steady overhead for in-process."""
    end = inp.days * 86400
    restart_s = inp.restart_min * 60
    if spares is None:
        job = Job(inp.restart_interval_s, inp.save_s, inp.step_s)
    else:
        job = Job(inp.checkpoint_min * 60, inp.save_s, inp.step_s)
    phases = inp.control_plane_s + inp.regroup_s + inp.transfer_s
    ready, refills, t = spares or 0, deque(), 0.0
    for f in failures:
        job.advance(t, f.t)
        t = f.t
        while refills and refills[0] <= t:
            refills.popleft()
            ready += 1
        if spares is None or (job.restarting and t < job.down_until):
            job.restart(t, restart_s)
        elif f.nodes == 0:
            job.recover(t, inp.detect_process_s + phases)
        elif f.coordinator or f.nodes > ready:
            job.restart(t, restart_s)
        else:
            ready -= f.nodes
            refills.extend([t + inp.refill_h * 3600] * f.nodes)
            job.recover(t, inp.detect_node_s + phases)
    job.advance(t, end)
    g = job.work / end
    if spares is not None:
        g /= 1 + max(0.0, inp.overhead)  # a measured speed-up is not credited
    job.out.goodput = g
    return job.out


def sweep(inp: Inputs, spare_counts: list[int], runs: int, seed: int) -> dict:
    """Every spare count and checkpoint-restart on the same `runs` seeded traces; means and
    standard errors of the mean (None with one run)."""
    inp = inp.resolved()
    res = {s: [] for s in spare_counts}
    base, events = [], []
    for r in range(runs):
        failures = trace(inp, random.Random(seed + r))
        events.append(len(failures))
        base.append(simulate(inp, failures, None))
        for s in spare_counts:
            res[s].append(simulate(inp, failures, s))
    hours = inp.days * 24
    rows = []
    for s in spare_counts:
        g = [o.goodput for o in res[s]]
        paid = inp.gpus / (inp.gpus + s * inp.gpus_per_node)
        rows.append({"spare_nodes": s, "goodput": mean(g), "goodput_se": se(g),
                     "goodput_per_paid": mean(g) * paid,
                     "restarts_per_day": mean([o.restarts for o in res[s]]) / inp.days,
                     "in_process_per_day": mean([o.in_process for o in res[s]]) / inp.days})
    best = max(rows, key=lambda r: r["goodput_per_paid"])
    bg = [o.goodput for o in base]
    return {"inputs": asdict(inp), "gpus": inp.gpus, "hours": hours, "runs": runs, "seed": seed,
            "failures_per_day": mean(events) / inp.days,
            "checkpoint_restart": {"goodput": mean(bg), "goodput_se": se(bg),
                                   "restarts_per_day": mean([o.restarts for o in base]) / inp.days,
                                   "interval_min": inp.restart_interval_s / 60},
            "in_process": rows, "best_spare_nodes": best["spare_nodes"]}


def mean(xs):
    return statistics.fmean(xs)


def se(xs):
    return statistics.stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else None


def auto_spares(inp: Inputs) -> list[int]:
    """0 up to well past the spare nodes in repair at once on average (node rate x refill)."""
    inp = inp.resolved()
    node_events_h = inp.failures_per_gpu_hour * inp.gpus * inp.node_share
    m = node_events_h * inp.refill_h * (1 + inp.rack_share * (inp.nodes_per_rack - 1))
    return list(range(0, math.ceil(m + 4 * math.sqrt(m)) + 3))


def report(res: dict) -> str:
    """The side-by-side line and the sweep table."""
    i, cr = res["inputs"], res["checkpoint_restart"]
    pm = lambda x: "" if x is None else f" +-{x:.2%}"
    lines = [
        f"GOODPUT SIMULATION (not a measurement): {res['gpus']:,} GPUs ({i['nodes']} nodes x "
        f"{i['gpus_per_node']}), {i['days']:g} days x {res['runs']} runs from seed {res['seed']}, "
        f"{res['failures_per_day']:.2f} failures/day",
        f"step {i['step_s']:.2f} s; in-process phases: detect {i['detect_process_s']} s "
        f"(process) / {i['detect_node_s']} s (node), control plane {i['control_plane_s']} s, "
        f"regroup {i['regroup_s']:.2f} s, transfer {i['transfer_s']:.3f} s; save "
        f"{i['save_s']:.2f} s; restart {i['restart_min']:.1f} min; refill {i['refill_h']:g} h; "
        f"in-process checkpoint every {i['checkpoint_min']:g} min, overhead {i['overhead']:.2%}",
        f"checkpoint-restart (Young's interval {cr['interval_min']:.1f} min): goodput "
        f"{cr['goodput']:.2%}{pm(cr['goodput_se'])}",
        "", "spare_nodes  goodput_in_process  restarts/day  per_GPU_hour_paid",
        "-----------  ------------------  ------------  -----------------"]
    for r in res["in_process"]:
        mark = "  <- best" if r["spare_nodes"] == res["best_spare_nodes"] else ""
        lines.append(f"{r['spare_nodes']:>11}  {r['goodput']:>10.2%}{pm(r['goodput_se']):>8}  "
                     f"{r['restarts_per_day']:>12.3f}  {r['goodput_per_paid']:>17.2%}{mark}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description="Seeded goodput simulation: in-process recovery "
                                "with S spare nodes against checkpoint-restart (docs/scale.md).")
    d = Inputs()
    for name, default in asdict(d).items():
        if name == "refill_h":
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true")
        else:
            kind = int if isinstance(default, int) else float
            p.add_argument(flag, type=kind, default=default)
    p.add_argument("--refill-hours", type=float, dest="refill_h", default=d.refill_h)
    p.add_argument("--spare-nodes", type=int, help="one spare count instead of the sweep")
    p.add_argument("--sweep", help="comma-separated spare counts (default: 0 to past the need)")
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the figures to this file")
    a = vars(p.parse_args(argv))
    inp = Inputs(**{k: a[k] for k in asdict(d)})
    if a["spare_nodes"] is not None:
        counts = [a["spare_nodes"]]
    elif a["sweep"]:
        counts = [int(x) for x in a["sweep"].split(",")]
    else:
        counts = auto_spares(inp)
    res = sweep(inp, counts, a["runs"], a["seed"])
    print(report(res))
    if a["json"]:
        with open(a["json"], "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
