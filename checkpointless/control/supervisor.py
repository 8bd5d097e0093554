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
processes are its pool's (processes.py on one machine, cluster.py over many). The supervisor runs
the loop and composes collaborators, each handed what it needs: the loss finder (steps 1-3, 6:
losses.py), the replacer (step 4: replacer.py, publishing through publisher.py, spares.py
choosing the spares), the grower (step 7: grower.py) and the stop rules (stops.py), over the
state they share (job_state.py: the membership it publishes, the failures and resizes so far);
run_record.py keeps the run's record (recoveries said, the facts' copy, the figures, the report).
"""
from __future__ import annotations

import os
import time

from ..protocol import membership
from . import policy
from .. import protocol
from .cluster import ClusterPool, pool_for
from .facts import Deposed, NoFacts
from .grower import Grower
from .job_state import JobState, Notices, placement_of
from .ledger import Ledger
from .losses import LossFinder
from .publisher import Publisher
from .replacer import Replacer
from .run_record import RunRecord
from .spares import Spares
from .stops import JobFailed, StopRules
from .takeover import Takeover, take_over
from ..protocol import SupervisorConfig
from .prometheus import Snapshot, serve_metrics
from .report import Failure
from .stragglers import Stragglers

D = protocol.DEFAULTS


def _shared(name: str, doc: str) -> property:
    """A field of the job's state (JobState), read through the supervisor."""
    return property(lambda self: getattr(self.state, name), doc=doc)


