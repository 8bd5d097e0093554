"""The facts a coordinator is handed: what must outlive it (the spec, each generation's plan, the
counters, fences, takeovers), and the interface it writes them through.

The supervisor sees only this interface. On one machine (a TCPStore coordinator) it is `NoFacts`:
the store is the only record. With coordinator=etcd it is `ha.etcd_facts.JobFacts`, which keeps
them in etcd for whoever takes the coordinator's role next.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class Deposed(RuntimeError):
    """The coordinator can no longer record the job's facts: its role was taken over, or etcd
    lost its quorum. It must change nothing more."""


@dataclass
class Known:
    """What a coordinator taking over finds."""
    spec: str | None = None
    gen: int = -1
    plans: dict = field(default_factory=dict)  # gen -> {"ranks": {wid: rank}, "nodes": {wid: k}}
    lost: int = 0
    next_wid: int = 0
    fenced: dict = field(default_factory=dict)  # node -> why
    notices: int = 0  # notices the coordinators wrote so far (protocol.notice_key)
    done: str | None = None  # the job ended ("ok" or "failed: ..."): nobody coordinates it again
    moves: list = field(default_factory=list)
    # the run's record so far (ledger.py): name ("steps/<c>", "failure/<wid>", ...) -> JSON
    record: dict = field(default_factory=dict)


class NoFacts:
    """A coordinator whose store is the only record (one machine, or a TCPStore coordinator)."""
    durable = False
    taking: dict = {}  # a takeover's own figures (JobFacts)

    def known(self) -> Known:
        return Known()

    def record_spec(self, spec_json: str) -> None:
        pass

    def record_plan(self, plan, lost: int, next_wid: int) -> None:
        pass

    def record_fence(self, node: int, why: str) -> None:
        pass

    def record_move(self, move: dict) -> None:
        pass

    def record_notices(self, n: int) -> None:
        pass

    def record(self, name: str, value: str) -> bool:
        """Keep one entry of the run's record (ledger.py); False when it could not be kept
        now (tried again later)."""
        return True
