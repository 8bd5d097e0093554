"""What a run tells its user: one entry per recovery, its phases, goodput, and the run's report.

Every figure comes from records the workers left in the store (protocol.py): when each generation
was entered, when its first step committed, which step ran when.

Goodput: the share of wall time spent on training steps that count.

    goodput = sum over committed steps of (step end - step start)
              / (end of the last step - start of the first step)

A step counts once, in its final committed attempt: the attempt cut short by a failure, the time
spent detecting it, regrouping, moving state and any step redone after a rollback all fall in the
denominator only. Start-up (imports, model build) is left out on purpose: it is the same for every
method and says nothing about fault tolerance. goodput_from_steps is the one place it is computed:
the supervisor's report and the benchmark both call it. Two kinds of time inside committed steps
are left out of the numerator too: what stragglers cost (slow_time), and what a shrunk job lost
(shrunk_capacity_lost: fewer processes than logical ranks do the job's work).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import protocol
from ..protocol.records import Entered
from ..protocol.replay import replay_report


@dataclass
class Failure:
    """One lost worker, as the supervisor saw it."""
    wid: int
    rank: int
    cause: str  # exit, error, hang, slow, sdc, diverged, node_lost (policy.cause)
    t_fail: float
    t_detect: float
    step: int
    error: str | None = None  # the worker's own traceback, when it reported one
    gen: int = -1  # the generation that replaced it
    t_spare: float = 0.0  # when a spare was available
    new_wid: int = -1
    node: int = 0  # the node it was on
    new_node: int = 0  # the node of the spare that took its rank
    # no spare was ready (checkpointless.shrink): its logical ranks moved to survivors instead,
    # `moved` says where (logical rank -> worker id); new_wid is the host of the first of them
    shrunk: bool = False
    moved: dict = field(default_factory=dict)


def failure_of(f: Failure) -> dict:
    """A failure as the report lists it, with when it happened (the record's order: ledger.py
    keeps it so; the report leaves `t_fail` out)."""
    out = {"rank": f.rank, "worker": f.wid, "cause": f.cause, "step": f.step,
           "error": f.error, "t_fail": round(f.t_fail, 6)}
    if f.shrunk:  # no spare took it: its logical ranks moved to survivors
        out["shrunk"] = True
    return out


def goodput_from_steps(steps: dict[int, tuple[float, float]], *,
                       first_start: float | None = None, slow_s: float = 0.0) -> float | None:
    """`steps`: step -> (start, end) of its final attempt.

    `first_start`: when the earliest attempt of any step began, if earlier than every final
    attempt. That happens when the first steps themselves were redone (a restart that found no
    checkpoint): the time since then was spent, so the span must start there, not at the redo.
    `slow_s`: the part of those steps a straggler cost (slow_time), not useful either.
    """
    if not steps:
        return None
    useful = sum(t1 - t0 for t0, t1 in steps.values()) - slow_s
    start = min(t0 for t0, _ in steps.values())
    if first_start is not None:
        start = min(start, first_start)
    end = max(t1 for _, t1 in steps.values())
    return round(useful / (end - start), 4) if end > start else 1.0


def shrunk_capacity_lost(steps: dict[int, tuple[float, float]], resizes: list[dict],
                         logical_world: int) -> float:
    """Seconds of the job's capacity lost to running on fewer processes than logical ranks.

    The job's capacity is L = `logical_world` processes. A committed step run on P < L
    processes (the `to_processes` of the newest shrink or grow in `resizes` whose `step` is at
    or before it) had (L - P) / L of that capacity missing for its whole time, so it counts
    (end - start) * (L - P) / L lost. Steps before any resize, or after a grow back to L,
    lose nothing."""
    marks = sorted((e["step"], i, e["to_processes"]) for i, e in enumerate(resizes))
    if not marks or logical_world <= 0:
        return 0.0
    lost = 0.0
    for s, (t0, t1) in steps.items():
        now = [p for step, _, p in marks if step <= s]
        if now and now[-1] < logical_world:
            lost += (t1 - t0) * (logical_world - now[-1]) / logical_world
    return round(lost, 4)


def slow_time(steps: dict[int, tuple[float, float]], stragglers: list[dict]):
    """(seconds lost to slow steps, the healthy step time): over the steps a straggler was in
    (from the first of its slow steps to its eviction, or to the end), each step's time above
    the healthy one, which is the median of the other steps. (0, None) without stragglers or
    without steps to measure the healthy time on."""
    slow = set()
    last = max(steps, default=-1)
    for e in stragglers:
        until = e.get("until_step")
        slow.update(range(e["from_step"], last + 1 if until is None else until))
    healthy = sorted(t1 - t0 for s, (t0, t1) in steps.items() if s not in slow)
    if not slow or not healthy:
        return 0.0, None
    mid = healthy[len(healthy) // 2]
    lost = sum(max(0.0, t1 - t0 - mid) for s, (t0, t1) in steps.items() if s in slow)
    return round(lost, 4), round(mid, 4)


def recovery_entry(store, f: Failure, nproc: int, last_gen: int) -> dict | None:
    """The recovery of failure `f`, once every member entered its generation and one committed
    a step there; None until then. A generation cut short by another failure is superseded by
    the next one that completed."""
    recs = []
    for g in range(f.gen, last_gen + 1):
        keys = [protocol.entered_key(g, rank) for rank in range(_processes(store, g, nproc))]
        if store.check(keys):  # every member entered: all of them in one read
            recs = list(enumerate(Entered.parse(v) for v in store.multi_get(keys)))
            break
    if not recs:
        return None
    firsts = []
    for g in range(f.gen, last_gen + 1):
        keys = [protocol.first_commit_key(g, r) for r in range(_processes(store, g, nproc))]
        if store.check(keys):
            firsts += [float(v) for v in store.multi_get(keys)]
        else:  # some never committed there (lost meanwhile): the others one by one
            firsts += [float(store.get(k)) for k in keys if store.check([k])]
    if not firsts:
        return None
    first = recs[0][1]
    t_plan = first.t_plan
    t_group = max(r.t_group for _, r in recs)
    t_ready = max(r.t_ready for _, r in recs)
    t_first = min(firsts)
    mine = [r for _, r in recs if r.worker_id == f.new_wid]
    return {
        "failed_rank": f.rank, "cause": f.cause, "failed_worker": f.wid,
        "failed_node": f.node, "replacement_node": f.new_node,
        "replacement_worker": f.new_wid, "generation": f.gen, "failed_at_step": f.step,
        "error": f.error,
        "detect_s": round(f.t_detect - f.t_fail, 4),
        "recovery_s": round(t_first - f.t_fail, 4),
        "phases_s": {
            "detection": round(f.t_detect - f.t_fail, 4),
            "spare_wait": round(max(0.0, f.t_spare - f.t_detect), 4),
            "regroup": round(t_group - t_plan, 4),
            "state_transfer": round(t_ready - t_group, 4),
            "resume": round(t_first - t_ready, 4),
        },
        "state_bytes": sum(r.bytes_received for _, r in recs),
        "source_ranks": sorted({int(s) for _, r in recs for s in r.pairs.values()}),
        "source": mine[0].source if mine else None,
        "served": {str(k): v for k, v in first.pairs.items()},
        "resumed_step": first.resumed_step,
        "restored_from": first.restored_from,
        "steps_redone": first.steps_redone,
        # survivors that redo the interrupted step from the gradients they kept
        "ranks_reusing_grads": sorted(rank for rank, r in recs if r.grads_kept),
        "processes": len(recs),  # the generation's (fewer than the job's after a shrink)
        **({"shrunk": True, "logical_ranks_moved": {str(r): w for r, w in f.moved.items()}}
           if f.shrunk else {}),
    }


def _processes(store, gen: int, nproc: int) -> int:
    """Generation `gen`'s members: its plan's world size (a shrink makes it fewer than the
    job's `nproc`); `nproc` where this store has no plan of it (one before a takeover)."""
    head = protocol.read_json(store, protocol.plan_key(gen))
    return head["world_size"] if head else nproc


def recovery_line(e: dict) -> str:
    p = e["phases_s"]
    if e.get("shrunk"):
        moved = ", ".join(f"logical rank {r} on worker {w}"
                          for r, w in e["logical_ranks_moved"].items())
        return (f"[checkpointless] recovered rank {e['failed_rank']} ({e['cause']}) by a shrink "
                f"({moved}): {e['state_bytes'] / 1e6:.1f} MB moved, resumed at step "
                f"{e['resumed_step']}, "
                f"{e['recovery_s']:.2f} s after the failure (detect {p['detection']:.2f}, "
                f"regroup {p['regroup']:.2f}, transfer {p['state_transfer']:.2f}, resume "
                f"{p['resume']:.2f})")
    return (f"[checkpointless] recovered rank {e['failed_rank']} ({e['cause']}): spare worker "
            f"{e['replacement_worker']} got {e['state_bytes'] / 1e6:.1f} MB from rank(s) "
            f"{e['source_ranks']}, resumed at step {e['resumed_step']}, {e['recovery_s']:.2f} s "
            f"after the failure (detect {p['detection']:.2f}, regroup {p['regroup']:.2f}, "
            f"transfer {p['state_transfer']:.2f}, resume {p['resume']:.2f})")


def new_step_records(store, cursor: int | None, rescan: int = 0, gap: int = 8):
    """The step records (step -> (start, end), as rank 0 wrote them) from `cursor` on, with the
    newest `rescan` before it read again (a step redone after a roll-back rewrites its own), and
    the next cursor; None reads from the launch's first step, once that is known. A step may lack
    its record (rank 0 died between the others' commit and its own): the scan goes on past `gap`
    missing records."""
    if cursor is None:
        if not store.check([protocol.FIRST_STEP]):
            return {}, None
        cursor = int(store.get(protocol.FIRST_STEP))
    got, s, misses = {}, max(0, cursor - rescan), 0
    while misses < gap:
        key = protocol.step_key(s)
        if store.check([key]):
            got[s] = tuple(float(x) for x in store.get(key).decode().split(","))
            misses, cursor = 0, max(cursor, s + 1)
        elif s >= cursor:
            misses += 1
        s += 1
    return got, cursor


def step_records(store) -> dict[int, tuple[float, float]]:
    """step -> (start, end) of every step committed in this launch."""
    return new_step_records(store, None if store.check([protocol.FIRST_STEP]) else 0, gap=64)[0]


def new_recoveries(store, failures: list[Failure], said: set[int], nproc: int,
                   last_gen: int) -> list[str]:
    """The lines of recoveries completed since the last call (`said`: the failures' indexes
    whose recovery was said, updated)."""
    out = []
    for i, f in enumerate(failures):
        if i in said or f.gen < 0:
            continue
        # asked every turn of the supervisor's loop while the recovery runs: one call per
        # generation until rank 0 (there is one in each) has committed a step after it, then
        # the O(ranks) read, once; reading every rank's keys each turn loaded the job's store
        # with thousands of calls a turn at thousands of ranks, during the recovery itself
        if not any(store.check([protocol.first_commit_key(g, 0)])
                   for g in range(f.gen, last_gen + 1)):
            continue
        e = recovery_entry(store, f, nproc, last_gen)
        if e is not None:
            said.add(i)
            out.append(recovery_line(e))
    return out


@dataclass
class RunFacts:
    """What the supervisor knows of a run as it ends, for its report (the rest is read from
    the store: the step records, the results, each recovery's record)."""
    nproc: int
    spares: int
    wall_s: float
    failures: list  # Failure, every one
    last_gen: int
    workers: list  # processes.Worker, every one started
    pids_at_start: dict  # rank -> pid of the first generation
    killed_after_done: list = field(default_factory=list)
    stragglers: list = field(default_factory=list)  # the straggler entries
    check: dict = field(default_factory=dict)  # the straggler check's settings and verdict
    # what coordinators before this one recorded (ledger.py): "steps", "failures",
    # "recoveries" and "stragglers", so that a report after a takeover counts from the launch
    earlier: dict = field(default_factory=dict)
    processes: int = 0  # processes at the end (fewer than nproc while shrunk); 0: nproc
    shrink: str = "off"  # checkpointless.shrink
    resizes: list = field(default_factory=list)  # every shrink and grow, from the launch on
    replay_check: str = "warn"  # checkpointless.replay_check (worker/rehearsal.py)


def run_report(store, run: RunFacts) -> dict:
    nproc, failures, workers = run.nproc, run.failures, run.workers
    earlier = run.earlier
    steps = {**earlier.get("steps", {}), **step_records(store)}  # this store's are the newest
    stragglers = earlier.get("stragglers", []) + run.stragglers
    slow_s, healthy_s = slow_time(steps, stragglers)
    lost = shrunk_capacity_lost(steps, run.resizes, nproc)  # 0 unless the job shrank
    results = {r: v for r in range(run.processes or nproc)
               for v in [protocol.read_json(store, protocol.result_key(r))] if v is not None}
    recoveries = earlier.get("recoveries", []) + [
        e for f in failures if f.gen >= 0
        for e in [recovery_entry(store, f, nproc, run.last_gen)] if e is not None]
    report = {
        "world_size": nproc,
        "spares": run.spares,
        "steps_completed": len(steps),
        "wall_s": round(run.wall_s, 3),
        # from the first step's first attempt: a rewind to it rewrites its record (audits)
        "goodput": goodput_from_steps(steps, slow_s=slow_s + lost, first_start=protocol.read_json(
            store, protocol.FIRST_T) if not earlier else None),
        # the time stragglers cost, against the healthy step time; goodput leaves it out
        "slow_s": slow_s,
        "healthy_step_s": healthy_s,
        "stragglers": stragglers,
        "straggler_check": run.check or {},
        "recoveries": recoveries,
        "failures": [{k: v for k, v in e.items() if k != "t_fail"}
                     for e in earlier.get("failures", []) + [failure_of(f) for f in failures]],
        "results_by_rank": results,
        "pids_at_end": {w.rank: w.proc.pid for w in workers if w.rank >= 0},
        "worker_ids_at_end": {w.rank: w.wid for w in workers if w.rank >= 0},
        "step_times": steps,
        "pids_at_start": run.pids_at_start,
        "replay": replay_report(store, nproc, run.replay_check),
    }
    if run.killed_after_done:
        report["killed_after_done"] = run.killed_after_done
    if run.shrink != "off":
        report.update(shrink_report(run, lost))
    return report


# what the report says of a shrink's numerics, by checkpointless.shrink
SHRINK_BITS = {"exact": {"mode": "exact"},
               "fast": {"mode": "fast",
                        "bits": "may differ from the failure-free run (summation order)"}}


def shrink_report(run: RunFacts, lost: float) -> dict:
    """The shrinks and grows, the processes at the end, and the capacity lost while shrunk
    (`shrunk_capacity_lost_s`, left out of goodput: shrunk_capacity_lost)."""
    events = [{k: v for k, v in e.items() if k != "kind"} for e in run.resizes]
    return dict(shrink=dict(SHRINK_BITS.get(run.shrink, {"mode": run.shrink})),
                shrinks=[e for e, r in zip(events, run.resizes) if r["kind"] == "shrink"],
                grows=[e for e, r in zip(events, run.resizes) if r["kind"] == "grow"],
                processes_at_end=run.processes or run.nproc, shrunk_capacity_lost_s=lost)

