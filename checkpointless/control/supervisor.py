"""The supervisor: starts workers and hot spares, watches them, hands a failed rank to a spare.

It owns the coordination store (a TCPStore server in this process, not in any training worker), so
it survives the loss of any worker. Its loop:
  1. a worker process that exited is a failure at once (cause `error` if it reported an exception,
     `hang` if the supervisor killed it for silence, else `exit`);
  2. a worker that reported an exception of its own is killed at once and its traceback printed;
  3. an active worker whose heartbeat is silent past `heartbeat_timeout_s` while behind the others,
     or whose process is stopped, is hung: it is killed, which also releases peers blocked on it;
  4. on failure, the loss is recorded in the store first (survivors' collectives have already
     failed and wait for that record, failures.py), then each lost rank goes to a warm spare and a
     new membership generation is published; the workers regroup and move state themselves;
  5. a used spare is replaced in the background (`refill`);
  6. a rank whose own time per step stays well above its peers' (a straggler, stragglers.py) is
     said, and evicted like a failure (cause `slow`) when a spare is ready;
  7. with checkpointless.shrink on and no spare ready, the lost ranks' logical ranks move to the
     survivors (a shrink), and a spare that warms up later takes one back (a grow).
What to make of what it sees (when to stop, which spare, who is hung) is decided in policy.py; the
processes are its pool's (processes.py on one machine, cluster.py over many). Finding the losses
(steps 1-3, 6) is in losses.py, acting on them (step 4) in replacing.py: halves of this class.
"""
from __future__ import annotations

import json
import os
import time

from ..protocol import membership
from . import policy
from .. import protocol
from ..protocol.placement import Placement
from .cluster import ClusterPool, pool_for
from .losses import FindingLosses
from .replacing import Replacing
from .facts import Deposed, NoFacts
from .ledger import Ledger
from .takeover import Takeover, take_over
from ..protocol import SupervisorConfig
from .prometheus import Snapshot, serve_metrics
from .report import Failure, RunFacts, new_recoveries, run_report
from .stragglers import Stragglers

D = protocol.DEFAULTS


