"""When the run stops: policy.py's stop rules applied to what the supervisor saw (a worker that
never started, a clean exit, a replacement crash loop, escalation, no spare left), a stop asked
from outside (a preemption, at a step boundary every rank learns of first), and the end once
every rank is done. A rule that fires raises JobFailed with the run's report."""
from __future__ import annotations

from typing import Callable

from ..protocol import membership
from . import policy
from .. import protocol
from .job_state import JobState, Notices
from .processes import Worker
from .report import Failure


class JobFailed(RuntimeError):
    """The run stopped; `report` holds what it had done (steps, failures, their errors)."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report


class StopRules:
    """Reads the job's `state` and its `pool`'s processes; `report()` is the run's report as of
    now (for JobFailed); a preemption is announced through `notices`."""

    def __init__(self, cfg, state: JobState, pool, notices: Notices,
                 report: Callable[[], dict], log=print):
        self.cfg, self.state, self.pool, self.notices = cfg, state, pool, notices
        self.report, self.log = report, log
        self.crashes: dict[int, int] = {}  # rank -> its replacements lost before a first step

    def check(self, message: str | None) -> None:
        """Stop the run with a policy rule's message, if it has one."""
        if message:
            raise JobFailed(message, self.report())

    # ---- on a loss -----------------------------------------------------------------------
    def on_loss(self, w: Worker, hung: bool) -> None:
        """A lost worker that never finished starting up, or that exited cleanly, ends the run
        (what a spare would do again, or what no failure explains)."""
        store = self.state.store
        stop = store.get(protocol.REPLAY_STOP).decode() if store.check(
            [protocol.REPLAY_STOP]) else None
        self.check(policy.replay_strict(stop))
        code = None if hung or w.node_lost else w.proc.returncode
        err = protocol.read_json(store, protocol.error_key(w.wid))
        self.check(policy.startup_failure(w.wid, w.rank, code,
                                          store.check([protocol.ready_key(w.wid)]),
                                          err and err["error"]))
        self.check(policy.clean_exit(w.wid, w.rank, w.proc.returncode, hung, w.node_lost))

    def after_loss(self, f: Failure, w: Worker, code: int | None) -> None:
        """Failure `f` of worker `w` (exit code `code`), taken out of the membership: a
        replacement's crash loop, recovery disabled, escalation, or no rank left ends the
        run."""
        if w.took_over_gen is not None:  # a replacement: did it complete a step?
            stepped = any(self.state.store.check([protocol.first_commit_key(g, f.rank)])
                          for g in range(w.took_over_gen, self.state.gen + 1))
            crashes = policy.crashes_after(self.crashes.get(f.rank, 0), stepped)
            self.crashes[f.rank] = crashes
            self.check(policy.crash_loop(f.rank, crashes, self.cfg.max_replacement_failures,
                                         f.error, code))
        self.check(policy.disabled(self.cfg.enabled, f.rank, w.wid, f.cause, code))
        stepped = protocol.read_json(self.state.store, protocol.LAST_STEP) is not None
        self.check(policy.escalation(self.state.failures, f, stepped))
        self.check(policy.none_left(len(self.state.ranks),
                                    [g.error for g in self.state.failures if g.error]))

    def no_spare_left(self, needed: int) -> None:
        """No live spare (warm or not) for `needed` lost ranks, and none coming."""
        cfg = self.cfg
        self.check(policy.no_spare_left(
            needed, len(self.pool.spares(self.state.store, ready=False)), cfg.spares,
            cfg.refill))

    def spare_wait_over(self, waited_s: float) -> None:
        self.check(policy.spare_wait_over(waited_s, self.cfg.spare_wait_s))

    def shrink_refused(self, why: str) -> None:
        self.check(policy.shrink_refused(why, self.cfg.shrink_max_hosted))

    # ---- a stop asked, and the end -------------------------------------------------------
    def request_stop(self, why: str) -> None:
        """From a signal handler (SIGTERM, SIGINT): stop the job at the next step boundary."""
        self.state.stop_asked = why

    def preempt_if_asked(self) -> None:
        """Asked (a signal here, or a node's agent), ask every rank to stop before the step
        after the one in flight: the lead step's ranks finish it, every rank stops at the same
        boundary (where the loop may write a durable checkpoint, a collective), reports done,
        and the run ends as preempted."""
        s = self.state
        if s.preempted_at is not None or not (
                s.stop_asked or s.store.check([protocol.PREEMPT_ASK])):
            return
        s.stop_asked = s.stop_asked or s.store.get(protocol.PREEMPT_ASK).decode()
        # two steps past the furthest seen: a rank may have begun the next step since its last
        # heartbeat was read, and every rank must learn of the stop before it reaches it
        stop = s.job_step(self.pool) + 2
        s.preempted_at = stop
        self.notices.send(kind="preempt", before_step=stop, why=s.stop_asked)
        self.log(f"[checkpointless] {s.stop_asked}: stopping every rank before step {stop}")

    def finished(self) -> bool:
        """Every rank reported done (or was killed on its way out, its result in)."""
        s, workers = self.state, self.pool.workers
        gone = set(s.killed_after_done)
        if membership.counter(s.store, protocol.DONE) + len(gone) < len(s.ranks) or \
                not all(wid in gone or s.store.check([protocol.done_key(wid)])
                        for wid in s.ranks):
            return False
        for wid in s.ranks:
            workers[wid].proc.wait()
        codes = {wid: workers[wid].proc.returncode for wid in s.ranks}
        self.check(policy.bad_exits(codes))
        killed = policy.killed_after_done(codes)
        if killed:
            s.killed_after_done = killed
            self.log(f"[checkpointless] workers {killed} were killed (signals "
                     f"{[-codes[w] for w in killed]}) after reporting their results; every "
                     "rank's result is in, so the run stands")
        return True
