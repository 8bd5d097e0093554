"""A coordinator taking over a running job (coordinator=etcd): the supervisor's first moves when
etcd says the job already has generations (ha/etcd_facts.py) and it now holds the role
(ha/leadership.py).

It rebuilds what the lost coordinator knew from two sources: etcd (the spec, the newest two
plans, the counters, the fences, the moves so far) and the agents, each of which says hello to
the new store with what runs on its node (`adopt`). It then publishes the newest generation
again, so that an agent's relay or a rank waiting for it in the old store goes on, and from then
on the supervisor's ordinary loop runs: a node that never answered is silent, so it is declared
lost and its ranks move to a spare node, as for any node loss.

Nothing here writes the supervisor: `take_over` returns a `Takeover` that the supervisor
applies (Supervisor.resume).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass

from ..protocol import membership
from .. import protocol
from ..protocol.records import SILENT

D = protocol.DEFAULTS


@dataclass
class Takeover:
    """What a new coordinator resumes from."""
    gen: int
    ranks: dict[int, int]  # wid -> rank of the newest plan
    plan: membership.Plan  # the newest plan, published again
    notices: int  # notices the lost coordinator wrote
    moves: list[dict]  # the coordinator's moves so far, this one last
    record: dict  # the run's record the coordinators before kept (ledger.py)
    preempt: dict | None = None  # the preemption notice, when one was given before
    regroup: dict | None = None  # the newest grow's notice (its workers stop at its step)


def take_over(store, pool, facts, known, log=print) -> Takeover:
    """Coordinate a running job whose coordinator was lost: its facts from etcd, its live
    processes from the agents' hellos, then the newest generation published again in this
    store, so that whoever waited for it in the old one goes on; nodes that never said hello
    are lost at the next look."""
    last, before = known.plans[known.gen], known.plans.get(known.gen - 1)
    store.add(protocol.LOST, known.lost)
    preempt, regroup = republish_notices(store, known.record)
    hellos = adopt(pool, store, last, known)
    plan = _plan_of(known.gen, last, known.lost)
    membership.publish(store, plan,
                       _plan_of(known.gen - 1, before, known.lost) if before else None)
    t_lost = min((h["coordinator_lost_at"] for h in hellos.values()
                  if h.get("coordinator_lost_at")), default=None)
    move = dict(facts.taking, t_lost=t_lost,
                detect_to_taken_s=round(facts.taking["t_taken"] - t_lost, 3)
                if t_lost else None, gen=known.gen,
                nodes_heard=sorted(hellos), from_node=(known.moves[-1]["node"]
                                                       if known.moves else None))
    facts.record_move(move)
    out = Takeover(gen=known.gen, ranks={int(w): r for w, r in last["ranks"].items()},
                   plan=plan, notices=known.notices, moves=known.moves + [move],
                   record=known.record, preempt=preempt, regroup=regroup)
    log(f"[checkpointless] took over as the coordinator at generation {known.gen} "
        f"(node {move['node']}, token {move['token']}): {len(hellos)} node(s) answered, "
        f"{len(out.ranks)} ranks" +
        (f"; the coordinator was lost {move['detect_to_taken_s']:.2f} s before"
         if t_lost else ""))
    return out


def adopt(pool, store, plan: dict, known) -> dict[int, dict]:
    """Wait up to node_timeout_s for every node's agent to say hello to this store, with its
    processes (alive or not, spare or not) and its next command's number; every worker of
    `plan` is adopted by the cluster pool, with those of nodes that never answered (which
    fence_silent_nodes declares lost at its next look). Returns the hellos, by node."""
    pool.store, pool.port = store, store.port
    for k, why in known.fenced.items():
        if k in pool.nodes:
            pool.nodes[k].lost = True
            store.set(protocol.node_health_key(k), why)  # its agent's next write reads it
    hellos = _hellos(store, [k for k, n in pool.nodes.items() if not n.lost],
                     pool.node_timeout_s)
    now = time.time()
    pool.next_wid = max(pool.next_wid, known.next_wid)
    # a node that never answered was last heard of when the coordinator was lost (as the first
    # node to see it gone says): it is lost at the next look, its failure dated then
    t_lost = min((h["coordinator_lost_at"] for h in hellos.values()
                  if h.get("coordinator_lost_at")), default=now - pool.node_timeout_s - 1)
    for k, n in pool.nodes.items():
        if n.lost:  # fenced before: its key keeps the fence word written above
            continue
        h = hellos.get(k)
        if not h:
            pool.resume_node(k, min(t_lost, now - pool.node_timeout_s - 0.01), None)
            # a record that never changes (refresh reads every live node's in one call, which
            # would wait for a missing one): silent, so lost at the next look
            store.set(protocol.node_health_key(k), SILENT.to_json())
            continue
        pool.resume_node(k, now, h.get("next_cmd", 0), h.get("bell"))
        for wid_s, info in h.get("workers", {}).items():
            wid = int(wid_s)
            pool.adopted(wid, k, info["slot"], now, info.get("pid"), info.get("code"))
            if info.get("ready") and info.get("code") is None:  # warm, as it told its node
                store.set(protocol.ready_key(wid), f"{now:.6f}")
    pool.bells.ring_again(store, pool.nodes)  # the rings its agents await, in this store
    for wid_s, rank in plan["ranks"].items():
        wid = int(wid_s)
        store.set(protocol.ready_key(wid), f"{now:.6f}")  # it trained: it had started
        w = pool.workers.get(wid) or pool.adopted(wid, plan["nodes"][wid_s],
                                                  rank % pool.per_node, now)
        w.rank = rank
    return hellos


def republish_notices(store, record: dict) -> tuple[dict | None, dict | None]:
    """The notices the coordinators before wrote (a preemption, a straggler asked to leave, a
    grow's regroup), in this store again under their numbers: a rank waiting for the next one
    goes on waiting here, and a rank that joins now reads them all. Returns the preemption's and
    the newest regroup's, if any."""
    preempt = regroup = None
    for name, raw in sorted(record.items(), key=lambda kv: _notice_number(kv[0])):
        if name.startswith("notice/"):
            store.set(protocol.notice_key(int(name[7:])), raw)
            n = json.loads(raw)
            preempt = n if n.get("kind") == "preempt" else preempt
            regroup = n if n.get("kind") == "regroup" else regroup
    return preempt, regroup


def _notice_number(name: str) -> int:
    return int(name[7:]) if name.startswith("notice/") else -1


def _hellos(store, nodes: list[int], timeout_s: float) -> dict[int, dict]:
    """The hellos of `nodes` that arrive within timeout_s, by node."""
    waiting = {k: protocol.node_hello_key(k) for k in nodes}
    deadline = time.time() + timeout_s
    while time.time() < deadline and not store.check(list(waiting.values())):
        time.sleep(D.remote_poll_s)
    heard = [k for k, key in waiting.items() if store.check([key])]
    if not heard:
        return {}
    return dict(zip(heard, (json.loads(v) for v in store.multi_get([waiting[k] for k in heard]))))


def _plan_of(gen: int, known_plan: dict, lost: int) -> membership.Plan:
    """A plan as the facts keep it, made a Plan again."""
    # a shrunk job's placement (absent from plans recorded before it, or never shrunk)
    return membership.Plan(gen=gen, world_size=known_plan["world_size"],
                           ranks={int(w): r for w, r in known_plan["ranks"].items()}, lost=lost,
                           nodes={int(w): k for w, k in known_plan["nodes"].items()},
                           hosts={int(w): list(h)
                                  for w, h in known_plan.get("hosts", {}).items()},
                           logical_world=known_plan.get("logical_world", 0))
