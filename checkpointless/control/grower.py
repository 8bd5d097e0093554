"""The job grows back after a shrink (checkpointless.shrink): while some process hosts more than
one logical rank and a healthy spare is ready, every worker is asked to stop at a step boundary
(a notice), and there the spares join as new processes, each taking a logical rank back
(Placement.grow), and receive the state from their peers as a replacement does."""
from __future__ import annotations

from ..protocol import membership
from .. import protocol
from .job_state import JobState, Notices
from .publisher import Publisher
from .spares import Spares


class Grower:
    """Grows `state`'s placement with the `pool`'s fit `spares`, announcing it through
    `notices` and publishing it through the `publisher`."""

    def __init__(self, cfg, state: JobState, pool, spares: Spares, publisher: Publisher,
                 notices: Notices, log=print):
        self.cfg, self.state, self.pool, self.log = cfg, state, pool, log
        self.spares, self.publisher, self.notices = spares, publisher, notices
        self.grow_at: tuple[int, int] | None = None  # (generation, step) of a grow announced

    def grow_if_ready(self) -> None:
        """While some process hosts more than one logical rank and a healthy spare is ready,
        grow at a step boundary: a notice (kind "regroup") asks every worker of this
        generation to stop before the step after next, where they wait for a new plan (as for a
        straggler's leave) instead of aborting a step in flight and redoing it; once the job
        is there, the spares join as new processes (_grow)."""
        s, at = self.state, self.grow_at
        if at is not None:  # announced: publish once the job reached the boundary, whatever
            if at[0] != s.gen or self._ending():  # came since (the workers wait there for a
                self.grow_at = None  # plan). A failure's plan came first (its generation needs a
            elif s.job_step(self.pool) >= at[1]:  # notice of its own), or the job ended before
                self.grow_at = None
                self._grow(at[1])
            return
        old = s.placement
        if self.cfg.shrink == "off" or old.processes >= old.logical_world or \
                s.preempted_at is not None or any(f.gen < 0 for f in s.failures):
            return
        if self._ending():
            return
        if not self.spares.fit():
            return
        # two steps on, as for a straggler: every worker learns of it first
        self.grow_at = (s.gen, s.job_step(self.pool) + 2)
        self.notices.send(kind="regroup", gen=s.gen, before_step=self.grow_at[1])
        self.log(f"[checkpointless] a spare is ready: the job grows before step "
                 f"{self.grow_at[1]} (every process stops there for the new plan)")

    def _ending(self) -> bool:
        """Rank 0's result is in, or a rank is done: a new generation would only delay the
        end. Two reads, not one per rank, on every turn of the loop while shrunk."""
        store = self.state.store
        return store.check([protocol.result_key(0)]) or \
            membership.counter(store, protocol.DONE) > 0

    def _grow(self, step: int) -> None:
        """The grow announced for the boundary before `step`, where every worker now waits for
        a plan: with no healthy spare ready any more, one with the same placement."""
        s = self.state
        old = s.placement
        ready = self.spares.fit()
        if not ready:
            self.log(f"[checkpointless] the spare is no longer ready at step {step}: the job "
                     "goes on with the same processes")
            self.publisher.publish()
            return
        spares = ready[:old.logical_world - old.processes]
        new = old.grow(len(spares))
        said = []
        for i, w in enumerate(spares):
            w.rank = s.ranks[w.wid] = old.processes + i
            said.append(f"logical rank {new.hosts[w.rank][0]} moves to process {w.rank} "
                        f"(spare worker {w.wid})")
        self.publisher.place(new)
        event = {"kind": "grow", "step": s.job_step(self.pool), "from_processes": old.processes,
                 "to_processes": new.processes,
                 "logical_ranks_moved": sorted(new.hosts[w.rank][0] for w in spares)}
        self.publisher.publish()
        for w in spares:
            w.took_over_gen = s.gen
        self.log(f"[checkpointless] spare ready: {', '.join(said)}; {new.processes} processes "
                 f"host {new.logical_world} logical ranks (checkpointless.shrink="
                 f"{self.cfg.shrink})")
        self.publisher.resized(event)
