"""The supervisor's decisions, as pure functions over plain data.

The supervisor (supervisor.py) gathers facts from the store and its processes; what to make of
them is decided here: when the run stops (each rule returns the message it stops with, or None),
what a failure's cause is, which worker is hung, and which spares take the lost ranks.
"""
from __future__ import annotations


# ---- stop rules: each returns why the run stops, or None -------------------------------------
def startup_failure(wid: int, rank: int, code, ready: bool, error: str | None = None) -> \
        str | None:
    """A worker lost before it finished starting up (before it said it was ready) is a fault
    like any other when a signal ended it (a kill from outside, the OOM killer; hangs and lost
    nodes never reach here with an exit of their own): a spare takes its rank. Its own error
    (an exception in the script or the recipe, a non-zero exit) stops the run with its text."""
    if ready or code is None or code < 0:
        return None
    last = (error or "").rstrip().splitlines()[-1:]
    why = f": {last[0]}" if last else "; its output above says why"
    return (f"worker {wid} (rank {rank}) exited with code {code} before it finished starting "
            f"up{why}. An error of the script's own at start-up is a bug, not a fault to "
            "recover from")


def startup_overdue(started: dict[int, float], beats: dict, timeout_s: float,
                    now: float) -> list[int]:
    """First-generation workers (wid -> launch time) with no heartbeat yet, launched longer
    than `timeout_s` ago: stuck in their start-up (a hung import, model load or first group)."""
    return sorted(w for w, t in started.items() if beats.get(w) is None and now - t > timeout_s)


def replay_strict(stop: str | None) -> str | None:
    """Under replay_check=strict a rank whose rehearsed step gave other bits the second time
    leaves with that error: a spare would run the same script, so the run stops with it."""
    if not stop:
        return None
    return (f"{stop}. The run stops before training on (checkpointless.replay_check=strict; "
            "warn would only say it)")


def clean_exit(wid: int, rank: int, code, hung: bool, node_lost: bool) -> str | None:
    """A worker that exited 0 without job.finish() left its loop: no spare can help."""
    if hung or node_lost or code != 0:
        return None
    return (f"worker {wid} (rank {rank}) exited with code 0 without calling job.finish() "
            "(accelerator.end_training()): a clean exit before the job finished is a script that "
            "left its loop, not a fault a spare could recover from. Call job.finish() "
            "(accelerator.end_training()) at the end of the script, on every rank")


def disabled(enabled: bool, rank: int, wid: int, cause: str, code) -> str | None:
    """With checkpointless off, the first failure ends the run."""
    if enabled:
        return None
    return (f"rank {rank} (worker {wid}) failed ({cause}, exit code {code}) and checkpointless "
            "is off: the run stops here")


def none_left(active: int, errors: list[str]) -> str | None:
    """Every active worker failed at once: no peer holds the state."""
    if active:
        return None
    first = errors[0].rstrip().splitlines()[-1] if errors else "see the output above"
    return ("every active worker failed at once: no healthy peer holds the training state, so "
            f"there is nothing to recover from. The first error: {first}")


def crashes_after(before: int, stepped: bool) -> int:
    """A rank's replacements lost in a row before completing a first step."""
    return 0 if stepped else before + 1


def crash_loop(rank: int, crashes: int, limit: int, error: str | None, code) -> str | None:
    """A replacement that dies before its first step, again and again, is a bug (a collective
    in its start-up the others do not join, a bad device): stop with its own error."""
    if crashes < limit:
        return None
    why = error.rstrip() if error else f"exit code {code}; its output above says why"
    return (f"the replacement for rank {rank} failed before completing its first step "
            f"{crashes} times in a row (checkpointless.max_replacement_failures={limit}): this "
            f"is a bug, not bad luck. The last one's error:\n{why}")


def escalation(failures: list, f, stepped: bool = True) -> str | None:
    """An error that strikes again at the same step is a bug, not a fault: after a recovery (the
    earlier one's rank was already replaced: its `gen` >= 0), or on two ranks at once (found in
    the same turn, neither replaced yet). `failures`: every failure so far (objects with cause,
    step, rank, error, gen), `f` among them; `stepped`: the job has committed a step (else the
    error is in the set-up between joining and the first step: sharding, loading weights)."""
    same = [g for g in failures if g is not f and g.cause == "error" == f.cause
            and g.step == f.step]
    if not same:
        return None
    last = (f.error or "").rstrip().splitlines()[-1:] or ["(no message)"]
    when = "again after a recovery" if same[0].gen >= 0 else "on two ranks at once"
    if not stepped:
        return (f"the job's set-up before its first step (after joining: the model's shards, "
                f"its weights, the optimizer) raised an error {when} (ranks {same[0].rank} and "
                f"{f.rank}): a bug or a bad input, not a transient fault. The error: {last[0]}")
    return (f"step {f.step} raised an error {when} (ranks {same[0].rank} and {f.rank}): this is "
            f"a bug in the step, not a transient fault. The error: {last[0]}")


