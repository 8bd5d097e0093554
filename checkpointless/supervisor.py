"""The supervisor: starts workers and hot spares, watches them, hands a failed rank to a spare.

It owns the coordination store (a TCPStore server in this process, not in any training worker), so
it survives the loss of any worker. Its loop, every few milliseconds:
  1. a worker process that exited is a failure at once (cause `error` if it reported an exception,
     `hang` if the supervisor killed it for silence, else `exit`);
  2. an active worker whose heartbeat is silent past `heartbeat_timeout_s` while behind the others,
     or whose process is stopped, is hung: it is killed, which also releases peers blocked on it;
  3. on failure, each lost rank goes to a warm spare and a new membership generation is published;
     the workers do the rest (regroup, state transfer) and report their timings back here;
  4. a used spare is replaced in the background (`refill`).
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from . import detection, membership
from .goodput import goodput_from_steps


@dataclass
class Worker:
    wid: int
    proc: subprocess.Popen
    slot: int
    started: float
    rank: int = -1  # -1 while a spare
    pidfd: int | None = None  # readable once the process has exited (Linux 5.3+)


@dataclass
class Failure:
    wid: int
    rank: int
    cause: str
    t_fail: float
    t_detect: float
    step: int
    gen: int = -1  # the generation that replaced it
    t_spare: float = 0.0  # when a spare was available
    new_wid: int = -1


@dataclass
class SupervisorConfig:
    nproc: int
    spares: int = 1
    refill: bool = True
    heartbeat_timeout_s: float = 10.0
    backend: str = "gloo"
    host: str = "127.0.0.1"
    port: int = 0
    seed: int = 0
    faults: list = field(default_factory=list)
    pg_timeout_s: float = 300.0
    spare_wait_s: float = 600.0
    # longest sleep of the monitoring loop; process exits wake it at once (pidfd), so this only
    # paces the store checks (reported errors, heartbeats)
    poll_s: float = 0.1
    # niceness of a refill while it warms up. Lockstep workers lose the same CPU time to a
    # warm-up whatever its priority; a low one only stretches it (nice 10 behind 4 busy workers
    # on 2 cores: minutes), leaving the job without a spare for longer. So none by default.
    refill_nice: int = 0
    enabled: bool = True
    replication: dict = field(default_factory=lambda: {"factor": 2, "interval": 1, "offset": 1})


class JobFailed(RuntimeError):
    pass


class Supervisor:
    def __init__(self, cmd: list[str], cfg: SupervisorConfig, env: dict | None = None, log=print,
                 on_start=None):
        self.on_start = on_start
        self.cmd = cmd
        self.cfg = cfg
        self.env = dict(os.environ if env is None else env)
        self.log = log
        self.workers: dict[int, Worker] = {}
        self.failures: list[Failure] = []
        self.gen = -1
        self.ranks: dict[int, int] = {}  # active worker id -> rank
        self._next_wid = 0
        self._refills: list[tuple[float, int]] = []  # (when, device slot) of delayed refills
        self.store = None

    # ---- processes -----------------------------------------------------------------------
    def _spawn(self, slot: int, background: bool = False) -> Worker:
        """Start a worker. A background refill warms up at `refill_nice` and takes normal
        priority when given a rank.
        Every process but the first generation's ranks starts as a spare (CL_SPARE=1)."""
        wid = self._next_wid
        self._next_wid += 1
        env = dict(self.env, CL_STORE_HOST=self.cfg.host, CL_STORE_PORT=str(self.port),
                   CL_WORKER_ID=str(wid), CL_DEVICE_SLOT=str(slot),
                   CL_SPARE="1" if background or slot >= self.cfg.nproc else "0")
        proc = subprocess.Popen(self.cmd, env=env,
                                preexec_fn=(lambda: os.nice(self.cfg.refill_nice))
                                if background and self.cfg.refill_nice else None)
        w = Worker(wid=wid, proc=proc, slot=slot, started=time.time())
        try:
            w.pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # older kernel or Python: the loop polls instead
            w.pidfd = None
        self.workers[wid] = w
        return w

    def _sleep(self, timeout_s: float) -> None:
        """Sleep until a training worker exits or `timeout_s` passes, whichever comes first.

        Waiting on pidfds costs no CPU and sees an exit the moment it happens; polling every
        20 ms cost about 1% of a core, which on a small machine is taken from training."""
        for w in self.workers.values():  # reaped: its descriptor is of no more use
            if w.pidfd is not None and w.proc.returncode is not None:
                os.close(w.pidfd)
                w.pidfd = None
        live = [self.workers[wid] for wid in self.ranks
                if self.workers[wid].proc.returncode is None]
        fds = [w.pidfd for w in live]
        if None in fds:
            time.sleep(min(timeout_s, 0.02))
            return
        if not fds:
            time.sleep(timeout_s)
            return
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        poller.poll(timeout_s * 1000)

    def _kill(self, w: Worker) -> None:
        if w.proc.poll() is None:
            try:
                w.proc.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
            w.proc.wait()

    def _ready_spares(self) -> list[Worker]:
        return [w for w in self.workers.values()
                if w.rank < 0 and w.proc.poll() is None and self.store.check([f"ready/{w.wid}"])]

    def active_pids(self) -> dict[int, int]:
        """rank -> pid of the worker holding it now."""
        return {w.rank: w.proc.pid for wid, w in list(self.workers.items())
                if wid in self.ranks and w.proc.poll() is None}

    def _live_spares(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.rank < 0 and w.proc.poll() is None]

    # ---- membership ----------------------------------------------------------------------
    def _publish(self) -> None:
        self.gen += 1
        plan = membership.Plan(gen=self.gen, world_size=self.cfg.nproc, ranks=dict(self.ranks))
        membership.publish(self.store, plan)

    def _cause(self, w: Worker, hung: bool) -> str:
        if hung:
            return "hang"
        if self.store.check([f"error/{w.wid}"]):
            return "error"
        return "exit"

    def _fault_time(self, w: Worker, fallback: float) -> float:
        key = f"fault_at/{w.wid}"
        return json.loads(self.store.get(key))["t"] if self.store.check([key]) else fallback

    def _last_step(self, w: Worker) -> int:
        b = detection.read_beat(self.store, w.wid)
        return b["step"] if b else 0

    def _handle(self, lost: list[tuple[Worker, bool]]) -> None:
        # failures often come together (a node, a switch): give the others a moment to show,
        # so that one new generation replaces them all
        t_seen = time.time()
        time.sleep(0.02)
        seen = {w.wid for w, _ in lost}
        for wid in list(self.ranks):
            w = self.workers[wid]
            if wid not in seen and w.proc.poll() is not None \
                    and not self.store.check([f"done/{wid}"]):
                lost.append((w, False))
        now = t_seen
        for w, _ in lost:
            if not self.store.check([f"ready/{w.wid}"]):
                raise JobFailed(f"worker {w.wid} (rank {w.rank}) exited with code "
                                f"{w.proc.returncode} before it finished starting up; its output "
                                "above says why. A start-up failure is a bug, not a fault to "
                                "recover from")
        for w, hung in lost:
            if hung:
                self._kill(w)  # also releases the peers blocked in a collective with it
            self._record_failure(w, hung, now)
        self._replace([f for f in self.failures if f.gen < 0])

    def _record_failure(self, w: Worker, hung: bool, now: float) -> Failure:
        """Take a lost worker out of the membership, say so, and stop if nothing is left."""
        f = Failure(wid=w.wid, rank=w.rank, cause=self._cause(w, hung),
                    t_fail=self._fault_time(w, now), t_detect=now, step=self._last_step(w))
        self.failures.append(f)
        self.log(f"[checkpointless] rank {w.rank} lost ({f.cause}, worker {w.wid}, "
                 f"exit code {w.proc.returncode}) at step {f.step}; detected "
                 f"{f.t_detect - f.t_fail:.2f} s after the failure")
        del self.ranks[w.wid]
        w.rank = -2
        self._escalate(f)
        if not self.ranks:
            raise JobFailed("every active worker failed at once: no healthy peer holds the "
                            "training state, so there is nothing to recover from (see the "
                            "workers' errors above)")
        return f

    def _escalate(self, f: Failure) -> None:
        """An error that strikes again at the same step is a bug, not a fault: stop."""
        same = [g for g in self.failures if g is not f and g.cause == "error" == f.cause
                and g.step == f.step]
        if same:
            raise JobFailed(f"step {f.step} raised an error again after a recovery (ranks "
                            f"{same[0].rank} and {f.rank}): this is a bug in the step, not a "
                            "transient fault; see the traceback above")

    def _replace(self, pending: list[Failure]) -> None:
        """Give each lost rank to a ready spare, waiting for one (the refill) if none is ready."""
        if self.cfg.refill:
            # With spares enough for now, the refill starts a little later: its imports would
            # otherwise compete for CPU with the recovery itself.
            later = len(self._ready_spares()) >= len(pending)
            for f in pending:
                if not getattr(f, "_refilled", False):
                    f._refilled = True
                    if later:
                        self._refills.append((time.time() + 3.0, self.workers[f.wid].slot))
                    else:
                        self._spawn(self.workers[f.wid].slot, background=True)
        deadline = time.time() + self.cfg.spare_wait_s
        said = False
        while True:
            spares = self._ready_spares()
            if len(spares) >= len(pending):
                break
            if not self._live_spares():
                raise JobFailed(
                    f"{len(pending)} rank(s) lost and no spare left (checkpointless.spares="
                    f"{self.cfg.spares}, refill={self.cfg.refill}); the run stops here. Raise "
                    "checkpointless.spares or enable checkpointless.refill")
            if not said:
                self.log(f"[checkpointless] waiting for a spare to warm up "
                         f"({len(spares)} ready, {len(pending)} needed)")
                said = True
            if time.time() > deadline:
                raise JobFailed(f"no spare became ready within {self.cfg.spare_wait_s:.0f} s")
            self._check_active_alive()
            time.sleep(0.05)
        t = time.time()
        for f, spare in zip(pending, spares):
            spare.rank = f.rank
            self.ranks[spare.wid] = f.rank
            f.t_spare, f.new_wid = t, spare.wid
        self._publish()
        for f in pending:
            f.gen = self.gen

    def _check_active_alive(self) -> None:
        """While waiting for a spare, another active worker may fail too: fold it in."""
        for wid in list(self.ranks):
            w = self.workers[wid]
            if w.proc.poll() is not None and not self.store.check([f"done/{wid}"]):
                f = self._record_failure(w, False, time.time())
                if self.cfg.refill:
                    f._refilled = True
                    self._spawn(w.slot, background=True)

    # ---- main loop -----------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        self.store = dist.TCPStore(cfg.host, cfg.port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=60))
        self.port = self.store.port
        spec = {"backend": cfg.backend, "heartbeat_timeout_s": cfg.heartbeat_timeout_s,
                "seed": cfg.seed, "faults": cfg.faults, "pg_timeout_s": cfg.pg_timeout_s,
                "replication": cfg.replication, "workers_per_node": cfg.nproc + cfg.spares}
        self.store.set("spec", json.dumps(spec))
        t_start = time.time()
        for slot in range(cfg.nproc + cfg.spares):
            w = self._spawn(slot)
            if slot < cfg.nproc:
                w.rank = slot
                self.ranks[w.wid] = slot
        self.pids_at_start = {w.rank: w.proc.pid for w in self.workers.values() if w.rank >= 0}
        self._publish()
        if self.on_start:
            self.on_start(self)
        reported = set()
        errors_seen = 0
        next_slow = next_beats = 0.0
        try:
            while True:
                self._sleep(cfg.poll_s)
                # fast checks every poll: process exits (a syscall each) and one error counter
                lost = [(self.workers[wid], False) for wid in list(self.ranks)
                        if self.workers[wid].proc.poll() is not None
                        and not self.store.check([f"done/{wid}"])]
                slow = time.time() >= next_slow
                errors = membership.counter(self.store, "errors") if slow else errors_seen
                if errors != errors_seen:
                    errors_seen = errors
                    for wid in list(self.ranks):
                        w = self.workers[wid]
                        if self.store.check([f"error/{wid}"]) and all(w is not x for x, _ in lost):
                            self._kill(w)  # it reported its exception: no need to wait its exit
                            lost.append((w, False))
                if slow:
                    next_slow = time.time() + 0.1
                beats_due = slow and time.time() >= next_beats
                if beats_due:
                    next_beats = time.time() + 0.5
                if not lost and beats_due and cfg.enabled:
                    active = {wid: self.workers[wid] for wid in self.ranks}
                    beats = {wid: detection.read_beat(self.store, wid) for wid in active}
                    pids = {wid: w.proc.pid for wid, w in active.items()}
                    for wid in detection.find_hung(beats, pids, cfg.heartbeat_timeout_s):
                        lost.append((active[wid], True))
                if lost:
                    if not cfg.enabled:
                        w = lost[0][0]
                        raise JobFailed(f"rank {w.rank} (worker {w.wid}) failed with exit code "
                                        f"{w.proc.poll()} and checkpointless is off")
                    self._handle(lost)
                if not slow:
                    continue
                self._say_recoveries(reported)
                self._refill_dead_spares()
                due = [r for r in self._refills if r[0] <= time.time()]
                for r in due:
                    self._refills.remove(r)
                    self._spawn(r[1], background=True)
                if membership.counter(self.store, "done") >= len(self.ranks) and all(
                        self.store.check([f"done/{wid}"]) for wid in self.ranks):
                    for wid in self.ranks:
                        self.workers[wid].proc.wait()
                    bad = [wid for wid in self.ranks if self.workers[wid].proc.returncode != 0]
                    if bad:
                        raise JobFailed(f"workers {bad} reported done but exited non-zero")
                    break
        finally:
            self.store.set("shutdown", "1")
            time.sleep(0.05)
            for w in self.workers.values():
                if w.proc.poll() is None and w.rank < 0:
                    w.proc.terminate()
            for w in self.workers.values():
                try:
                    w.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._kill(w)
        self._say_recoveries(reported)
        return self._report(t_start)

    def _refill_dead_spares(self) -> None:
        """A spare that died while waiting is replaced too."""
        for w in list(self.workers.values()):
            if w.rank == -1 and w.proc.poll() is not None and not getattr(w, "_gone", False):
                w._gone = True
                if self.store.check(["shutdown"]):
                    continue
                self.log(f"[checkpointless] spare worker {w.wid} exited (code "
                         f"{w.proc.returncode})" + ("; starting another" if self.cfg.refill else ""))
                if self.cfg.refill:
                    self._spawn(w.slot, background=True)

    # ---- reporting -----------------------------------------------------------------------
    def _recovery_entry(self, f: Failure) -> dict | None:
        members = range(self.cfg.nproc)
        recs = []
        for g in range(f.gen, self.gen + 1):  # a generation cut short by another failure is
            recs = []                          # superseded by the next one that completed
            for r in members:
                key = f"rec/{g}/{r}"
                if self.store.check([key]):
                    recs.append({**json.loads(self.store.get(key)), "rank": r})
            if len(recs) == self.cfg.nproc:
                break
        firsts = []
        for g in range(f.gen, self.gen + 1):
            for r in members:
                key = f"recfirst/{g}/{r}"
                if self.store.check([key]):
                    firsts.append(float(self.store.get(key)))
        if len(recs) < self.cfg.nproc or not firsts:
            return None
        t_plan = recs[0]["t_plan"]
        t_group = max(r["t_group"] for r in recs)
        t_ready = max(r["t_ready"] for r in recs)
        t_first = min(firsts)
        mine = [r for r in recs if r["worker_id"] == f.new_wid]
        src = mine[0]["source"] if mine else None
        return {
            "failed_rank": f.rank, "cause": f.cause, "failed_worker": f.wid,
            "replacement_worker": f.new_wid, "generation": f.gen, "failed_at_step": f.step,
            "detect_s": round(f.t_detect - f.t_fail, 4),
            "recovery_s": round(t_first - f.t_fail, 4),
            "phases_s": {
                "detection": round(f.t_detect - f.t_fail, 4),
                "spare_wait": round(max(0.0, f.t_spare - f.t_detect), 4),
                "regroup": round(t_group - t_plan, 4),
                "state_transfer": round(t_ready - t_group, 4),
                "resume": round(t_first - t_ready, 4),
            },
            "state_bytes": sum(r["bytes_received"] for r in recs),
            "source_ranks": sorted({int(s) for r in recs for s in r["pairs"].values()}),
            "served": {str(k): v for k, v in recs[0]["pairs"].items()},
            "resumed_step": recs[0]["resumed_step"],
            "restored_from": recs[0].get("restored_from", "peer_memory"),
            "steps_redone": recs[0].get("steps_redone", 0),
            # survivors that redo the interrupted step from the gradients they kept
            "ranks_reusing_grads": sorted(r["rank"] for r in recs if r.get("grads_kept")),
        }

    def _say_recoveries(self, reported: set) -> None:
        for i, f in enumerate(self.failures):
            if i in reported or f.gen < 0:
                continue
            e = self._recovery_entry(f)
            if e is None:
                continue
            reported.add(i)
            p = e["phases_s"]
            self.log(f"[checkpointless] recovered rank {e['failed_rank']} ({e['cause']}): spare "
                     f"worker {e['replacement_worker']} got {e['state_bytes'] / 1e6:.1f} MB from "
                     f"rank(s) {e['source_ranks']}, resumed at step {e['resumed_step']}, "
                     f"{e['recovery_s']:.2f} s after the failure (detect {p['detection']:.2f}, "
                     f"regroup {p['regroup']:.2f}, transfer {p['state_transfer']:.2f}, "
                     f"resume {p['resume']:.2f})")

    def _report(self, t_start: float) -> dict:
        steps = {}
        first = int(self.store.get("first_step")) if self.store.check(["first_step"]) else 0
        for key_step in range(first, 10 ** 9):
            key = f"steps/{key_step}"
            if not self.store.check([key]):
                break
            t0, t1 = (float(x) for x in self.store.get(key).decode().split(","))
            steps[key_step] = (t0, t1)
        results = {}
        for r in range(self.cfg.nproc):
            key = f"result/{r}"
            if self.store.check([key]):
                results[r] = json.loads(self.store.get(key))
        recoveries = [e for f in self.failures if f.gen >= 0
                      for e in [self._recovery_entry(f)] if e is not None]
        return {
            "world_size": self.cfg.nproc,
            "spares": self.cfg.spares,
            "steps_completed": len(steps),
            "wall_s": round(time.time() - t_start, 3),
            "goodput": goodput_from_steps(steps),
            "recoveries": recoveries,
            "results_by_rank": results,
            "pids_at_start": self.pids_at_start,
            "pids_at_end": {w.rank: w.proc.pid for w in self.workers.values() if w.rank >= 0},
            "worker_ids_at_end": {w.rank: w.wid for w in self.workers.values() if w.rank >= 0},
            "step_times": steps,
        }
