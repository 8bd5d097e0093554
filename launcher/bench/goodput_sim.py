"""A discrete-event goodput simulator: one seeded failure trace, handled twice, by this project's
in-process recovery (with S spare nodes) and by checkpoint-restart. A simulation fed with stated
inputs, not a measurement. Stdlib only; `python -m launcher.bench.goodput_sim --help`.

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
from dataclasses import asdict, dataclass, field, replace

# Llama 3 405B pre-training: 419 unexpected interruptions in 54 days on 16,384 GPUs (Meta, "The
# Llama 3 Herd of Models", 2024, section 3.3.4, table 5). Per GPU, so it scales to any job.
LLAMA3_PER_GPU_HOUR = 419 / (54 * 24 * 16384)
# Table 5 split by what a failure takes. Whole node (265 of 419): faulty GPU 148, GPU system
# processor 17, silent data corruption 6, GPU thermal interface and sensor 6 (a GPU to take out
# of service), network switch/cable 35, host maintenance 32, NIC 7, SSD 3, power supply 3, server
# chassis 2, IO expansion board 2, CPU 2, system memory 2. One process (154): software bug 54,
# dependency 2, NCCL watchdog timeouts 7, GPU HBM3 memory 72, GPU SRAM memory 19 (a memory error
# kills the process; the driver retires the bad row and the GPU serves again after a GPU reset:
# our judgement, the table does not say how each was fixed).
NODE_SHARE = 265 / 419
# Rack-wide share of node failures: an assumption. Table 5 does not say how many of its 35 switch
# and cable interruptions took more than one node; all 35 would be 35/265 = 13%. We take 5%.
RACK_SHARE = 0.05
NODES_PER_RACK = 2  # Llama 3 section 3.3.1: each rack hosts 16 GPUs in two servers, one ToR switch
REFILL_H = 24.0  # time to repair or replace a node and return it to the pool: an assumption
# Measured here (docs/log.md, `make train`, 2026-11-30): a killed process detected 0.06 s after.
DETECT_PROCESS_S = 0.06
# docs/multinode.md: a node is lost when its beat has not moved for node_timeout_s (default 3 s).
DETECT_NODE_S = 3.0
# Decision to barrier at thousands of ranks, measured by the scale harness (docs/scale.md,
# 2026-12-03): 0.16 s at 1,024 simulated ranks, 0.76-0.90 s at 4,096 on two shared cores. Taken
# as 1 s, the rounded bound, for every size: no larger size could be measured here.
CONTROL_PLANE_S = 1.0
BYTES_PER_PARAM = 16  # bf16 weights and grads, fp32 master and two Adam moments
FLOPS_PER_GPU = 4e14  # H100 bf16 dense ~989 TFLOP/s at ~40% utilisation (assumed, as model.py)
WRITE_BPS_PER_GPU = 1e9  # checkpoint write bandwidth per GPU (assumed, as model.py)
LINK_BPS = 50e9  # GPU-to-GPU bandwidth of the peer state transfer (assumed, as model.py)
# Steady overhead of in-process recovery, by default the step boundary's own cost over the step:
# 1.04-1.41 ms a step, `python -m launcher.bench.boundary 1500` after issue 20's redesign
# (docs/log.md, 2026-12-01; the larger figure used). It leaves out what peer replication of the
# state costs at scale, not measured here. The whole-loop figure on the 2-core machine, +1.8%
# (`make bench`, docs/log.md, 2026-11-30, noise about +-3% at a 0.23 s step), is the
# pessimistic alternative: `--overhead 0.018`.
BOUNDARY_S = 1.41e-3
CHECKPOINT_MIN = 60.0  # in-process's durable checkpoint interval: an assumption (hourly)


def by_scale(gpus: int, points) -> float:
    """Log-linear through (GPUs, value) points, held flat outside them."""
    if gpus <= points[0][0]:
        return points[0][1]
    for (g0, v0), (g1, v1) in zip(points, points[1:]):
        if gpus <= g1:
            return v0 + (v1 - v0) * math.log(gpus / g0) / math.log(g1 / g0)
    return points[-1][1]


# Communicator rebuild at scale, not measurable on this machine: model.py's assumption (1 s at 8,
# 2 s at 1,024 and 5 s at 16,384 GPUs, taken from NVIDIA's published costs), not a measurement.
REGROUP_POINTS = [(8, 1.0), (1024, 2.0), (16384, 5.0)]
# Restart minutes: model.py's 10/15/30 at those sizes, on AWS HyperPod's "15-30 minutes or more".
RESTART_POINTS = [(8, 10.0), (1024, 15.0), (16384, 30.0)]


@dataclass
class Inputs:
    nodes: int = 128
    gpus_per_node: int = 8
    params: float = 70e9
    tokens_per_step: float = 4e6
    step_s: float | None = None  # None: 6 * params * tokens / (GPUs * FLOPS_PER_GPU)
    failures_per_gpu_hour: float = LLAMA3_PER_GPU_HOUR
    node_share: float = NODE_SHARE
    rack_share: float = RACK_SHARE
    nodes_per_rack: int = NODES_PER_RACK
    refill_h: float = REFILL_H
    detect_process_s: float = DETECT_PROCESS_S
    detect_node_s: float = DETECT_NODE_S
    control_plane_s: float = CONTROL_PLANE_S
    regroup_s: float | None = None  # None: by_scale(REGROUP_POINTS)
    transfer_s: float | None = None  # None: state per GPU / LINK_BPS
    save_s: float | None = None  # None: state per GPU / WRITE_BPS_PER_GPU
    checkpoint_min: float = CHECKPOINT_MIN
    restart_min: float | None = None  # None: by_scale(RESTART_POINTS)
    overhead: float | None = None  # None: BOUNDARY_S / step
    standalone_coordinator: bool = False
    restart_interval_s: float | None = None  # None: Young's interval for the whole failure rate
    days: float = 365.0

    def resolved(self) -> "Inputs":
        """A copy with every derived default filled in."""
        g = self.gpus
        state = BYTES_PER_PARAM * self.params / g
        mtbf_s = 3600 / (self.failures_per_gpu_hour * g)
        save = self.save_s if self.save_s is not None else state / WRITE_BPS_PER_GPU
        step = self.step_s if self.step_s is not None \
            else 6 * self.params * self.tokens_per_step / (g * FLOPS_PER_GPU)
        return replace(
            self, step_s=step,
            overhead=self.overhead if self.overhead is not None else BOUNDARY_S / step,
            regroup_s=self.regroup_s if self.regroup_s is not None
            else by_scale(g, REGROUP_POINTS),
            transfer_s=self.transfer_s if self.transfer_s is not None else state / LINK_BPS,
            save_s=save,
            restart_min=self.restart_min if self.restart_min is not None
            else by_scale(g, RESTART_POINTS),
            restart_interval_s=self.restart_interval_s if self.restart_interval_s is not None
            else young_interval_s(save, mtbf_s))

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's checkpoint interval: the one that minimises save cost plus work lost."""
    return math.sqrt(2 * save_s * mtbf_s)


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
