"""The run's record as the supervisor keeps it while the job runs: each recovery said once in
the log, the record copied into the job's facts as it goes (ledger.py), what Prometheus shows
(figures) and the report (report.json; report.py builds it)."""
from __future__ import annotations

import time

from .job_state import JobState
from .ledger import Ledger
from .prometheus import Snapshot
from .report import RunFacts, new_recoveries, run_report
from .stragglers import Stragglers


class RunRecord:
    """Reads `state`, the `pool`'s workers and the `stragglers`' entries; the `ledger` copies
    them into the facts."""

    def __init__(self, cfg, state: JobState, pool, stragglers: Stragglers, ledger: Ledger,
                 log=print):
        self.cfg, self.state, self.pool, self.log = cfg, state, pool, log
        self.stragglers, self.ledger = stragglers, ledger
        self.t_start = 0.0  # when the supervisor's run began
        self.first_wids: dict[int, int] = {}  # rank -> the first generation's worker
        self.reported: set[int] = set()  # failures whose recovery was said

    def say_recoveries(self) -> None:
        s = self.state
        for line in new_recoveries(s.store, s.failures, self.reported, self.cfg.nproc, s.gen):
            self.log(line)

    def tick(self, force: bool = False) -> None:
        """The record into the facts (every so often; at once with `force`)."""
        s = self.state
        self.ledger.tick(s.store, s.failures, self.reported, self.cfg.nproc, s.gen,
                         force=force, stragglers=self.stragglers.entries)

    def report(self) -> dict:
        """The run's report as of now: what report.json holds."""
        s, workers = self.state, self.pool.workers
        return run_report(s.store, RunFacts(
            nproc=self.cfg.nproc, spares=self.cfg.spares, wall_s=time.time() - self.t_start,
            failures=s.failures, last_gen=s.gen, workers=list(workers.values()),
            pids_at_start={r: workers[wid].proc.pid for r, wid in self.first_wids.items()},
            killed_after_done=s.killed_after_done,
            stragglers=self.stragglers.entries or [], check=self.stragglers.summary(),
            earlier=self.ledger.earlier(), processes=s.placement.processes,
            shrink=self.cfg.shrink, resizes=list(s.resizes),
            replay_check=self.cfg.replay_check))

    def figures(self, store) -> Snapshot:
        """What Prometheus shows now (prometheus.py), read on the scraper's thread with its
        own store connection; copies, so the loop may change its own values meanwhile."""
        s = self.state
        try:
            ready = len(self.pool.spares(store, ready=True))
        except Exception:  # noqa: BLE001  the pool changed under the scrape: said next time
            ready = None
        nodes = getattr(self.pool, "nodes", None)
        return Snapshot(gen=s.gen, world_size=len(s.ranks), nproc=self.cfg.nproc,
                        processes=s.placement.processes, resizes=list(s.resizes),
                        failures=list(s.failures),
                        stragglers=list(self.stragglers.entries), spares_ready=ready,
                        nodes_alive=sum(not n.lost for n in nodes.values()) if nodes else 1,
                        nodes_lost=sum(n.lost for n in nodes.values()) if nodes else None,
                        t_start=self.t_start, earlier_steps=self.ledger.resumed_steps)
