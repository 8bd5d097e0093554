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
  5. a used spare is replaced in the background (`refill`).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from . import detection, membership, protocol
from .processes import Worker, WorkerPool
from .report import Failure, recovery_entry, recovery_line, run_report

D = protocol.DEFAULTS


@dataclass
class SupervisorConfig:
    """What the supervisor is asked to run: world size, spares, timeouts, faults, replication."""
    nproc: int
    spares: int = D.spares
    refill: bool = D.refill
    heartbeat_timeout_s: float = D.heartbeat_timeout_s
    backend: str = "gloo"
    host: str = "127.0.0.1"
    port: int = 0
    seed: int = 0
    faults: list = field(default_factory=list)
    pg_timeout_s: float = D.pg_timeout_s
    spare_wait_s: float = D.spare_wait_s
    confirm_s: float = D.confirm_s
    max_replacement_failures: int = D.max_replacement_failures
    consistency_every: int = D.consistency_every
    # longest sleep of the monitoring loop; process exits wake it at once (pidfd), so this only
    # paces the store checks (reported errors, heartbeats)
    poll_s: float = 0.1
    # niceness of a refill while it warms up. Lockstep workers lose the same CPU time to a
    # warm-up whatever its priority; a low one only stretches it (nice 10 behind 4 busy workers
    # on 2 cores: minutes), leaving the job without a spare for longer. So none by default.
    refill_nice: int = 0
    enabled: bool = True
    # many machines (nodes.py): active nodes of nproc / nodes workers (+ `spares` each), spare
    # nodes of as many spares, a node lost after node_timeout_s of silence
    nodes: int = 1
    spare_nodes: int = 0
    standalone: bool = False  # no workers here: every node, 0 included, has its own agent
    node_timeout_s: float = D.node_timeout_s
    replication: dict = field(default_factory=lambda: {
        "factor": D.replication_factor, "interval": D.replication_interval, "offset": 1})


class JobFailed(RuntimeError):
    """The run stopped; `report` holds what it had done (steps, failures, their errors)."""

    def __init__(self, message: str, report: dict | None = None):
        super().__init__(message)
        self.report = report