def no_spare_left(lost: int, live_spares: int, spares: int, refill: bool) -> str | None:
    """Ranks are lost and not even a warming spare is left."""
    if live_spares:
        return None
    return (f"{lost} rank(s) lost and no spare left (checkpointless.spares={spares}, "
            f"refill={refill}); the run stops here. Raise checkpointless.spares or enable "
            "checkpointless.refill")


def spare_wait_over(waited_s: float, spare_wait_s: float) -> str | None:
    """No spare became ready in time."""
    if waited_s <= spare_wait_s:
        return None
    return (f"no spare became ready within checkpointless.spare_wait_s={spare_wait_s:g} s; the "
            "run stops here. Raise it if spares start slowly on this machine")


def shrink_refused(why: str, max_hosted: int) -> str:
    """A shrink no survivor can take (Placement.shrink's ValueError, `why`)."""
    return (f"no spare is ready and no process can host more logical ranks "
            f"(checkpointless.shrink_max_hosted={max_hosted}): {why}; the run stops here. Raise "
            "checkpointless.shrink_max_hosted (0: no limit) or checkpointless.spares")


def bad_exits(codes: dict[int, int | None]) -> str | None:
    """Workers that reported done but exited with an error of their own: the script failed."""
    bad = sorted(wid for wid, c in codes.items() if c is not None and c > 0)
    if not bad:
        return None
    return f"workers {bad} reported done but exited non-zero (exit codes {[codes[w] for w in bad]})"


# ---- facts made of records -------------------------------------------------------------------
def killed_after_done(codes: dict[int, int | None]) -> list[int]:
    """Done workers killed by a signal once their result was in (a node going down as the job
    ends): nothing is lost."""
    return sorted(wid for wid, c in codes.items() if c is not None and c < 0)


def cause(node_lost: bool, hung: bool, diverged: bool, error, slow: bool = False,
          sdc: bool = False) -> str:
    return "node_lost" if node_lost else "hang" if hung else "slow" if slow \
        else "sdc" if sdc else "diverged" if diverged else "error" if error else "exit"


def job_step(beats) -> int:
    """The step the job is at: the furthest of the workers' heartbeats (None: no beat yet)."""
    return max((b["step"] for b in beats if b), default=0)


def find_hung(beats: dict[int, dict], timeout_s: float, now: float,
              stopped=lambda wid: False) -> list[int]:
    """Workers silent longer than `timeout_s` that are stopped (`stopped(wid)`), or behind
    while the whole job has stalled.

    `beats` maps worker id to its last heartbeat ({t, step, ...}); workers with no beat yet are
    still warming up and are not judged. A worker beats at the start of each step, so in lockstep
    one rank may be a beat ahead of another for a whole step: "behind" means something only once
    every worker has been silent past the timeout (a stalled job), never while a step merely
    takes longer than the timeout (a large model, a loaded machine).
    """
    live = {w: b for w, b in beats.items() if b is not None and b.get("phase") != "done"}
    if not live:
        return []
    silent = {w for w, b in live.items() if now - b["t"] > timeout_s}
    stalled = silent == set(live)
    lead = max(b["step"] for b in live.values())
    return [w for w in sorted(silent) if stopped(w) or (stalled and live[w]["step"] < lead)]


# ---- cadence ---------------------------------------------------------------------------------
class Every:
    """A timer of the supervisor's loop: due(now) is true at most once per period."""

    def __init__(self, period_s: float):
        self.period_s, self.at = period_s, 0.0

    def due(self, now: float) -> bool:
        if now < self.at:
            return False
        self.at = now + self.period_s
        return True


# ---- spares ----------------------------------------------------------------------------------
def healthy_spares(ready: list, records: dict) -> tuple[list, dict]:
    """(the ready spares fit to take a rank, {wid: why not} for the others). `records`: wid ->
    its newest health check (health.py), None where it has none (no check is configured)."""
    fit, unfit = [], {}
    for w in ready:
        r = records.get(w.wid)
        if r is None or r["ok"]:
            fit.append(w)
        else:
            unfit[w.wid] = "; ".join(r["problems"])
    return fit, unfit


def choose_spares(ready: list, failed: list[tuple[int, int]], lost_nodes: set[int],
                  spare_nodes: set[int]) -> list | None:
    """Ready spares (objects with wid, node, slot, in order of preference) for the failed
    (node, slot) pairs, in the same order; None when too few are ready.

    A lost node's ranks go together to one spare node whose ready spares cover their local
    slots (devices), each to the same slot; a process lost on a healthy node goes to a spare on
    that node when there is one, else to any."""
    chosen: list = [None] * len(failed)
    used: set[int] = set()
    by_node: dict[int, list[int]] = {}
    for i, (node, _) in enumerate(failed):
        by_node.setdefault(node, []).append(i)
    for node, idx in by_node.items():
        if node not in lost_nodes:
            continue
        for k in sorted(spare_nodes):
            here = {w.slot: w for w in ready if w.node == k and w.wid not in used}
            if all(failed[i][1] in here for i in idx):
                for i in idx:
                    chosen[i] = here[failed[i][1]]
                    used.add(chosen[i].wid)
                break
    for i, (node, _) in enumerate(failed):
        if chosen[i] is not None:
            continue
        free = [w for w in ready if w.wid not in used]
        pick = ([w for w in free if w.node == node] or free or [None])[0]
        if pick is None:
            return None
        chosen[i] = pick
        used.add(pick.wid)
    return chosen


