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
     said, and evicted like a failure (cause `slow`) when a spare is ready.
What to make of what it sees (when to stop, which spare, who is hung) is decided in policy.py; the
processes are its pool's (processes.py on one machine, cluster.py over many).
"""
from __future__ import annotations

import json
import os
import time

from . import membership, policy, protocol
from .cluster import ClusterPool, pool_for
from .facts import Deposed, NoFacts
from .takeover import take_over
from .processes import Worker
from .protocol import SupervisorConfig
from .health import fit_spares
from .prometheus import serve_metrics
from .report import Failure, new_recoveries, run_report
from .stragglers import Stragglers

D = protocol.DEFAULTS


class JobFailed(RuntimeError):
    """The run stopped; `report` holds what it had done (steps, failures, their errors)."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report


class Supervisor:
    """Owns the store, the membership (which worker holds which rank, generation by generation)
    and the failure records; the processes themselves belong to its pool."""

    def __init__(self, cmd: list[str], cfg: SupervisorConfig, env: dict | None = None, log=print,
                 on_start=None, wrap_store=None, on_straggler=None, facts=None):
        self.cfg = cfg
        # what must outlive this process (facts.py): in etcd under coordinator=etcd, where the
        # next holder of the role takes over from it; nowhere on one machine
        self.facts = facts or NoFacts()
        self.moves: list[dict] = []  # the coordinator's moves (takeovers) in this job
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
        self._reported: set[int] = set()  # failures whose recovery was said
        self.store = None
        self.port = 0
        self.t_start = 0.0
        self.pids_at_start: dict[int, int] = {}
        self.stop_asked: str | None = None  # why the job was asked to stop (a signal)
        self.preempted_at: int | None = None  # the step before which every rank stopped
        self.stragglers = Stragglers(cfg, log, on_straggler)
        self._notices = 0  # notices written (protocol.notice_key)
        self._unhealthy_said: dict[int, str] = {}  # spare -> why it was last said unfit

    def active_pids(self) -> dict[int, int]:
        """rank -> pid of the worker holding it now."""
        return {w.rank: w.proc.pid for wid, w in list(self.workers.items())
                if wid in self.ranks and w.alive()}

    def _stop_if(self, message: str | None) -> None:
        """Stop the run with a policy rule's message, if it has one."""
        if message:
            raise JobFailed(message, self._report())

    # ---- main loop -----------------------------------------------------------------------
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
            take_over(self, known)
        else:
            self.facts.record_spec(spec)
            if self.facts.durable:  # the first holder of the role: where the job began
                self.moves = [dict(self.facts.taking, start=True)]
                self.facts.record_move(self.moves[0])
            for w in self.pool.start(self.store):
                self.ranks[w.wid] = w.rank
            self.pids_at_start = {w.rank: w.proc.pid for w in self.workers.values()
                                  if w.rank >= 0}
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
                time.sleep(0.05)
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
                if not lost and beat_reads.due(now):
                    lost += self._hung()
                    if not lost:
                        lost += self._slow()
                lost += self._silent_nodes(lost)
            if lost:
                self._handle(lost)
            if checks and self._tick():
                return

    def _exited(self) -> list[Worker]:
        """Ranks' workers that exited before they were done: lost. One that died after its
        result was in (killed on its way out) is lost only while some other rank's result is
        still missing, a moment later (those ranks may need it again, job.finish); once every
        result is in, it finished."""
        self.pool.refresh()
        out = []
        for wid in list(self.ranks):
            w = self.workers[wid]
            if w.alive() or wid in self.killed_after_done or \
                    self.store.check([protocol.done_key(wid)]):
                continue
            if self.store.check([protocol.result_key(self.ranks[wid])]):
                if membership.results_in(self.store, self.cfg.nproc):
                    self.killed_after_done.append(wid)
                    continue
                seen = self._exit_seen.setdefault(wid, time.time())
                if time.time() - seen < D.result_grace_s:
                    continue
            out.append(w)
        return out

    def _reported_errors(self, lost) -> list[tuple[Worker, bool]]:
        """Workers that reported an exception of their own: killed at once, no need to wait."""
        errors = membership.counter(self.store, protocol.ERRORS)
        if errors == self._errors_seen:
            return []
        self._errors_seen, out = errors, []
        for wid in list(self.ranks):
            w = self.workers[wid]
            if self.store.check([protocol.error_key(wid)]) and all(w is not x for x, _ in lost):
                self.pool.kill(w)
                out.append((w, False))
        return out

    def _hung(self) -> list[tuple[Worker, bool]]:
        """Judged from the heartbeats of every active worker (a node's agent reports its own,
        and which of its processes are stopped: only that node's /proc shows it)."""
        active = {wid: self.workers[wid] for wid in self.ranks}
        beats = self.pool.beats(list(active))
        self.stragglers.note(beats)
        hung = policy.find_hung(beats, self.cfg.heartbeat_timeout_s,
                                time.time(), stopped=lambda wid: self.pool.stopped(active[wid]))
        return [(active[wid], True) for wid in hung]

    def _slow(self) -> list[tuple[Worker, bool]]:
        """Stragglers to evict (stragglers.py judges them from the beats `_hung` read). One is
        asked to leave at the next step boundary but one (a notice every worker learns of): it
        exits there, the others wait there for the plan that gives its rank to a spare, and no
        step is cut short. One that has not left within stragglers.LEAVE_S (it missed the
        notice, or a failure moved the job on) is killed, as a slow node's ranks are at once:
        the node is fenced, so that its ranks move together to a spare node."""
        active = {wid: self.workers[wid] for wid in self.ranks}
        evict, nodes = self.stragglers.judge(
            active, self._job_step,
            lambda: len(self._healthy(self.pool.spares(self.store, ready=True))),
            self.pool.remote if self.cluster else None)
        for k in nodes:
            self.pool.fence(k, "slow: every rank of the node is a straggler")
        out = [(w, False) for w in evict if w.node in nodes]
        for w in evict:
            if w.node not in nodes:  # as for a preemption, two steps on: all learn of it first
                self.stragglers.ask_to_leave(w, self._job_step() + 2, self.gen, self._notice)
        return out + [(self.workers[wid], False) for wid in self.stragglers.overdue(self.ranks)]

    def _silent_nodes(self, lost) -> list[tuple[Worker, bool]]:
        out = []
        for node in self.pool.fence_silent_nodes():  # each said in the log
            out += [(w, False) for w in self._exited() if w.node == node
                    and all(w is not x for x, _ in lost + out)]
        return out

    def _tick(self) -> bool:
        """The loop's duties every poll_s; True once the job is over."""
        self._preempt_if_asked()
        self._say_recoveries()
        self.pool.replace_dead_spares(self.store.check([protocol.SHUTDOWN]), self.log)
        self.pool.refill_due()
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

    # ---- a failure -----------------------------------------------------------------------
    def _handle(self, lost: list[tuple[Worker, bool]]) -> None:
        # the record first: survivors whose collective failed are waiting for it (failures.py)
        self.store.add(protocol.LOST, len(lost))
        # failures often come together (a node, a switch): give the others a moment to show,
        # so that one new generation replaces them all
        t_seen = time.time()
        time.sleep(D.gather_window_s)
        seen = {w.wid for w, _ in lost}
        more = [w for w in self._exited() if w.wid not in seen]
        if more:
            self.store.add(protocol.LOST, len(more))
        lost += [(w, False) for w in more]
        for w, hung in lost:
            code = w.proc.returncode
            self._stop_if(policy.startup_failure(w.wid, w.rank, code,
                                                 self.store.check([protocol.ready_key(w.wid)])))
            self._stop_if(policy.clean_exit(w.wid, w.rank, code, hung, w.node_lost))
        for w, _ in lost:  # hung ones, and the children of dead ones (their sockets too)
            self.pool.kill(w)
        for w, hung in lost:
            self._record_failure(w, hung, t_seen)
        self._replace([f for f in self.failures if f.gen < 0])

    def _record_failure(self, w: Worker, hung: bool, now: float) -> Failure:
        """Take a lost worker out of the membership, say so, and stop if nothing is left."""
        err = protocol.read_json(self.store, protocol.error_key(w.wid))
        fault = protocol.read_json(self.store, protocol.fault_time_key(w.wid))
        # the step the job was in: a worker's newest beat can be one step old when it dies (its
        # reporter thread had not yet written it), so the others' progress counts too
        beat = self.pool.beats([w.wid]).get(w.wid)
        diverged = self.store.check([protocol.diverged_key(w.wid)])
        slow = self.stragglers.evicted(w.wid)
        if slow and not fault:  # slowed from outside: it began with its first slow step
            fault = self.stragglers.began(self.store, w.wid)
        f = Failure(wid=w.wid, rank=w.rank,
                    cause=policy.cause(w.node_lost, hung, diverged, err, slow),
                    t_fail=fault["t"] if fault else w.lost_at or now, t_detect=now,
                    step=max(beat["step"] if beat else 0, self._job_step()),
                    error=err["error"] if err else None, node=w.node)
        self.failures.append(f)
        where = f", node {w.node}" if self.cluster else ""
        code = w.proc.returncode
        self.log(f"[checkpointless] rank {w.rank} lost ({f.cause}, worker {w.wid}{where}, "
                 f"exit code {code}) at step {f.step}; detected "
                 f"{f.t_detect - f.t_fail:.2f} s after the " +
                 ("slowdown began" if slow and fault else "failure"))
        if f.error:
            self.log(f"[checkpointless] rank {w.rank} raised:\n{f.error.rstrip()}")
        del self.ranks[w.wid]
        w.rank = -2
        if w.took_over_gen is not None:  # a replacement: did it complete a step?
            stepped = any(self.store.check([protocol.first_commit_key(g, f.rank)])
                          for g in range(w.took_over_gen, self.gen + 1))
            crashes = policy.crashes_after(self._crashes.get(f.rank, 0), stepped)
            self._crashes[f.rank] = crashes
            self._stop_if(policy.crash_loop(f.rank, crashes, self.cfg.max_replacement_failures,
                                            f.error, code))
        self._stop_if(policy.disabled(self.cfg.enabled, f.rank, w.wid, f.cause, code))
        self._stop_if(policy.escalation(self.failures, f))
        self._stop_if(policy.none_left(len(self.ranks),
                                       [g.error for g in self.failures if g.error]))
        return f

    def _job_step(self) -> int:
        """The step the job is at: the furthest of the active workers' heartbeats, or the step
        after rank 0's newest committed one (heartbeats from other nodes come at most one
        health record late)."""
        last = protocol.read_json(self.store, protocol.LAST_STEP)  # an integer, or None
        return max(policy.job_step(self.pool.beats(list(self.ranks)).values()),
                   0 if last is None else last + 1)

    def _replace(self, pending: list[Failure]) -> None:
        """Give each lost rank to a ready spare, waiting for one (the refill) if none is ready."""
        cfg = self.cfg
        if cfg.refill:
            # With spares enough for now, the refill starts a little later: its imports would
            # otherwise compete for CPU with the recovery itself.
            later = len(self.pool.spares(self.store, ready=True)) >= len(pending)
            for f in pending:
                self.pool.refill(self.workers[f.wid], later)
        t0, said = time.time(), False
        while (spares := self._choose_spares(pending)) is None:
            ready = self.pool.spares(self.store, ready=True)
            self._stop_if(policy.no_spare_left(
                len(pending), len(self.pool.spares(self.store, ready=False)), cfg.spares,
                cfg.refill))
            if not said:
                self.log(f"[checkpointless] waiting up to {cfg.spare_wait_s:.0f} s for a "
                         f"spare to warm up ({len(ready)} ready, {len(pending)} needed)")
                said = True
            self._stop_if(policy.spare_wait_over(time.time() - t0, cfg.spare_wait_s))
            for w in self._exited():  # another active worker may fail meanwhile: fold it in
                self.store.add(protocol.LOST, 1)
                self.pool.kill(w)  # its children, if any, hold its connections
                self._record_failure(w, False, time.time())
                self.pool.refill(w, later=False)
                pending = [f for f in self.failures if f.gen < 0]
            time.sleep(D.spare_poll_s)
        t = time.time()
        for f, spare in zip(pending, spares):
            spare.rank = f.rank
            self.ranks[spare.wid] = f.rank
            f.t_spare, f.new_wid, f.new_node = t, spare.wid, spare.node
        self._publish()
        for f, spare in zip(pending, spares):
            f.gen = spare.took_over_gen = self.gen

    def _choose_spares(self, pending: list[Failure]) -> list[Worker] | None:
        lost = [self.workers[f.wid] for f in pending]
        return policy.choose_spares(self._healthy(self.pool.spares(self.store, ready=True)),
                                    [(w.node, w.slot) for w in lost],
                                    self.pool.lost_node_ids(), self.pool.spare_node_ids())

    def _healthy(self, ready: list[Worker]) -> list[Worker]:
        """The ready spares whose newest health check passed (health.fit_spares)."""
        return fit_spares(self.store, ready, self._unhealthy_said, self.log)

    def _publish(self) -> None:
        """The next generation's plan: what changed since the last one, node by node."""
        self.gen += 1
        plan = membership.Plan(gen=self.gen, world_size=self.cfg.nproc, ranks=dict(self.ranks),
                               lost=membership.counter(self.store, protocol.LOST),
                               nodes={wid: self.workers[wid].node for wid in self.ranks})
        self.facts.record_plan(plan, plan.lost, self.pool._next_wid)  # etcd first: a takeover
        membership.publish(self.store, plan, self._plan)  # finds every published plan there
        self._plan = plan

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
        self._notice(kind="preempt", before_step=stop)
        self.log(f"[checkpointless] {self.stop_asked}: stopping every rank before step {stop}")

    def _notice(self, **notice) -> None:
        """A notice every worker's watch learns of (protocol.notice_key), in order."""
        self.store.set(protocol.notice_key(self._notices), json.dumps(notice))
        self._notices += 1
        self.facts.record_notices(self._notices)

    # ---- reporting -----------------------------------------------------------------------
    def _say_recoveries(self) -> None:
        for line in new_recoveries(self.store, self.failures, self._reported, self.cfg.nproc,
                                   self.gen):
            self.log(line)

    def _report(self) -> dict:
        return run_report(self.store, self.cfg.nproc, self.cfg.spares,
                          time.time() - self.t_start, self.failures, self.gen,
                          list(self.workers.values()), self.pids_at_start,
                          self.killed_after_done, self.stragglers.entries,
                          self.stragglers.summary())


__all__ = ["Supervisor", "SupervisorConfig", "JobFailed", "Failure"]