class Supervisor:
    """Owns the store, the membership (which worker holds which rank, generation by generation)
    and the failure records; the processes themselves belong to its WorkerPool."""

    def __init__(self, cmd: list[str], cfg: SupervisorConfig, env: dict | None = None, log=print,
                 on_start=None):
        self.cfg = cfg
        self.log = log
        self.on_start = on_start
        env = dict(os.environ if env is None else env)
        self.cluster = cfg.nodes > 1 or cfg.spare_nodes > 0 or cfg.standalone
        if self.cluster:
            from .nodes import ClusterPool
            per_node = cfg.nproc // cfg.nodes
            self.pool = ClusterPool(cmd, env, cfg.host, per_node, cfg.refill_nice, cfg.nodes,
                                    cfg.spare_nodes, per_node, cfg.spares, cfg.node_timeout_s,
                                    log=log, local=not cfg.standalone)
        else:
            self.pool = WorkerPool(cmd, env, cfg.host, spares_from_slot=cfg.nproc,
                                   refill_nice=cfg.refill_nice)
        self.workers = self.pool.workers
        self.failures: list[Failure] = []
        self.gen = -1
        self.ranks: dict[int, int] = {}  # active worker id -> rank
        self._refills: list[tuple[float, Worker]] = []  # (when, lost worker) of delayed refills
        self.killed_after_done: list[int] = []  # workers killed once their result was in
        self._exit_seen: dict[int, float] = {}  # when a worker that left a result was seen dead
        self._crashes: dict[int, int] = {}  # rank -> its replacements lost before a first step
        self.store = None
        self.port = 0
        self.stop_asked: str | None = None  # why the job was asked to stop (a signal)
        self.preempted_at: int | None = None  # the step before which every rank stopped

    def active_pids(self) -> dict[int, int]:
        """rank -> pid of the worker holding it now."""
        return {w.rank: w.proc.pid for wid, w in list(self.workers.items())
                if wid in self.ranks and w.alive()}

    # ---- membership ----------------------------------------------------------------------
    def _publish(self) -> None:
        self.gen += 1
        plan = membership.Plan(gen=self.gen, world_size=self.cfg.nproc, ranks=dict(self.ranks),
                               lost=membership.counter(self.store, protocol.LOST))
        membership.publish(self.store, plan)

    def _exited(self) -> list[Worker]:
        """Ranks' workers that exited before they were done: lost. One that died after its
        result was in (killed on its way out) is lost only while some other rank's result is
        still missing, a moment later (those ranks may need it again, job.finish); once every
        result is in, it finished."""
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
            if not self.store.check([protocol.ready_key(w.wid)]):
                self._stop(f"worker {w.wid} (rank {w.rank}) exited with code "
                           f"{w.proc.returncode} before it finished starting up; its output "
                           "above says why. A start-up failure is a bug, not a fault to recover "
                           "from")
            if not hung and not w.node_lost and w.proc.returncode == 0:
                self._stop(f"worker {w.wid} (rank {w.rank}) exited with code 0 without calling "
                           "job.finish() (accelerator.end_training()): a clean exit before the "
                           "job finished is a script that left its loop, not a fault a spare "
                           "could recover from. Call job.finish() (accelerator.end_training()) "
                           "at the end of the script, on every rank")
        for w, _ in lost:  # hung ones, and the children of dead ones (their sockets too)
            self.pool.kill(w)
        for w, hung in lost:
            self._record_failure(w, hung, t_seen)
        self._replace([f for f in self.failures if f.gen < 0])

    def _record_failure(self, w: Worker, hung: bool, now: float) -> Failure:
        """Take a lost worker out of the membership, say so, and stop if nothing is left."""
        err = self.store.get(protocol.error_key(w.wid)) \
            if self.store.check([protocol.error_key(w.wid)]) else None
        fault = self.store.get(protocol.fault_time_key(w.wid)) \
            if self.store.check([protocol.fault_time_key(w.wid)]) else None
        beat = detection.read_beat(self.store, w.wid)
        diverged = self.store.check([protocol.diverged_key(w.wid)])
        cause = "node_lost" if w.node_lost else "hang" if hung else "diverged" if diverged \
            else "error" if err else "exit"
        f = Failure(wid=w.wid, rank=w.rank, cause=cause,
                    t_fail=json.loads(fault)["t"] if fault else w.lost_at or now, t_detect=now,
                    step=beat["step"] if beat else self._job_step(),
                    error=json.loads(err)["error"] if err else None)
        self.failures.append(f)
        f.node = w.node
        where = f", node {w.node}" if self.cluster else ""
        self.log(f"[checkpointless] rank {w.rank} lost ({f.cause}, worker {w.wid}{where}, "
                 f"exit code {w.proc.returncode}) at step {f.step}; detected "
                 f"{f.t_detect - f.t_fail:.2f} s after the failure")
        if f.error:
            self.log(f"[checkpointless] rank {w.rank} raised:\n{f.error.rstrip()}")
        del self.ranks[w.wid]
        w.rank = -2
        self._check_crash_loop(w, f)
        if not self.cfg.enabled:
            self._stop(f"rank {f.rank} (worker {w.wid}) failed ({f.cause}, exit code "
                       f"{w.proc.returncode}) and checkpointless is off: the run stops here")
        self._escalate(f)
        if not self.ranks:
            errors = [g.error for g in self.failures if g.error]
            first = errors[0].rstrip().splitlines()[-1] if errors else "see the output above"
            self._stop("every active worker failed at once: no healthy peer holds the training "
                       f"state, so there is nothing to recover from. The first error: {first}")
        return f

    def _job_step(self) -> int:
        """The step the job is at, from the active workers' heartbeats (for a worker that died
        before its first beat, such as a replacement failing at start-up)."""
        beats = [detection.read_beat(self.store, wid) for wid in self.ranks]
        return max((b["step"] for b in beats if b), default=0)

    def _check_crash_loop(self, w: Worker, f: Failure) -> None:
        """A replacement that dies before its first step, again and again, is a bug (a collective
        in its start-up the others do not join, a bad device): stop with its own error."""
        if w.took_over_gen is None:
            return
        stepped = any(self.store.check([protocol.first_commit_key(g, f.rank)])
                      for g in range(w.took_over_gen, self.gen + 1))
        self._crashes[f.rank] = 0 if stepped else self._crashes.get(f.rank, 0) + 1
        if self._crashes[f.rank] >= self.cfg.max_replacement_failures:
            why = f.error.rstrip() if f.error else f"exit code {w.proc.returncode}; its output " \
                "above says why"
            self._stop(f"the replacement for rank {f.rank} failed before completing its first "
                       f"step {self._crashes[f.rank]} times in a row (checkpointless."
                       f"max_replacement_failures={self.cfg.max_replacement_failures}): this is "
                       f"a bug, not bad luck. The last one's error:\n{why}")

    def _escalate(self, f: Failure) -> None:
        """An error that strikes again at the same step is a bug, not a fault: stop."""
        same = [g for g in self.failures if g is not f and g.cause == "error" == f.cause
                and g.step == f.step]
        if same:
            last = (f.error or "").rstrip().splitlines()[-1:] or ["(no message)"]
            self._stop(f"step {f.step} raised an error again after a recovery (ranks "
                       f"{same[0].rank} and {f.rank}): this is a bug in the step, not a "
                       f"transient fault. The error: {last[0]}")

    def _replace(self, pending: list[Failure]) -> None:
        """Give each lost rank to a ready spare, waiting for one (the refill) if none is ready."""
        if self.cfg.refill:
            # With spares enough for now, the refill starts a little later: its imports would
            # otherwise compete for CPU with the recovery itself.
            later = len(self.pool.spares(self.store, ready=True)) >= len(pending)
            for f in pending:
                self._refill(self.workers[f.wid], later)
        deadline = time.time() + self.cfg.spare_wait_s
        said = False
        while True:
            spares = self.pool.choose_spares(
                self.store, [(self.workers[f.wid].node, self.workers[f.wid].slot) for f in pending])
            if spares is not None:
                break
            spares = self.pool.spares(self.store, ready=True)
            if not self.pool.spares(self.store, ready=False):
                self._stop(f"{len(pending)} rank(s) lost and no spare left (checkpointless."
                           f"spares={self.cfg.spares}, refill={self.cfg.refill}); the run stops "
                           "here. Raise checkpointless.spares or enable checkpointless.refill")
            if not said:
                self.log(f"[checkpointless] waiting up to {self.cfg.spare_wait_s:.0f} s for a "
                         f"spare to warm up ({len(spares)} ready, {len(pending)} needed)")
                said = True
            if time.time() > deadline:
                self._stop(f"no spare became ready within checkpointless.spare_wait_s="
                           f"{self.cfg.spare_wait_s:g} s; the run stops here. Raise it if spares "
                           "start slowly on this machine")
            for w in self._exited():  # another active worker may fail meanwhile: fold it in
                self.store.add(protocol.LOST, 1)
                self.pool.kill(w)  # its children, if any, hold its connections
                self._record_failure(w, False, time.time())
                self._refill(w, later=False)
                pending = [f for f in self.failures if f.gen < 0]
            time.sleep(0.05)
        t = time.time()
        for f, spare in zip(pending, spares):
            spare.rank = f.rank
            self.ranks[spare.wid] = f.rank
            f.t_spare, f.new_wid, f.new_node = t, spare.wid, spare.node
        self._publish()
        for f, spare in zip(pending, spares):
            f.gen = spare.took_over_gen = self.gen

    def _refill(self, w: Worker, later: bool) -> None:
        if not self.cfg.refill or w.refilled:
            return
        w.refilled = True
        if later:
            self._refills.append((time.time() + D.refill_delay_s, w))
        else:
            self.pool.respawn(w)

    def _refill_dead_spares(self) -> None:
        """A spare that died while waiting is replaced too."""
        for w in list(self.workers.values()):
            if w.rank == -1 and not w.alive() and not w.gone_seen:
                w.gone_seen = True
                if self.store.check([protocol.SHUTDOWN]) or w.node_lost:
                    continue
                self.log(f"[checkpointless] spare worker {w.wid} exited (code "
                         f"{w.proc.returncode})" + ("; starting another" if self.cfg.refill else ""))
                if self.cfg.refill:
                    self.pool.respawn(w)
        for r in [r for r in self._refills if r[0] <= time.time()]:
            self._refills.remove(r)
            self.pool.respawn(r[1])

    # ---- main loop -----------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        self.store = dist.TCPStore(cfg.host, cfg.port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=60))
        self.port = self.pool.port = self.store.port
        spec = protocol.Spec(backend=cfg.backend, seed=cfg.seed, faults=cfg.faults,
                             heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                             pg_timeout_s=cfg.pg_timeout_s, confirm_s=cfg.confirm_s,
                             consistency_every=cfg.consistency_every,
                             replication=cfg.replication,
                             workers_per_node=cfg.nproc // cfg.nodes + cfg.spares,
                             ranks_per_node=cfg.nproc // cfg.nodes)
        self.store.set(protocol.SPEC, spec.to_json())
        self.t_start = time.time()
        if self.cluster:
            self._start_cluster()
        else:
            for slot in range(cfg.nproc + cfg.spares):
                w = self.pool.spawn(slot)
                if slot < cfg.nproc:
                    w.rank = slot
                    self.ranks[w.wid] = slot
        self.pids_at_start = {w.rank: w.proc.pid for w in self.workers.values() if w.rank >= 0}
        self._publish()
        if self.on_start:
            self.on_start(self)
        self._reported: set[int] = set()
        try:
            self._watch()
        finally:
            self.store.set(protocol.SHUTDOWN, "1")
            time.sleep(0.05)
            self.pool.stop_all()
        self._say_recoveries()
        return self._report()

    def request_stop(self, why: str) -> None:
        """From a signal handler (SIGTERM, SIGINT): stop the job at the next step boundary."""
        self.stop_asked = why

    def _preempt(self) -> None:
        """Ask every rank to stop before the step after the one in flight: the lead step's
        ranks finish it, every rank stops at the same boundary (where the loop may write a
        durable checkpoint, a collective), reports done, and the run ends as preempted."""
        beats = [detection.read_beat(self.store, wid) for wid in self.ranks]
        stop = max((b["step"] for b in beats if b), default=0) + 1
        self.preempted_at = stop
        self.store.set(protocol.PREEMPT, str(stop))
        self.log(f"[checkpointless] {self.stop_asked}: stopping every rank before step {stop}")

    def _start_cluster(self) -> None:
        """Every node's agent joins; then each active node K starts ranks K*P..K*P+P-1 in its
        slots 0..P-1 and its own spares after them, and each spare node P spares."""
        cfg, pool = self.cfg, self.pool
        pool.store = self.store
        pool.wait_for_nodes(cfg.spare_wait_s)
        per_node = cfg.nproc // cfg.nodes
        for node in range(cfg.nodes + cfg.spare_nodes):
            spare_node = node >= cfg.nodes
            for slot in range(per_node if spare_node else per_node + cfg.spares):
                active = not spare_node and slot < per_node
                w = pool.spawn_on(node, slot, spare=not active)
                if active:
                    w.rank = node * per_node + slot
                    self.ranks[w.wid] = w.rank
        self.log(f"[checkpointless] {cfg.nodes} node(s) x {per_node} workers "
                 f"(+{cfg.spares} spare(s) each) and {cfg.spare_nodes} spare node(s) started")

    def _watch(self) -> None:
        cfg = self.cfg
        errors_seen = 0
        next_slow = next_beats = 0.0
        while True:
            self.pool.sleep(list(self.ranks), cfg.poll_s)
            lost = [(w, False) for w in self._exited()]  # a syscall each: every wake-up
            now = time.time()
            slow = now >= next_slow  # store checks, ten times a second
            if slow:
                next_slow = now + 0.1
                errors = membership.counter(self.store, protocol.ERRORS)
                if errors != errors_seen:
                    errors_seen = errors
                    for wid in list(self.ranks):
                        w = self.workers[wid]
                        if self.store.check([protocol.error_key(wid)]) and \
                                all(w is not x for x, _ in lost):
                            self.pool.kill(w)  # it reported its exception: no need to wait
                            lost.append((w, False))
            if not lost and slow and now >= next_beats:
                next_beats = now + 0.5
                active = {wid: self.workers[wid] for wid in self.ranks}
                beats = {wid: detection.read_beat(self.store, wid) for wid in active}
                # a stopped process can be seen in /proc only on this node
                pids = {wid: -1 if self.cluster and self.pool.remote(w.node) else w.proc.pid
                        for wid, w in active.items()}
                for wid in detection.find_hung(beats, pids, cfg.heartbeat_timeout_s):
                    lost.append((active[wid], True))
            if self.cluster and slow:
                for node in self.pool.lost_nodes():
                    self.log(f"[checkpointless] node {node} lost: its launcher has been silent "
                             f"for {cfg.node_timeout_s:g} s; its workers fail together and the "
                             "node is fenced")
                    lost += [(w, False) for w in self._exited() if w.node == node
                             and all(w is not x for x, _ in lost)]
            if lost:
                self._handle(lost)
            if not slow:
                continue
            if self.preempted_at is None and (self.stop_asked or self.store.check(
                    [protocol.PREEMPT_ASK])):
                self.stop_asked = self.stop_asked or self.store.get(
                    protocol.PREEMPT_ASK).decode()
                self._preempt()
            self._say_recoveries()
            self._refill_dead_spares()
            gone = set(self.killed_after_done)
            if membership.counter(self.store, protocol.DONE) + len(gone) >= len(self.ranks) and \
                    all(wid in gone or self.store.check([protocol.done_key(wid)])
                        for wid in self.ranks):
                for wid in self.ranks:
                    self.workers[wid].proc.wait()
                codes = {wid: self.workers[wid].proc.returncode for wid in self.ranks}
                # killed by a signal once its result was in (a node going down as the job
                # ends): every rank's result and state are reported, nothing is lost. An exit
                # with an error of its own after finish() is the script's failure.
                killed = sorted(wid for wid, c in codes.items() if c is not None and c < 0)
                bad = sorted(wid for wid, c in codes.items() if c is not None and c > 0)
                if bad:
                    self._stop(f"workers {bad} reported done but exited non-zero "
                               f"(exit codes {[codes[w] for w in bad]})")
                if killed:
                    self.killed_after_done = killed
                    self.log(f"[checkpointless] workers {killed} were killed (signals "
                             f"{[-codes[w] for w in killed]}) after reporting their results; "
                             "every rank's result is in, so the run stands")
                return

    def _stop(self, message: str):
        raise JobFailed(message, self._report())

    # ---- reporting -----------------------------------------------------------------------
    def _say_recoveries(self) -> None:
        for i, f in enumerate(self.failures):
            if i in self._reported or f.gen < 0:
                continue
            e = recovery_entry(self.store, f, self.cfg.nproc, self.gen)
            if e is not None:
                self._reported.add(i)
                self.log(recovery_line(e))

    def _report(self) -> dict:
        report = run_report(self.store, self.cfg.nproc, self.cfg.spares,
                            time.time() - self.t_start, self.failures, self.gen,
                            list(self.workers.values()))
        report["pids_at_start"] = self.pids_at_start
        if self.killed_after_done:
            report["killed_after_done"] = self.killed_after_done
        return report


__all__ = ["Supervisor", "SupervisorConfig", "JobFailed", "Failure"]