# ---- stragglers ------------------------------------------------------------------------------
def _median_without(v: list[float], x: float) -> float:
    """The median of sorted `v` less one instance of `x` (in it): O(log n), for thousands of
    ranks a step."""
    from bisect import bisect_left
    i, m = bisect_left(v, x), len(v) - 1
    at = lambda k: v[k] if k < i else v[k + 1]  # noqa: E731  the k-th of the rest
    return (at((m - 1) // 2) + at(m // 2)) / 2


def figures_by_step(paces: dict[int, dict[int, float]]) -> dict[int, list[float]]:
    """Every worker's figure at each step, sorted: step -> [ms, ...] (the peers' medians)."""
    by_step: dict[int, list[float]] = {}
    for mine in paces.values():
        for s, x in mine.items():
            by_step.setdefault(s, []).append(x)
    for v in by_step.values():
        v.sort()
    return by_step


def _kept_up(ratios: list[float]) -> float:
    """The slowness a window of per-step ratios kept up: their mean without the highest one (a
    rank descheduled once is not a straggler)."""
    if len(ratios) < 2:
        return ratios[0] if ratios else 0.0
    return (sum(ratios) - max(ratios)) / (len(ratios) - 1)


def find_stragglers(paces: dict[int, dict[int, float]], factor: float,
                    window: int, sustained: dict | None = None,
                    baselines: dict[int, float] | None = None) -> dict[int, tuple[float, int]]:
    """Workers that kept a slowness above `factor` over their newest `window` steps and have
    been slow for at least `window` steps: wid -> (the slowness kept up, the step it began).

    `paces` maps worker id to {step: its own time} (pace.py). A step's ratio is the worker's
    time over its peers' median at that step (judged when one peer at least has a figure),
    capped at 2 x factor; the slowness kept up over a window is the mean of its ratios without
    the highest. Averaged, not step by step: slowness that comes and goes faster than a step (a
    device throttled in bursts, a process stopped and continued in turns) makes every other step
    slow, and is as costly. The slowness begins at the first step above `factor` in the first
    window that kept it up. A gap of more than `window` steps without figures (heartbeats read
    less often than the steps go by) starts the count again.

    `sustained`, if given, is filled with each worker's slowness kept up over its newest window:
    in a failure-free run, the figure that says how high noise alone goes (report.json's
    straggler_check). `baselines` (wid -> ratio): work that comes with a worker's rank (rank 0's
    evaluation, logging, saving), its ratios divided by it (stragglers.py learns them)."""
    by_step = figures_by_step(paces)
    cap, out = 2 * factor, {}
    for w, mine in paces.items():
        judged: list[tuple[int, float]] = []  # (step, ratio), oldest first
        since, kept = None, 0.0
        for s in sorted(mine):
            if judged and s - judged[-1][0] > window:
                judged, since = [], None
            v = by_step[s]
            if len(v) < 2:
                continue
            peers = _median_without(v, mine[s])
            if peers <= 0:
                continue
            judged.append((s, min(cap, mine[s] / peers / (baselines or {}).get(w, 1.0))))
            recent = judged[-window:]
            kept = _kept_up([r for _, r in recent]) if len(recent) == window else 0.0
            if kept > factor:
                if since is None:
                    since = next(t for t, r in recent if r > factor)
            else:
                since = None
        if sustained is not None and kept:
            sustained[w] = kept
        if since is not None and judged[-1][0] - since + 1 >= window:
            out[w] = (round(kept, 2), since)
    return out


def slow_nodes(stragglers, active_by_node: dict[int, list[int]]) -> list[int]:
    """Nodes with more than one active worker, every one of them a straggler: a slow node (a
    throttled machine, a bad link) whose ranks move together to a spare node."""
    return sorted(k for k, wids in active_by_node.items()
                  if len(wids) > 1 and all(w in stragglers for w in wids))


def straggler_action(action: str, spare_ready: bool, evicted_at: int | None, step: int,
                     window: int) -> str:
    """What to do with a straggler of a rank slot: "evict" (a ready spare takes its rank) or
    "report". `evicted_at`: the step at which this rank slot's last straggler was evicted, if
    one was. A slot slow again within 10 windows of an eviction is a slow place (its device,
    its link, its data), which another eviction would not cure: reported, not evicted over and
    over."""
    if action != "evict" or not spare_ready:
        return "report"
    if evicted_at is not None and step - evicted_at < 10 * window:
        return "report"
    return "evict"