class JobFailed(RuntimeError):
    """The run stopped; `report` holds what it had done (steps, failures, their errors)."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report


class Supervisor(FindingLosses, Replacing):
    """Owns the store, the membership (which worker holds which rank, generation by generation)
    and the failure records; the processes themselves belong to its pool."""

    def __init__(self, cmd: list[str], cfg: SupervisorConfig, env: dict | None = None, log=print,
                 on_start=None, wrap_store=None, on_straggler=None, facts=None):
        self.cfg = cfg
        # what must outlive this process (facts.py): in etcd under coordinator=etcd, where the
        # next holder of the role takes over from it; nowhere on one machine
        self.facts = facts or NoFacts()
        self.moves: list[dict] = []  # the coordinator's moves (takeovers) in this job
        # the run's record copied into the facts as it goes, for a coordinator taking over
        self.ledger = Ledger(self.facts)
        self.deposed: str | None = None  # why this coordinator lost its role (depose())
        self.log = log
        self.on_start = on_start
        self.wrap_store = wrap_store  # the scale harness counts the store's operations
        self.pool = pool_for(cfg, cmd, dict(os.environ if env is None else env), log)
        self.cluster = isinstance(self.pool, ClusterPool)
        if self.cluster:
            self.pool.on_fence = self.facts.record_fence
        self.workers = self.pool.workers
        self.failures: list[Failure] = []
        self.gen = -1
        self.ranks: dict[int, int] = {}  # active worker id -> rank
        self._plan: membership.Plan | None = None  # the newest published plan
        self.killed_after_done: list[int] = []  # workers killed once their result was in
        self._exit_seen: dict[int, float] = {}  # when a worker that left a result was seen dead
        self._crashes: dict[int, int] = {}  # rank -> its replacements lost before a first step
        self._errors_seen = 0  # the ERRORS counter when last looked at
        self._sdc_seen = 0  # the SDC counter when last looked at (audits' findings)
        self._rewind: dict | None = None  # a rewind an audit asked for, until carried out
        self._reported: set[int] = set()  # failures whose recovery was said
        self.store = None
        self.port = 0
        self.t_start = 0.0
        self.first_wids: dict[int, int] = {}  # rank -> the first generation's worker
        self.stop_asked: str | None = None  # why the job was asked to stop (a signal)
        self.preempted_at: int | None = None  # the step before which every rank stopped
        self.stragglers = Stragglers(cfg, log, on_straggler)
        self._notices = 0  # notices written (protocol.notice_key)
        self.grow_at: tuple[int, int] | None = None  # (generation, step) of a grow announced
        self._unhealthy_said: dict[int, str] = {}  # spare -> why it was last said unfit
        # which process (by rank) hosts which logical ranks; identity until a shrink
        self.placement = Placement.identity(cfg.nproc)
        self.resizes: list[dict] = []  # every shrink and grow, in order (replacing.py)

    def active_pids(self) -> dict[int, int]:
        """rank -> pid of the worker holding it now."""
        return {w.rank: w.proc.pid for wid, w in list(self.workers.items())
                if wid in self.ranks and w.alive()}

    def _stop_if(self, message: str | None) -> None:
        """Stop the run with a policy rule's message, if it has one."""
        if message:
            raise JobFailed(message, self._report())

    # ---- main loop -----------------------------------------------------------------------
    def figures(self, store) -> Snapshot:
        """What Prometheus shows now (prometheus.py), read on the scraper's thread with its
        own store connection; copies, so the loop may change its own values meanwhile."""
        try:
            ready = len(self.pool.spares(store, ready=True))
        except Exception:  # noqa: BLE001  the pool changed under the scrape: said next time
            ready = None
        nodes = getattr(self.pool, "nodes", None)
        return Snapshot(gen=self.gen, world_size=len(self.ranks), nproc=self.cfg.nproc,
                        processes=self.placement.processes, resizes=list(self.resizes),
                        failures=list(self.failures),
                        stragglers=list(self.stragglers.entries), spares_ready=ready,
                        nodes_alive=sum(not n.lost for n in nodes.values()) if nodes else 1,
                        nodes_lost=sum(n.lost for n in nodes.values()) if nodes else None,
                        t_start=self.t_start, earlier_steps=self.ledger.resumed_steps)

    def resume(self, t: Takeover) -> None:
        """Go on from where a lost coordinator left the job (takeover.py)."""
        self.ranks, self.gen, self._plan = dict(t.ranks), t.gen, t.plan
        self._notices, self.moves = t.notices, t.moves
        self.first_wids = {}
        self.ledger.resume(self.store, t.record)  # the record from the launch on
        self.placement = placement_of(t.plan, self.cfg.nproc)
        self.resizes = list(self.ledger.earlier_resizes)
        self.stragglers.placement_changed(max(self.placement.loads()) > 1)
        if t.preempt:  # asked before the takeover: the job still stops there
            self.preempted_at, self.stop_asked = t.preempt["before_step"], t.preempt.get("why")
        if t.regroup and t.regroup["gen"] == t.gen:  # the workers stop there for a grow: this
            # store may never see the step they wait at (rank 0's record of it went to the lost
            # one), so the grow goes out at once (a worker still in its step redoes it)
            self.grow_at = (t.gen, 0)

    def run(self) -> dict:
        cfg = self.cfg
        self.server, self.store = membership.host(cfg.host, cfg.port)
        self.port = self.server.port
        if self.wrap_store:
            self.store = self.wrap_store(self.store)
        self.stragglers.store = self.store  # where its lines go (a loop's trackers follow)
        known = self.facts.known()
        spec = known.spec or cfg.spec().to_json()
        self.store.set(protocol.SPEC, spec)
        try:  # before any worker: a busy port stops nothing
            stop_metrics = serve_metrics(self, self.log)
        except OSError as exc:
            raise JobFailed(str(exc)) from None
        self.t_start = time.time()
        if known.gen >= 0:
            self.resume(take_over(self.store, self.pool, self.facts, known, self.log))
        else:
            self.facts.record_spec(spec)
            if self.facts.durable:  # the first holder of the role: where the job began
                self.moves = [dict(self.facts.taking, start=True)]
                self.facts.record_move(self.moves[0])
            for w in self.pool.start(self.store):
                self.ranks[w.wid] = w.rank
            # their pids are read for the report, at the end: a remote worker's costs two store
            # calls (at 16,384 ranks 15 s before the first plan, when it was read here)
            self.first_wids = {w.rank: w.wid for w in self.workers.values() if w.rank >= 0}
            self._publish()
        if self.on_start:
            self.on_start(self)
        try:
            self._watch()
        except Deposed as exc:
            self.depose(str(exc))
            raise JobFailed(str(exc)) from None
        except JobFailed as exc:
            if self.facts.durable:  # every launcher is an agent: each exits saying so
                self.pool.stop_why = f"stopped the job: {exc}"
            raise
        finally:
            if stop_metrics:
                stop_metrics()
            # a deposed coordinator tells nobody anything: the agents may already serve its
            # successor (they stop by themselves when etcd is gone for good, role_watch.py)
            if not self.deposed:
                self.store.set(protocol.SHUTDOWN, "1")
                time.sleep(D.shutdown_poll_s)  # the agents' next look sees it first
                self.pool.stop_all()
        self._say_recoveries()
        return self._report()

    def depose(self, why: str) -> None:
        """Its role was lost (leadership.py, from the lease's thread): it stops at once and
        changes nothing more."""
        self.deposed = why

    def _watch(self) -> None:
        """Every wake-up (an exit, or poll_s): exits. Every poll_s: reported errors, hung
        workers (every beats_every_s), silent nodes, then preemption, refills and the end."""
        store_checks, beat_reads = policy.Every(self.cfg.poll_s), policy.Every(D.beats_every_s)
        while True:
            self.pool.sleep(list(self.ranks), self.cfg.poll_s)
            if self.deposed:
                raise Deposed(self.deposed)
            lost = [(w, False) for w in self._exited()]
            now = time.time()
            checks = store_checks.due(now)
            if checks:
                lost += self._reported_errors(lost)
                lost += self._accused(lost)
                if not lost and beat_reads.due(now):
                    lost += self._hung()
                    if not lost:
                        lost += self._slow()
                lost += self._silent_nodes(lost)
            if lost:
                self._handle(lost)
                # the failures on record at once: a takeover a moment from now still lists them
                self.ledger.tick(self.store, self.failures, self._reported, self.cfg.nproc,
                                 self.gen, force=True, stragglers=self.stragglers.entries)
            if checks and self._tick():
                return

    def _tick(self) -> bool:
        """The loop's duties every poll_s; True once the job is over."""
        self._preempt_if_asked()
        self._say_recoveries()
        self.ledger.tick(self.store, self.failures, self._reported, self.cfg.nproc, self.gen,
                         stragglers=self.stragglers.entries)
        self.pool.replace_dead_spares(self.store.check([protocol.SHUTDOWN]), self.log)
        self.pool.refill_due()
        self._grow_if_ready()
        return self._finished()

    def _finished(self) -> bool:
        """Every rank reported done (or was killed on its way out, its result in)."""
        gone = set(self.killed_after_done)
        if membership.counter(self.store, protocol.DONE) + len(gone) < len(self.ranks) or \
                not all(wid in gone or self.store.check([protocol.done_key(wid)])
                        for wid in self.ranks):
            return False
        for wid in self.ranks:
            self.workers[wid].proc.wait()
        codes = {wid: self.workers[wid].proc.returncode for wid in self.ranks}
        self._stop_if(policy.bad_exits(codes))
        killed = policy.killed_after_done(codes)
        if killed:
            self.killed_after_done = killed
            self.log(f"[checkpointless] workers {killed} were killed (signals "
                     f"{[-codes[w] for w in killed]}) after reporting their results; every "
                     "rank's result is in, so the run stands")
        return True

    # ---- preemption ----------------------------------------------------------------------
    def request_stop(self, why: str) -> None:
        """From a signal handler (SIGTERM, SIGINT): stop the job at the next step boundary."""
        self.stop_asked = why

    def _preempt_if_asked(self) -> None:
        """Asked (a signal here, or a node's agent), ask every rank to stop before the step
        after the one in flight: the lead step's ranks finish it, every rank stops at the same
        boundary (where the loop may write a durable checkpoint, a collective), reports done,
        and the run ends as preempted."""
        if self.preempted_at is not None or not (
                self.stop_asked or self.store.check([protocol.PREEMPT_ASK])):
            return
        self.stop_asked = self.stop_asked or self.store.get(protocol.PREEMPT_ASK).decode()
        # two steps past the furthest seen: a rank may have begun the next step since its last
        # heartbeat was read, and every rank must learn of the stop before it reaches it
        stop = self._job_step() + 2
        self.preempted_at = stop
        self._notice(kind="preempt", before_step=stop, why=self.stop_asked)
        self.log(f"[checkpointless] {self.stop_asked}: stopping every rank before step {stop}")

    def _notice(self, **notice) -> None:
        """A notice every worker's watch learns of (protocol.notice_key), in order."""
        raw = json.dumps(notice)
        # kept for a coordinator taking over first (it publishes it again, takeover.py): the
        # ranks that join under it (a lost node's replacements) must stop where the others do
        self.facts.record(f"notice/{self._notices}", raw)
        self.store.set(protocol.notice_key(self._notices), raw)
        self._notices += 1
        self.facts.record_notices(self._notices)

    # ---- reporting -----------------------------------------------------------------------
    def _say_recoveries(self) -> None:
        for line in new_recoveries(self.store, self.failures, self._reported, self.cfg.nproc,
                                   self.gen):
            self.log(line)

    def _report(self) -> dict:
        return run_report(self.store, RunFacts(
            nproc=self.cfg.nproc, spares=self.cfg.spares, wall_s=time.time() - self.t_start,
            failures=self.failures, last_gen=self.gen, workers=list(self.workers.values()),
            pids_at_start={r: self.workers[wid].proc.pid for r, wid in self.first_wids.items()},
            killed_after_done=self.killed_after_done,
            stragglers=self.stragglers.entries or [], check=self.stragglers.summary(),
            earlier=self.ledger.earlier(), processes=self.placement.processes,
            shrink=self.cfg.shrink, resizes=list(self.resizes)))


def placement_of(plan: membership.Plan, nproc: int) -> Placement:
    """The placement a plan describes: its processes in rank order, each with its hosted
    logical ranks (a plan without hosts: one logical rank a process, its own)."""
    if not plan.hosts:
        return Placement.identity(plan.world_size or nproc)
    order = sorted(plan.ranks, key=plan.ranks.get)
    return Placement(plan.logical_world or nproc, tuple(tuple(plan.hosts[w]) for w in order))


__all__ = ["Supervisor", "SupervisorConfig", "JobFailed", "Failure"]
