"""The next generation, published: its plan (membership.publish), written to the job's facts
first so that a coordinator taking over finds every plan there; and a new placement of logical
ranks or a resize (a shrink or a grow) put on record as it happens."""
from __future__ import annotations

from typing import Callable

from ..protocol import membership
from .. import protocol
from ..protocol.placement import Placement
from .job_state import JobState
from .ledger import Ledger
from .stragglers import Stragglers


class Publisher:
    """Writes the plans of `state`'s generations for the `pool`'s workers. `issue_rewind()` is
    called with each new generation before its plan (an audit's rewind goes with it: its
    members read it as they restore)."""

    def __init__(self, cfg, state: JobState, pool, facts, ledger: Ledger,
                 stragglers: Stragglers, issue_rewind: Callable[[], None]):
        self.cfg, self.state, self.pool, self.facts = cfg, state, pool, facts
        self.ledger, self.stragglers, self.issue_rewind = ledger, stragglers, issue_rewind

    def publish(self) -> None:
        """The next generation's plan: what changed since the last one, node by node. Its world
        is the processes of the placement; after a shrink, each lists its logical ranks."""
        s = self.state
        s.gen += 1
        self.issue_rewind()  # before the plan: its members read it as they restore
        pl = s.placement
        hosts = {} if pl.hosts == Placement.identity(pl.logical_world).hosts else \
            {wid: list(pl.hosts[r]) for wid, r in s.ranks.items()}
        plan = membership.Plan(gen=s.gen, world_size=pl.processes, ranks=dict(s.ranks),
                               lost=membership.counter(s.store, protocol.LOST),
                               nodes={wid: self.pool.workers[wid].node for wid in s.ranks},
                               hosts=hosts,
                               logical_world=pl.logical_world if self.cfg.shrink != "off" else 0)
        self.facts.record_plan(plan, plan.lost, self.pool.next_wid)  # etcd first: a takeover
        membership.publish(s.store, plan, s.plan)  # finds every published plan there
        s.plan = plan

    def place(self, new: Placement) -> None:
        """A new placement: the stragglers' figures measured under the old one compare
        unlike loads, and a process hosting more than one logical rank is slow by design."""
        self.state.placement = new
        self.stragglers.placement_changed(max(new.loads()) > 1)

    def resized(self, event: dict) -> None:
        """A shrink or grow, on record (the report's `shrinks` and `grows`, and the facts)."""
        self.state.resizes.append(event)
        self.ledger.record_resize(len(self.state.resizes) - 1, event)
