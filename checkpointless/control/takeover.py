"""A coordinator taking over a running job (coordinator=etcd): the supervisor's first moves when
etcd says the job already has generations (facts.py) and it now holds the role (leadership.py).

It rebuilds what the lost coordinator knew from two sources: etcd (the spec, the newest two
plans, the counters, the fences, the moves so far) and the agents, each of which says hello to
the new store with what runs on its node (cluster.py adopt). It then publishes the newest
generation again, so that an agent's relay or a rank waiting for it in the old store goes on,
and from then on the supervisor's ordinary loop runs: a node that never answered is silent, so
it is declared lost and its ranks move to a spare node, as for any node loss.
"""
from __future__ import annotations

from ..protocol import membership
from .. import protocol


def take_over(sup, known) -> None:
    """Coordinate a running job whose coordinator was lost (coordinator=etcd): its facts
    from etcd, its live processes from the agents' hellos (cluster.py adopt), then the
    newest generation published again in this store, so that whoever waited for it in the
    old one goes on; nodes that never said hello are lost at the next look."""
    last, before = known.plans[known.gen], known.plans.get(known.gen - 1)
    sup.store.add(protocol.LOST, known.lost)
    sup._notices = known.notices
    hellos = sup.pool.adopt(sup.store, last, known)
    sup.ranks = {int(w): r for w, r in last["ranks"].items()}
    sup.gen = known.gen
    sup._plan = _plan_of(known.gen, last, known.lost)
    membership.publish(sup.store, sup._plan,
                       _plan_of(known.gen - 1, before, known.lost) if before else None)
    sup.pids_at_start = {}
    t_lost = min((h["coordinator_lost_at"] for h in hellos.values()
                  if h.get("coordinator_lost_at")), default=None)
    move = dict(sup.facts.taking, t_lost=t_lost,
                detect_to_taken_s=round(sup.facts.taking["t_taken"] - t_lost, 3)
                if t_lost else None, gen=known.gen,
                nodes_heard=sorted(hellos), from_node=(known.moves[-1]["node"]
                                                       if known.moves else None))
    sup.facts.record_move(move)
    sup.moves = known.moves + [move]
    sup.log(f"[checkpointless] took over as the coordinator at generation {known.gen} "
            f"(node {move['node']}, token {move['token']}): {len(hellos)} node(s) answered, "
            f"{len(sup.ranks)} ranks" +
            (f"; the coordinator was lost {move['detect_to_taken_s']:.2f} s before"
             if t_lost else ""))


def _plan_of(gen: int, known_plan: dict, lost: int) -> membership.Plan:
    """A plan as facts.py keeps it, made a Plan again."""
    return membership.Plan(gen=gen, world_size=known_plan["world_size"],
                           ranks={int(w): r for w, r in known_plan["ranks"].items()}, lost=lost,
                           nodes={int(w): k for w, k in known_plan["nodes"].items()})
