"""The supervisor's eyes: which active workers are lost, and why (an exit, an exception of their
own, an audit's accusation, silence, a stopped process, a straggler, a silent node). What to make
of what it sees is policy.py's; acting on a loss is the replacer's (replacer.py)."""
from __future__ import annotations

import json
import time

from ..protocol import membership
from . import policy
from .. import protocol
from .job_state import JobState, Notices
from .processes import Worker
from .spares import Spares
from .stragglers import Stragglers

D = protocol.DEFAULTS


class LossFinder:
    """Looks at the `pool`'s active workers (the ranks of `state`) and the store: each look
    returns the workers lost, with whether each was hung. It keeps what it has seen (the error
    and audit counters) and the rewind an audit asked for, issued with the next plan
    (issue_rewind). `remote(node)`: whether a node has an agent of its own (None on one
    machine)."""

    def __init__(self, cfg, state: JobState, pool, stragglers: Stragglers, spares: Spares,
                 notices: Notices, log=print, remote=None):
        self.cfg, self.state, self.pool, self.log = cfg, state, pool, log
        self.stragglers, self.spares, self.notices, self.remote = \
            stragglers, spares, notices, remote
        self._exit_seen: dict[int, float] = {}  # when a worker that left a result was seen dead
        self._errors_seen = 0  # the ERRORS counter when last looked at
        self._sdc_seen = 0  # the SDC counter when last looked at (audits' findings)
        self._rewind: dict | None = None  # a rewind an audit asked for, until carried out

    @property
    def store(self):
        return self.state.store

    @property
    def ranks(self) -> dict[int, int]:
        return self.state.ranks

    @property
    def gen(self) -> int:
        return self.state.gen

    @property
    def rewind_pending(self) -> dict | None:
        """The rewind an audit asked for that no generation has carried out yet."""
        return self._rewind

    @property
    def workers(self) -> dict[int, Worker]:
        return self.pool.workers

    def exited(self, nodes: set | None = None) -> list[Worker]:
        """Ranks' workers that exited before they were done: lost. One that died after its
        result was in (killed on its way out) is lost only while some other rank's result is
        still missing, a moment later (those ranks may need it again, job.finish); once every
        result is in, it finished. `nodes`: only the workers of those nodes are looked at."""
        self.pool.refresh()
        out = []
        for wid in self.pool.maybe_exited(self.ranks):
            w = self.workers[wid]
            if nodes is not None and w.node not in nodes:
                continue
            if w.alive() or wid in self.state.killed_after_done or \
                    self.store.check([protocol.done_key(wid)]):
                continue
            if self.store.check([protocol.result_key(self.ranks[wid])]):
                if membership.results_in(self.store, self.state.placement.processes):
                    self.state.killed_after_done.append(wid)
                    continue
                seen = self._exit_seen.setdefault(wid, time.time())
                if time.time() - seen < D.result_grace_s:
                    continue
            out.append(w)
        return out

    def reported_errors(self, lost) -> list[tuple[Worker, bool]]:
        """Workers that reported an exception of their own: killed at once, no need to wait."""
        errors = membership.counter(self.store, protocol.ERRORS)
        if errors == self._errors_seen:
            return []
        self._errors_seen, out = errors, []
        for wid in self._told(protocol.ERRORS, errors):
            w = self.workers[wid]
            if self.store.check([protocol.error_key(wid)]) and all(w is not x for x, _ in lost):
                self.pool.kill(w)
                out.append((w, False))
        return out

    def _told(self, counter_key: str, count: int) -> list[int]:
        """The active workers that reported under `counter_key` (membership.tell), in rank
        order: the list's, or every active one where the list falls short of `count`."""
        wids = membership.told(self.store, counter_key, count)
        return [wid for wid in self.ranks if wids is None or wid in wids]

    def accused(self, lost) -> list[tuple[Worker, bool]]:
        """Workers an audit found computing wrong (cause sdc, worker/audit.py): killed at once,
        and the generation that replaces them goes back to the state known clean before the
        worker's first wrong step (issue_rewind, with the next plan)."""
        if self.cfg.audit_every <= 0:
            return []
        found = membership.counter(self.store, protocol.SDC)
        if found == self._sdc_seen:
            return []
        self._sdc_seen, out = found, []
        for wid in self._told(protocol.SDC, found):
            finding = protocol.read_json(self.store, protocol.sdc_key(wid))
            if finding is None or any(w.wid == wid for w, _ in lost):
                continue
            w = self.workers[wid]
            self.pool.kill(w)
            # what report.json and the log say of it, as an error would be said
            self.store.set(protocol.error_key(wid), json.dumps({"error": (
                f"silent data corruption: rank {finding['rank']} (worker {wid}) computed a "
                f"wrong gradient at step {finding['step']}, found by spare worker "
                f"{finding['auditor']}'s replay; the job goes back to step "
                f"{finding['rewind_to']} or before\n")}))
            bound = finding["rewind_to"]
            if self._rewind is None or bound < self._rewind["at_most"]:
                self._rewind = {"at_most": bound, "gen": None, "worker": wid,
                                "first_wrong_step": finding["step"]}
            out.append((w, False))
        return out

    def issue_rewind(self) -> None:
        """With the plan of generation `self.gen`: the rewind an audit asked for, until a
        generation that carried it out has committed a step (a failure during the rewind
        itself leaves it to the next generation)."""
        r = self._rewind
        if r is None:
            return
        if r["gen"] is not None and self.store.check([protocol.first_commit_key(r["gen"], 0)]):
            self._rewind = None
            return
        r["gen"] = self.gen
        self.store.set(protocol.rewind_key(self.gen), json.dumps(r))

    def hung(self) -> list[tuple[Worker, bool]]:
        """Judged from the heartbeats of every active worker (a node's agent reports its own,
        and which of its processes are stopped: only that node's /proc shows it)."""
        active = {wid: self.workers[wid] for wid in self.ranks}
        beats = self.pool.beats(list(active))
        self.stragglers.note(beats)
        now = time.time()
        # a node whose record stopped coming says nothing of its workers: whether it is lost is
        # silent_nodes()'s to judge. Judged from their frozen beats, a dead node's workers were
        # taken for hung whenever the job's stall was noticed before the node's silence
        # (heartbeat_timeout_s and node_timeout_s both 3 s: a race a Slurm node loss lost once)
        heard = {w: b for w, b in beats.items() if not self.pool.unheard(active[w].node)}
        hung = policy.find_hung(heard, self.cfg.heartbeat_timeout_s,
                                now, stopped=lambda wid: self.pool.stopped(active[wid]))
        first = {wid: w.started for wid, w in active.items() if w.took_over_gen is None}
        for wid in policy.startup_overdue(first, beats, self.cfg.startup_timeout_s, now):
            # the others wait for it at the first barrier, silent too: the stuck one never
            # said it was ready, or is stopped
            if wid not in hung and (self.pool.stopped(active[wid]) or
                                    not self.store.check([protocol.ready_key(wid)])):
                self.log(f"[checkpointless] worker {wid} (rank {active[wid].rank}) has not "
                         "finished starting up within checkpointless.startup_timeout_s="
                         f"{self.cfg.startup_timeout_s:g} s: it is hung")
                hung.append(wid)
        return [(active[wid], True) for wid in hung]

    def slow(self) -> list[tuple[Worker, bool]]:
        """Stragglers to evict (stragglers.py judges them from the beats `hung` read). One is
        asked to leave at the next step boundary but one (a notice every worker learns of): it
        exits there, the others wait there for the plan that gives its rank to a spare, and no
        step is cut short. One that has not left within stragglers.LEAVE_S (it missed the
        notice, or a failure moved the job on) is killed, as a slow node's ranks are at once:
        the node is fenced, so that its ranks move together to a spare node."""
        active = {wid: self.workers[wid] for wid in self.ranks}
        evict, nodes = self.stragglers.judge(
            active, self._job_step, lambda: len(self.spares.fit()), self.remote)
        for k in nodes:
            self.pool.fence(k, "slow: every rank of the node is a straggler")
        out = [(w, False) for w in evict if w.node in nodes]
        for w in evict:
            if w.node not in nodes:  # as for a preemption, two steps on: all learn of it first
                self.stragglers.ask_to_leave(w, self._job_step() + 2, self.gen,
                                            self.notices.send)
        return out + [(self.workers[wid], False) for wid in self.stragglers.overdue(self.ranks)]

    def silent_nodes(self, lost) -> list[tuple[Worker, bool]]:
        """The workers of nodes just fenced as silent (each said in the log): one pass over
        those nodes' ranks, not one over every rank per silent node (at 16,384 ranks that
        stalled the coordinator, docs/scale.md)."""
        nodes = set(self.pool.fence_silent_nodes())
        if not nodes:
            return []
        return [(w, False) for w in self.exited(nodes) if all(w is not x for x, _ in lost)]

    def _job_step(self) -> int:
        return self.state.job_step(self.pool)
