"""Which spares may take a lost rank: the ready ones whose node's newest health check passed
(policy.healthy_spares), chosen for the lost workers by policy.choose_spares. Read by the loss
finder (a straggler is evicted only when a spare is fit), the replacer and the grower."""
from __future__ import annotations

import json

from . import policy
from .. import protocol
from .job_state import JobState
from .processes import Worker


def fit_spares(store, ready: list, said: dict, log=print) -> list:
    """The ready spares whose newest check in the store passed (policy.healthy_spares); each
    one set aside is said once per reason (`said`: wid -> the reason last said)."""
    found = [w for w in ready if store.check([protocol.health_key(w.wid)])]
    records = dict(zip([w.wid for w in found],
                       (json.loads(v) for v in store.multi_get(
                           [protocol.health_key(w.wid) for w in found])))) if found else {}
    fit, unfit = policy.healthy_spares(ready, records)
    nodes = {w.wid: w.node for w in ready}
    for wid, why in unfit.items():
        if said.get(wid) != why:
            said[wid] = why
            log(f"[checkpointless] spare worker {wid} (node {nodes[wid]}) is not promoted: its "
                f"node is unhealthy ({why}); the next spare is taken")
    return fit


class Spares:
    """The `pool`'s spares, as the store of `state` says they are."""

    def __init__(self, state: JobState, pool, log=print):
        self.state, self.pool, self.log = state, pool, log
        self.unhealthy_said: dict[int, str] = {}  # spare -> why it was last said unfit

    def fit(self) -> list[Worker]:
        """The ready spares whose newest health check passed (fit_spares)."""
        store = self.state.store
        return fit_spares(store, self.pool.spares(store, ready=True), self.unhealthy_said,
                          self.log)

    def choose(self, lost: list[Worker]) -> list[Worker] | None:
        """A fit spare for each of the `lost` workers (a lost node's ranks together on a spare
        node), or None when they do not cover them all."""
        return policy.choose_spares(self.fit(), [(w.node, w.slot) for w in lost],
                                    self.pool.lost_node_ids(), self.pool.spare_node_ids())
