"""The supervisor's straggler check: ranks that slow down without failing.

Under data parallelism one slow rank makes every rank wait, and nothing fails: no exit, no
silence. Each worker measures its own time per step, less its waiting on peers (pace.py), and its
heartbeat carries the newest figures; the supervisor keeps them per worker (`note`) and compares
each worker's with its peers' median step by step (policy.find_stragglers). A worker that keeps
up more than `straggler_factor` times that median over its last `straggler_window` steps is a
straggler; a node all of whose ranks are stragglers is a slow node.

What is done (`straggler_action`): `evict` hands the straggler's rank to a ready spare through the
path of any failure (cause `slow`): the supervisor asks it to leave at a step boundary, where the
others wait for the plan that replaces it and the spare receives the state, so no step is cut
short and the run keeps the failure-free bits (LossFinder.slow, losses.py); a slow node is fenced and its
ranks move together to a spare node. With no spare ready it is reported, and evicted once one
is. A rank slot slow again soon after an eviction is reported only (policy.straggler_action).
`report` only says it; `off` judges nothing. Every straggler is an entry of `report.json`'s
`stragglers`, with the step its slowness began and, once it ended, the step it ended at.

While the job is shrunk (checkpointless.shrink: some process hosts more than one logical rank,
worker/logical.py), nothing is judged: such a process is slower by design, and no spare is
ready to take a rank anyway (the first one to warm up grows the job back instead).
"""
from __future__ import annotations

import json
import time

from . import policy
from .. import protocol

KEEP_STEPS = 48  # steps of figures kept per worker (a few windows)
LEAVE_S = 30.0  # a straggler asked to leave at a step boundary that has not is killed then


