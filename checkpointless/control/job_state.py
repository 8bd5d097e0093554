"""What the supervisor's collaborators share, written out: the membership it publishes (the
store, the generation, which worker holds which rank, the placement of logical ranks, the newest
plan), the run's record so far (failures, shrinks and grows, workers killed once their result was
in) and a stop asked of the job. Each collaborator (losses.py, replacer.py, grower.py, stops.py,
publisher.py) is handed this object and reads it when it acts, never a copy.

Also here: the notices every worker learns of (Notices), and the placement a plan describes."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..protocol import membership
from . import policy
from .. import protocol
from ..protocol.placement import Placement
from .report import Failure


@dataclass
class JobState:
    """The job as the supervisor sees it now; `nproc` processes at the start."""
    nproc: int
    store: object = None  # the coordination store (Supervisor.run hosts it)
    gen: int = -1  # the newest generation published
    ranks: dict[int, int] = field(default_factory=dict)  # active worker id -> rank
    plan: membership.Plan | None = None  # the newest published plan
    # which process (by rank) hosts which logical ranks; identity until a shrink
    placement: Placement | None = None
    failures: list[Failure] = field(default_factory=list)
    resizes: list[dict] = field(default_factory=list)  # every shrink and grow, in order
    killed_after_done: list[int] = field(default_factory=list)  # killed once their result was in
    stop_asked: str | None = None  # why the job was asked to stop (a signal, a node's agent)
    preempted_at: int | None = None  # the step before which every rank stopped

    def __post_init__(self):
        if self.placement is None:
            self.placement = Placement.identity(self.nproc)

    def job_step(self, pool) -> int:
        """The step the job is at: the furthest of the active workers' heartbeats (`pool`'s),
        or the step after rank 0's newest committed one (heartbeats from other nodes come at
        most one health record late)."""
        last = protocol.read_json(self.store, protocol.LAST_STEP)  # an integer, or None
        return max(policy.job_step(pool.beats(list(self.ranks)).values()),
                   0 if last is None else last + 1)

    def pending(self) -> list[Failure]:
        """The failures whose rank no generation has taken yet."""
        return [f for f in self.failures if f.gen < 0]


class Notices:
    """The supervisor's notices to every worker (protocol.notice_key), in order: a preemption,
    a straggler asked to leave, a regroup before a grow."""

    def __init__(self, state: JobState, facts):
        self.state, self.facts = state, facts
        self.count = 0  # notices written

    def send(self, **notice) -> None:
        raw = json.dumps(notice)
        # kept for a coordinator taking over first (it publishes it again, takeover.py): the
        # ranks that join under it (a lost node's replacements) must stop where the others do
        self.facts.record(f"notice/{self.count}", raw)
        self.state.store.set(protocol.notice_key(self.count), raw)
        self.count += 1
        self.facts.record_notices(self.count)


def placement_of(plan: membership.Plan, nproc: int) -> Placement:
    """The placement a plan describes: its processes in rank order, each with its hosted
    logical ranks (a plan without hosts: one logical rank a process, its own)."""
    if not plan.hosts:
        return Placement.identity(plan.world_size or nproc)
    order = sorted(plan.ranks, key=plan.ranks.get)
    return Placement(plan.logical_world or nproc, tuple(tuple(plan.hosts[w]) for w in order))