class Supervisor:
    """Owns the store, the membership (which worker holds which rank, generation by generation)
    and the failure records; the processes themselves belong to its pool (`pool`: one given,
    else the one `cfg` asks for, pool_for)."""

    def __init__(self, cmd: list[str], cfg: SupervisorConfig, env: dict | None = None, log=print,
                 on_start=None, wrap_store=None, on_straggler=None, facts=None, pool=None):
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
        self.pool = pool if pool is not None else \
            pool_for(cfg, cmd, dict(os.environ if env is None else env), log)
        cluster = isinstance(self.pool, ClusterPool)
        if cluster:
            self.pool.on_fence = self.facts.record_fence
        self.workers = self.pool.workers
        self.port = 0
        self.stragglers = Stragglers(cfg, log, on_straggler)
        # the collaborators, over the state they share
        self.state = JobState(cfg.nproc)
        self.record = RunRecord(cfg, self.state, self.pool, self.stragglers, self.ledger, log)
        self.notices = Notices(self.state, self.facts)
        self.stops = StopRules(cfg, self.state, self.pool, self.notices, self.record.report,
                               log)
        self.spares = Spares(self.state, self.pool, log)
        self.losses = LossFinder(cfg, self.state, self.pool, self.stragglers, self.spares,
                                 self.notices, log, self.pool.remote if cluster else None)
        self.publisher = Publisher(cfg, self.state, self.pool, self.facts, self.ledger,
                                   self.stragglers, self.losses.issue_rewind)
        self.replacer = Replacer(cfg, self.state, self.pool, self.losses, self.spares,
                                 self.stops, self.publisher, self.stragglers, log, cluster)
        self.grower = Grower(cfg, self.state, self.pool, self.spares, self.publisher,
                             self.notices, log)

    # ---- what the launcher, Prometheus and the tests read of it ---------------------------
    gen = _shared("gen", "the newest generation published")
    ranks = _shared("ranks", "active worker id -> rank")
    placement = _shared("placement", "which process (by rank) hosts which logical ranks")
    failures = _shared("failures", "every loss, in order (report.Failure)")
    resizes = _shared("resizes", "every shrink and grow, in order")
    stop_asked = _shared("stop_asked", "why the job was asked to stop (a signal)")
    preempted_at = _shared("preempted_at", "the step before which every rank stopped")

    @property
    def store(self):
        """The coordination store (run() hosts it)."""
        return self.state.store

    @store.setter
    def store(self, store) -> None:
        self.state.store = self.stragglers.store = store  # its lines go there too

    @property
    def grow_at(self) -> tuple[int, int] | None:
        """(generation, step) of a grow announced (grower.py)."""
        return self.grower.grow_at

    def active_pids(self) -> dict[int, int]:
        """rank -> pid of the worker holding it now."""
        return {w.rank: w.proc.pid for wid, w in list(self.workers.items())
                if wid in self.ranks and w.alive()}

    def request_stop(self, why: str) -> None:
        """From a signal handler (SIGTERM, SIGINT): stop the job at the next step boundary."""
        self.stops.request_stop(why)

    # ---- main loop -----------------------------------------------------------------------
    def figures(self, store) -> Snapshot:
        """What Prometheus shows now (run_record.py), on the scraper's thread."""
        return self.record.figures(store)

    def resume(self, t: Takeover) -> None:
        """Go on from where a lost coordinator left the job (takeover.py)."""
        s = self.state
        s.ranks, s.gen, s.plan = dict(t.ranks), t.gen, t.plan
        self.notices.count, self.moves = t.notices, t.moves
        self.record.first_wids = {}
        self.ledger.resume(self.store, t.record)  # the record from the launch on
        s.placement = placement_of(t.plan, self.cfg.nproc)
        s.resizes = list(self.ledger.earlier_resizes)
        self.stragglers.placement_changed(max(s.placement.loads()) > 1)
        if t.preempt:  # asked before the takeover: the job still stops there
            s.preempted_at, s.stop_asked = t.preempt["before_step"], t.preempt.get("why")
        if t.regroup and t.regroup["gen"] == t.gen:  # the workers stop there for a grow: this
            # store may never see the step they wait at (rank 0's record of it went to the lost
            # one), so the grow goes out at once (a worker still in its step redoes it)
            self.grower.grow_at = (t.gen, 0)

    def first_generation(self) -> None:
        """A new job's first moves, in its store: the pool starts ranks 0..R-1 and the spares,
        and generation 0 is published."""
        for w in self.pool.start(self.store):
            self.ranks[w.wid] = w.rank
        # their pids are read for the report, at the end: a remote worker's costs two store
        # calls (at 16,384 ranks 15 s before the first plan, when it was read here)
        self.record.first_wids = {w.rank: w.wid for w in self.workers.values() if w.rank >= 0}
        self.publisher.publish()

    def run(self) -> dict:
        cfg = self.cfg
        self.server, store = membership.host(cfg.host, cfg.port)
        self.port = self.server.port
        # the scale harness counts the store's operations; the stragglers' lines go there too
        self.store = self.wrap_store(store) if self.wrap_store else store
        known = self.facts.known()
        spec = known.spec or cfg.spec().to_json()
        self.store.set(protocol.SPEC, spec)
        try:  # before any worker: a busy port stops nothing
            stop_metrics = serve_metrics(self, self.log)
        except OSError as exc:
            raise JobFailed(str(exc)) from None
        self.record.t_start = time.time()
        if known.gen >= 0:
            self.resume(take_over(self.store, self.pool, self.facts, known, self.log))
        else:
            self.facts.record_spec(spec)
            if self.facts.durable:  # the first holder of the role: where the job began
                self.moves = [dict(self.facts.taking, start=True)]
                self.facts.record_move(self.moves[0])
            self.first_generation()
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
        self.record.say_recoveries()
        return self.record.report()

    def depose(self, why: str) -> None:
        """Its role was lost (leadership.py, from the lease's thread): it stops at once and
        changes nothing more."""
        self.deposed = why

    def _watch(self) -> None:
        """Every wake-up (an exit, or poll_s): exits. Every poll_s: reported errors, hung
        workers (every beats_every_s), silent nodes, then preemption, refills and the end."""
        store_checks, beat_reads = policy.Every(self.cfg.poll_s), policy.Every(D.beats_every_s)
        losses = self.losses
        while True:
            self.pool.sleep(list(self.ranks), self.cfg.poll_s)
            if self.deposed:
                raise Deposed(self.deposed)
            lost = [(w, False) for w in losses.exited()]
            now = time.time()
            checks = store_checks.due(now)
            if checks:
                lost += losses.reported_errors(lost)
                lost += losses.accused(lost)
                if not lost and beat_reads.due(now):
                    lost += losses.hung()
                    if not lost:
                        lost += losses.slow()
                lost += losses.silent_nodes(lost)
            if lost:
                self.replacer.handle(lost)
                # the failures on record at once: a takeover a moment from now still lists them
                self.record.tick(force=True)
            if checks and self._tick():
                return

    def _tick(self) -> bool:
        """The loop's duties every poll_s; True once the job is over."""
        self.stops.preempt_if_asked()
        self.record.say_recoveries()
        self.record.tick()
        self.pool.replace_dead_spares(self.store.check([protocol.SHUTDOWN]), self.log)
        self.pool.refill_due()
        self.grower.grow_if_ready()
        return self.stops.finished()


__all__ = ["Supervisor", "SupervisorConfig", "JobFailed", "Failure"]