class Stragglers:
    def __init__(self, cfg, log=print, on_entry=None, store=None):
        self.factor, self.window = cfg.straggler_factor, cfg.straggler_window
        self.action = cfg.straggler_action
        self.log = log
        self.on_entry = on_entry or (lambda entry: None)  # an entry found or dealt with
        self.store = store  # each entry said goes there too (protocol.straggler_key)
        self._lines = 0
        self.paces: dict[int, dict[int, float]] = {}  # wid -> {step: own ms}
        self.entries: list[dict] = []  # what report.json's `stragglers` holds
        self._open: dict[int, dict] = {}  # wid -> its entry, while it is a straggler
        self._evicted: set[int] = set()  # workers evicted for slowness
        self._evicted_at: dict[int, int] = {}  # rank -> the step of its last eviction
        self._stay_said: set[int] = set()  # stragglers whose staying was said
        self._leaving: dict[int, float] = {}  # straggler asked to leave -> when to kill it
        # the highest slowness any worker kept up over a window (ratio to its peers' median):
        # in a failure-free run, how far noise alone goes
        self.worst_sustained = 0.0
        self.paused = False  # the job is shrunk: see the module's docstring
        # rank -> its own ratio to its peers over its first window: work that comes with the
        # rank (rank 0's evaluation, logging, saving) is its normal, not slowness (`_learn`)
        self.own_work: dict[int, float] = {}
        self._slot_normal: set[int] = set()  # ranks whose normal was learned from an eviction

    def note(self, beats: dict) -> None:
        """Keep the figures the newest heartbeats carry ({wid: beat or None})."""
        if self.action == "off" or self.paused:
            return
        for wid, b in beats.items():
            if not b or not b.get("pace") or wid in self._evicted:  # leaving: judged already
                continue
            mine = self.paces.setdefault(wid, {})
            for step, ms in b["pace"]:
                mine[int(step)] = float(ms)
            if len(mine) > KEEP_STEPS:
                for s in sorted(mine)[:-KEEP_STEPS]:
                    del mine[s]

    def placement_changed(self, shrunk: bool) -> None:
        """The processes host other logical ranks now (a shrink or a grow): the figures kept
        were measured under other loads, so they are dropped; while `shrunk`, none are kept."""
        self.paused = shrunk
        self.paces.clear()
        self._open.clear()

    def summary(self) -> dict:
        """The check's settings, the highest slowness a worker kept up over a window, and the
        ranks whose own work was learned as their normal (`_learn`)."""
        return {"action": self.action, "factor": self.factor, "window": self.window,
                "worst_sustained_ratio": self.worst_sustained,
                "own_work": {str(r): b for r, b in sorted(self.own_work.items()) if b > 1.05}}

    def _learn(self, active: dict) -> dict[int, float]:
        """Each rank's ratio to its peers over its first full window of the launch, learned
        once per rank, when that window is steady (`steady_ratios`: every step shows it;
        a rank slowed partway through it learns nothing): a rank that does more by design (rank 0 evaluating, logging or saving
        inside the step) is judged against its own normal, which an eviction could not
        change, since its replacement does the same work. A uniform slowdown moves every rank
        alike and no ratio. A normal at or above the factor is not learned (that rank may be a
        slow node from the start): it is judged as any, and if its replacement is as slow, the
        slot's slowness is learned then (`_learned_from_eviction`). Returns wid -> normal."""
        if any(w.rank not in self.own_work for w in active.values()):
            steady = None
            for wid, paces in self.paces.items():
                if wid in active and active[wid].rank not in self.own_work and \
                        len(paces) >= self.window:  # its first window is in: learned once
                    if steady is None:
                        steady = steady_ratios(self.paces, self.window)
                    self.own_work[active[wid].rank] = round(steady.get(wid, 1.0), 3)
        return {wid: self.own_work[w.rank] for wid, w in active.items()
                if 1.0 < self.own_work.get(w.rank, 1.0) < self.factor
                or w.rank in self._slot_normal}

    def _learned_from_eviction(self, entry: dict, spares_left: int) -> bool:
        """A rank slot slow again soon after its straggler was evicted, by about as much: the
        slowness comes with the rank (its work), not the worker; from now on it is the slot's
        normal (`_learn`), and the straggler entry ends. False when that is not the case."""
        rank = entry["rank"]
        if self.action != "evict" or rank not in self._evicted_at or spares_left < 1:
            return False
        self.own_work[rank] = max(entry["factor"], self.own_work.get(rank, 1.0))
        self._slot_normal.add(rank)
        self.log(f"[checkpointless] rank {rank} is as slow again after its eviction "
                 f"({entry['factor']:.2f}x its peers): that is work that comes with the rank, not "
                 "a slow worker; it is judged against it from now on")
        return True

    def began(self, store, wid: int) -> dict | None:
        """{"t": when worker `wid`'s newest slowness began}: the start of its first slow step,
        from rank 0's step record (None without one)."""
        found = [e for e in self.entries if e["worker"] == wid]
        key = protocol.step_key(found[-1]["from_step"]) if found else None
        if key is None or not store.check([key]):
            return None
        return {"t": float(store.get(key).decode().split(",")[0])}

    def _said(self, entry: dict) -> None:
        """An entry found or dealt with: into the store, where a loop's trackers follow them,
        and to the caller's hook (the launcher's metrics.jsonl)."""
        if self.store is not None:
            self.store.set(protocol.straggler_key(self._lines),
                           json.dumps(dict(entry, t=time.time())))
            self._lines += 1
        self.on_entry(dict(entry))

    def ask_to_leave(self, w, step: int, gen: int, notice) -> None:
        """Evicted worker `w` leaves before `step` of generation `gen`: `notice(**fields)`
        tells every worker (protocol.notice_key); its slowness lasts until then."""
        notice(kind="leave", wid=w.wid, gen=gen, before_step=step)
        for e in reversed(self.entries):
            if e["worker"] == w.wid:
                e["until_step"] = step
                break
        self._leaving[w.wid] = time.time() + LEAVE_S
        self.log(f"[checkpointless] rank {w.rank} (worker {w.wid}) leaves before step {step}; "
                 "a spare takes its rank there")

    def overdue(self, active) -> list[int]:
        """Workers asked to leave that are still in `active` LEAVE_S later: to be killed."""
        now, out = time.time(), []
        for wid, deadline in list(self._leaving.items()):
            if wid not in active or now > deadline:  # handled already, or to be killed now
                del self._leaving[wid]
                if wid in active:
                    out.append(wid)
        return out

    def evicted(self, wid: int) -> bool:
        return wid in self._evicted

    def judge(self, active: dict, step, ready_spares, remote=None):
        """(workers to evict now, nodes to fence as slow) among `active` ({wid: Worker}), at
        job step `step`, with `ready_spares` fit to take a rank (each a number, or a function
        giving it: asked only when there is a straggler, so that the steady state costs the
        job's store nothing); `remote(node)`: whether a node has an agent of its own (slow nodes
        are only judged there: a coordinator's node cannot move)."""
        if self.action == "off" or self.paused:
            return [], []
        for wid in [w for w in self.paces if w not in active]:  # left the job meanwhile
            del self.paces[wid]
        sustained: dict[int, float] = {}
        found = policy.find_stragglers(self.paces, self.factor, self.window, sustained,
                                       self._learn(active))
        self.worst_sustained = round(max([self.worst_sustained, *sustained.values()]), 3)
        if not found and not self._open:
            return [], []
        step = step() if callable(step) else step
        ready_spares = ready_spares() if callable(ready_spares) else ready_spares
        for wid, entry in list(self._open.items()):  # no longer slow, or gone
            if wid not in found or wid not in active:
                if wid in active:
                    entry["until_step"] = step
                    self._said(entry)
                    self.log(f"[checkpointless] rank {entry['rank']} is no longer slow at step "
                             f"{step}")
                del self._open[wid]
        by_node: dict[int, list[int]] = {}
        for wid, w in active.items():
            by_node.setdefault(w.node, []).append(wid)
        slow_nodes = [k for k in policy.slow_nodes(found, by_node) if remote and remote(k)]
        for wid, (ratio, since) in sorted(found.items(), key=lambda x: active[x[0]].rank):
            if wid not in self._open:
                self._say(active[wid], ratio, since, step, active[wid].node in slow_nodes)
        evict, fence, spares_left = [], [], ready_spares
        # a slow node's ranks go together (to a spare node), or stay together
        groups = [by_node[k] for k in slow_nodes] + \
            [[wid] for wid in sorted(found, key=lambda x: active[x].rank)
             if active[wid].node not in slow_nodes]
        for group in groups:
            entries = [self._open[wid] for wid in group]
            if any(e["action"] != "reported" for e in entries):
                continue
            do = [policy.straggler_action(self.action, spares_left >= len(group),
                                          self._evicted_at.get(e["rank"]), step, self.window)
                  for e in entries]
            if all(d == "evict" for d in do):
                spares_left -= len(group)
                for wid, e in zip(group, entries):
                    e.update(action="evicted", evicted_at_step=step, until_step=step)
                    self._evicted.add(wid)
                    self._evicted_at[e["rank"]] = step
                    del self._open[wid]
                    self.paces.pop(wid, None)
                    evict.append(active[wid])
                    self._said(e)
                if len(group) > 1:
                    fence.append(active[group[0]].node)
                self.log(f"[checkpointless] evicting rank(s) {[e['rank'] for e in entries]} "
                         "for slowness: ready spares take their ranks" +
                         (f" (node {active[group[0]].node} is fenced)" if len(group) > 1 else ""))
            elif len(group) == 1 and self._learned_from_eviction(entries[0], spares_left):
                continue
            elif group[0] not in self._stay_said:
                self._stay_said.add(group[0])
                e = entries[0]
                why = (f"checkpointless.straggler.action={self.action}" if self.action != "evict"
                       else "no spare is ready" if spares_left < len(group) else
                       f"its rank was evicted for slowness at step {self._evicted_at[e['rank']]}"
                       ", and a slot slow again so soon is a slow place, not a slow worker")
                self.log(f"[checkpointless] rank(s) {[x['rank'] for x in entries]} stay: {why}")
        return evict, fence

    def _say(self, w, ratio: float, since: int, step: int, slow_node: bool) -> None:
        entry = {"rank": w.rank, "node": w.node, "worker": w.wid, "factor": ratio,
                 "from_step": since, "detected_at_step": step, "action": "reported",
                 "until_step": None, "slow_node": slow_node}
        self.entries.append(entry)
        self._open[w.wid] = entry
        self._said(entry)
        self.log(f"[checkpointless] rank {w.rank} (worker {w.wid}, node {w.node}) is a straggler: "
                 f"its own time per step has kept up {ratio:.2f}x its peers' median over "
                 f"its last {self.window} steps (above {self.factor:g}x), slow since step "
                 f"{since}" +
                 (f"; every rank of node {w.node} is slow" if slow_node else ""))


def steady_ratios(paces: dict[int, dict[int, float]], window: int) -> dict[int, float]:
    """Workers whose first `window` judged steps all show about the same ratio to their peers'
    median: wid -> the median of those ratios. A rank that does more work by design (rank 0's
    logging, saving) does it at every step; a rank throttled or slowed partway through the
    window is not steady (some of its steps at 1, others far above) and gets nothing here.
    Steady: all but the lowest ratio at least halfway from 1 to the median."""
    by_step = policy.figures_by_step(paces)
    out = {}
    for w, mine in paces.items():
        ratios = []
        for s in sorted(mine):
            v = by_step[s]
            if len(v) >= 2 and (peers := policy._median_without(v, mine[s])) > 0:
                ratios.append(mine[s] / peers)
            if len(ratios) == window:
                break
        if len(ratios) < window:
            continue
        ordered = sorted(ratios)
        median = ordered[window // 2]
        if ordered[1] >= 1 + (median - 1) / 2:
            out[w] = median
    return out
