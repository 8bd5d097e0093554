"""The coordinator's figures for Prometheus (`checkpointless.metrics_port`, `--metrics-port`).

Served from the coordinator's process with prometheus_client (an optional package: the launcher
names it before launch when the key asks for it). Everything is computed when Prometheus scrapes,
on the scraping thread with a store connection of its own, so the supervisor's loop does no work
for it and the coordinator's steady state is the same with or without a scraper:
  * the steps read incrementally (each scrape reads the step records written since the last one,
    and the newest few again, which a recovery may have rewritten);
  * a recovery's record read once, when it is complete.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from .. import protocol
from ..protocol import membership
from .report import goodput_from_steps, new_step_records, recovery_entry, \
    shrunk_capacity_lost, slow_time

RESCAN = 64  # newest step records read again at each scrape: a redone step rewrites its own
RATE_STEPS = 20  # steps per second and tokens per second: over this many newest steps


@dataclass
class Snapshot:
    """The supervisor's side of one scrape (Supervisor.figures)."""
    gen: int
    world_size: int
    nproc: int
    failures: list  # report.Failure, every one so far
    stragglers: list  # the straggler entries so far
    spares_ready: int | None  # None: the pool changed under the scrape
    nodes_alive: int
    nodes_lost: int | None  # None: one machine, no nodes to lose
    t_start: float
    # after a takeover: the step records its coordinators before kept (ledger.py), so that
    # the steps and goodput count from the launch, as report.json does
    earlier_steps: dict = field(default_factory=dict)
    processes: int = 0  # processes hosting the logical ranks (fewer than nproc while shrunk)
    resizes: list = field(default_factory=list)  # the shrinks and grows so far (report.py)


class Figures:
    """What one scrape reports, from a running Supervisor's `figures()` snapshots."""

    def __init__(self, snapshot, store_port: int, tokens_per_step: int = 0):
        self.snapshot, self.store_port = snapshot, store_port
        self.tokens_per_step = tokens_per_step
        self.store = None
        self.steps: dict[int, tuple[float, float]] = {}
        self.next_step = None  # the first step record not read yet
        self.recoveries: dict[int, dict] = {}  # failure index -> its complete recovery entry
        self._lock = threading.Lock()

    def _read_steps(self) -> None:
        got, self.next_step = new_step_records(self.store, self.next_step, RESCAN)
        self.steps.update(got)

    def _read_recoveries(self, now) -> None:
        for i, f in enumerate(now.failures):
            if i in self.recoveries or f.gen < 0:
                continue
            e = recovery_entry(self.store, f, now.nproc, now.gen)
            if e is not None:
                self.recoveries[i] = e

    def collect(self):
        with self._lock:  # two scrapes at once share the cursor and the connection
            return list(self._collect())

    def _collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        if self.store is None:
            self.store = membership.connect("127.0.0.1", self.store_port)
        now = self.snapshot(self.store)
        self._read_steps()
        self._read_recoveries(now)
        steps = {**now.earlier_steps, **self.steps} if now.earlier_steps else self.steps
        entries = now.stragglers
        slow_s, _ = slow_time(steps, entries) if steps else (0.0, None)
        # the capacity a shrunk job lacked counts as lost, as report.json's goodput has it
        slow_s += shrunk_capacity_lost(steps, now.resizes, now.nproc)

        def gauge(name, doc, value, unit=""):
            g = GaugeMetricFamily(f"checkpointless_{name}", doc, unit=unit)
            if value is not None:
                g.add_metric([], float(value))
            return g

        yield gauge("steps_completed", "Steps committed in this launch", len(steps))
        yield gauge("goodput_ratio", "Time in committed steps, less what stragglers and a "
                    "shrink cost, over the time since the first step began", goodput_from_steps(steps,
                                                                             slow_s=slow_s))
        yield gauge("slow_seconds", "Time lost to steps a straggler slowed, or run on fewer "
                    "processes than logical ranks (the missing share)", slow_s)
        newest = sorted(steps)[-RATE_STEPS:]
        rate = None
        if len(newest) >= 2:
            span = steps[newest[-1]][1] - steps[newest[0]][0]
            rate = len(newest) / span if span > 0 else None
        yield gauge("steps_per_second", f"Over the newest {RATE_STEPS} steps", rate)
        if self.tokens_per_step:
            yield gauge("tokens_per_second", f"Over the newest {RATE_STEPS} steps, all ranks",
                        None if rate is None else rate * self.tokens_per_step)
        yield gauge("generation", "The membership generation", now.gen)
        yield gauge("world_size", "Ranks training", now.world_size)
        yield gauge("processes", "Processes in use, each hosting one logical rank or more "
                    "(fewer than the logical world while shrunk)", now.processes or now.nproc)
        yield gauge("logical_world", "Logical ranks of the job", now.nproc)
        yield gauge("spares_ready", "Warm spares ready to take a rank", now.spares_ready)
        yield gauge("nodes_alive", "Nodes not lost", now.nodes_alive)
        if now.nodes_lost is not None:
            yield gauge("nodes_lost", "Nodes lost", now.nodes_lost)
        failures = CounterMetricFamily("checkpointless_failures", "Workers lost, by cause",
                                       labels=["cause"])
        recovered = CounterMetricFamily("checkpointless_recoveries",
                                        "Recoveries completed, by cause", labels=["cause"])
        for cause in ("exit", "error", "hang", "node_lost", "diverged", "slow", "sdc"):
            failures.add_metric([cause], sum(f.cause == cause for f in now.failures))
            recovered.add_metric([cause], sum(e["cause"] == cause
                                              for e in self.recoveries.values()))
        yield failures
        yield recovered
        phases = GaugeMetricFamily("checkpointless_last_recovery_seconds",
                                   "The newest recovery, from the failure to the first step "
                                   "after it, by phase", labels=["phase"])
        if self.recoveries:
            last = self.recoveries[max(self.recoveries)]
            for phase, s in last["phases_s"].items():
                phases.add_metric([phase], s)
            phases.add_metric(["total"], last["recovery_s"])
        yield phases
        stragglers = CounterMetricFamily("checkpointless_stragglers",
                                         "Stragglers found, by what was done", labels=["action"])
        for action in sorted({e.get("action", "reported") for e in entries} | {"evicted"}):
            stragglers.add_metric([action], sum(e.get("action", "reported") == action
                                                for e in entries))
        yield stragglers
        yield from self._replay(gauge)
        yield gauge("uptime_seconds", "Since the coordinator started the job",
                    time.time() - now.t_start if now.t_start else None)

    def _replay(self, gauge):
        """The replay check's verdict and mismatches (worker/rehearsal.py), read each scrape."""
        from prometheus_client.core import CounterMetricFamily
        verdict = protocol.read_json(self.store, protocol.REPLAY)
        redo = int(self.store.add(protocol.REPLAY_REDO, 0))
        checked = verdict is not None and verdict.get("replayable") is not None
        yield gauge("replay_replayable", "The replay check: 1 the rehearsed step gave the same "
                    "bits when run again, 0 a step run again gave other bits (the run's bits are "
                    "not guaranteed to equal a run without failures); absent while unchecked",
                    0 if redo else int(bool(verdict["replayable"])) if checked else None)
        mismatches = CounterMetricFamily("checkpointless_replay_mismatches",
                                         "Steps that gave other bits when run again, by check "
                                         "(rehearsal, redo after a recovery)", labels=["check"])
        mismatches.add_metric(["rehearsal"], len((verdict or {}).get("mismatches") or []))
        mismatches.add_metric(["redo"], redo)
        yield mismatches


def serve(sup, port: int, tokens_per_step: int = 0, addr: str = "0.0.0.0"):
    """Start serving /metrics on `port` from `sup.figures` (a store connection of the
    scraper's own on sup.port); returns a function that stops it."""
    from prometheus_client import CollectorRegistry, start_http_server
    from prometheus_client.process_collector import ProcessCollector
    registry = CollectorRegistry()
    registry.register(Figures(sup.figures, sup.port, tokens_per_step))
    ProcessCollector(registry=registry)  # the coordinator's own CPU and memory
    server, thread = start_http_server(port, addr=addr, registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    return stop


def serve_metrics(sup, log):
    """/metrics on the supervisor's cfg.metrics_port, if set; the function that stops it (None
    when off). A port that cannot be served raises OSError with the key and the fix."""
    port = sup.cfg.metrics_port
    if not port:
        return None
    try:
        stop = serve(sup, port, sup.cfg.tokens_per_step)
    except OSError as exc:
        raise OSError(f"checkpointless.metrics_port={port}: cannot serve Prometheus metrics "
                      f"there ({exc.strerror or exc}); choose a free port, or 0 for none") from None
    log(f"[checkpointless] Prometheus metrics at http://{sup.cfg.host}:{port}/metrics")
    return stop
