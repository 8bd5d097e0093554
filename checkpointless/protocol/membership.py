"""Membership generations kept in the supervisor's store.

Every change of who trains (start, a failure, a spare taking over) is a new generation `g` with a
plan: which worker holds which rank and the world size. Workers build a fresh process group for each
generation on its own store prefix, so nothing left from an older, broken group (keys, sockets) can
leak into the new one. The store lives in the supervisor, never in a training worker, so losing
any worker, rank 0 included, loses no coordination state.

What a rank reads per generation does not grow with the job: its own node's part (who joined or
left there), which carries the plan's head (world size, nodes with members). A rank's own rank
never changes while it lives (a lost rank goes to a spare), so a survivor only learns whether it is still in.
The exception is a shrink (checkpointless.shrink, no spare ready): the survivors are numbered
anew and a survivor then hosts more than one logical rank; the plan's head then carries the
whole placement (worker/logical.py), O(processes), and only while it is not one logical rank per
process.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from . import keys


@dataclass
class Plan:
    """Who holds which rank in one generation, as the supervisor keeps it: the whole map."""
    gen: int
    world_size: int
    ranks: dict[int, int]  # worker id -> rank
    t_published: float = 0.0
    lost: int = 0  # workers the supervisor had declared lost when it published this plan
    nodes: dict[int, int] = field(default_factory=dict)  # worker id -> node (absent: node 0)
    # after a shrink: worker id -> the logical ranks it hosts, of `logical_world` (0: the world
    # size); empty while every process hosts the logical rank equal to its own rank
    hosts: dict[int, list[int]] = field(default_factory=dict)
    logical_world: int = 0

    def node_of(self, wid: int) -> int:
        return self.nodes.get(wid, 0)


@dataclass
class Seat:
    """What one worker reads of a generation's plan: its own rank, and its node's share."""
    gen: int
    world_size: int
    rank: int
    node: int
    members_here: int  # members of this generation on this worker's node
    nodes: int  # nodes with members
    lost: int
    t_published: float
    logical_world: int = 0  # the job's logical world (0: the world size)
    # after a shrink, the logical ranks each process rank runs; empty: process r runs rank r
    placement: tuple[tuple[int, ...], ...] = ()

    @property
    def logical_ranks(self) -> tuple[int, ...]:
        return self.placement[self.rank] if self.placement else (self.rank,)

    @property
    def logical_size(self) -> int:
        return self.logical_world or self.world_size


def parts(plan: Plan, before: Plan | None) -> dict[int, dict]:
    """Node k -> its part of `plan`: who joined there since `before` (every member in the first
    generation), who left, and how many members it has. A rank reads its own node's part only,
    so what every rank reads does not grow with the job (a whole map per rank would: R^2)."""
    old = before.ranks if before else {}
    nodes = {plan.node_of(w) for w in plan.ranks}
    if before:
        nodes |= {before.node_of(w) for w in old}
    out = {k: {"joined": {}, "left": [], "members": 0} for k in nodes}
    for wid, rank in plan.ranks.items():
        part = out[plan.node_of(wid)]
        part["members"] += 1
        if old.get(wid) != rank:
            part["joined"][str(wid)] = rank
    for wid in old:
        if wid not in plan.ranks:
            out[before.node_of(wid)]["left"].append(wid)
    return out


def connect(host: str, port: int, timeout_s: float = 120.0) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def host(host: str, port: int = 0, timeout_s: float = 60.0):
    """A store server on `port` (0: any free one), and a client connection to it for the host's
    own calls. The server object's built-in client stalls for up to 5 s while the server wakes
    many waiters at once (64 ranks woken by one plan, torch 2.13); a recovery must not."""
    server = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=timeout_s))
    return server, connect(host, server.port, timeout_s)


def current_gen(store) -> int:
    gen = peek(store, keys.GEN)
    return -1 if gen is None else int(gen)


def publish(store, plan: Plan, before: Plan | None = None) -> None:
    """Write every node's part, then the plan (what a waiting rank wakes on), then move `gen`;
    the generation before it, if its barrier is still open, is marked stale so that its members
    stop waiting for it."""
    plan.t_published = time.time()
    by_node = parts(plan, before)
    head = {"gen": plan.gen, "world_size": plan.world_size, "t": plan.t_published,
            "lost": plan.lost, "nodes": sum(1 for v in by_node.values() if v["members"]),
            "logical_world": plan.logical_world}
    if plan.hosts:  # the whole placement, by process rank: a reduction in logical order needs
        by_rank = {rank: list(plan.hosts[wid]) for wid, rank in plan.ranks.items()}  # it all
        head["placement"] = [by_rank[r] for r in range(plan.world_size)]
    # each part carries the head too: a rank reads its node's part and nothing else
    store.multi_set([keys.plan_node_key(plan.gen, k) for k in by_node],
                    [json.dumps(dict(v, **head)) for v in by_node.values()])
    store.set(keys.plan_key(plan.gen), json.dumps(head))
    if plan.gen > 0:
        store.compare_set(keys.barrier_done_key(plan.gen - 1), "", "stale")
    store.set(keys.GEN, str(plan.gen))


def run(steps, stores: dict):
    """Carry out a protocol's steps against blocking store clients. `steps` is a generator that
    yields each store call as (which store, method, *args) and is sent its result: the protocol
    is written once, and the scale harness runs the same steps over thousands of connections
    from one event loop (launcher/bench/scale/wire.py)."""
    try:
        call = next(steps)
        while True:
            where, name, *args = call
            call = steps.send(getattr(stores[where], name)(*args))
    except StopIteration as done:
        return done.value


def follow_steps(wid: int, node: int, rank: int, after_gen: int, gen: int):
    """The store calls of `follow`, as steps (see `run`); all of them go to the node store. One
    read per generation (a recovery has one): a node's part carries the plan's head."""
    part = None
    for g in range(after_gen + 1, gen + 1):
        part = yield from peek_steps("node", keys.plan_node_key(g, node))
        if part is None:  # nothing here in g: no member, nobody joined or left (a spare node)
            continue
        part = json.loads(part)
        if wid in part["left"]:
            rank = -1
        rank = part["joined"].get(str(wid), rank)
    if rank < 0 or part is None:  # a member's node always has a part (it has members)
        return None
    return Seat(gen=gen, world_size=part["world_size"], rank=rank, node=node,
                members_here=part["members"], nodes=part["nodes"], lost=part["lost"],
                t_published=part["t"], logical_world=part.get("logical_world", 0),
                placement=tuple(tuple(h) for h in part.get("placement", ())))


# what `peek` asks compare_set to expect and set: a value no key of the protocol ever holds
_ABSENT = "\x00absent"


def peek_steps(where: str, key: str):
    """`key`'s value, or None where it is not set, in one round trip: torch's client makes a get
    two (it waits for the key first). A compare_set that expects, and would set, a value no key
    holds changes nothing and answers the value; on a missing key it answers what it expected."""
    value = yield (where, "compare_set", key, _ABSENT, _ABSENT)
    return None if value == _ABSENT.encode() else value


def peek(store, key: str) -> bytes | None:
    return run(peek_steps("store", key), {"store": store})


def follow(store, wid: int, node: int, rank: int, after_gen: int, gen: int) -> Seat | None:
    """Worker `wid` of node `node`, holding `rank` (-1: none) as of generation `after_gen`,
    reads generation `gen` in `store` (its node's): the plan and its node's parts of every
    generation in between, in one call. Its seat in `gen`, or None when it holds no rank there
    (a spare not picked, or a rank that was dropped)."""
    return run(follow_steps(wid, node, rank, after_gen, gen), {"node": store})


def counter(store, key: str) -> int:
    return store.add(key, 0)


def tell(store, counter_key: str, wid: int) -> None:
    """Worker `wid` reported (its report written first): its id goes on the counter's list
    (keys.who), then the counter moves, so that the coordinator reads one list, not a key per
    rank (16,384 round trips at 16,384 ranks, on the way to its decision)."""
    try:
        store.append(keys.who(counter_key), f"{wid} ")
    except (AttributeError, NotImplementedError, RuntimeError):  # a store without append: the
        pass  # coordinator, finding the list short, looks at every rank (told)
    store.add(counter_key, 1)


def told(store, counter_key: str, count: int) -> set[int] | None:
    """The workers on `counter_key`'s list, once it holds at least `count` of them; None where
    it holds fewer (a report made without the list): then every rank is to be looked at."""
    said = (peek(store, keys.who(counter_key)) or b"").split()  # one entry per report: a
    return {int(w) for w in said} if len(said) >= count else None  # worker may report twice


def barrier_steps(seat: Seat):
    """The store calls of `barrier`, as steps (see `run`)."""
    g = seat.gen
    done = keys.barrier_done_key(g)
    if (yield ("node", "add", keys.barrier_node_key(g, seat.node), 1)) == seat.members_here:
        if (yield ("job", "add", keys.barrier_key(g), 1)) == seat.nodes:
            yield ("job", "compare_set", done, "", "go")
    # the outcome is read where the plan was: the node store (its agent copies it there)
    yield ("node", "wait", [done], timedelta(days=1))
    return (yield from peek_steps("node", done)) == b"go"


def barrier(store, node_store, seat: Seat) -> bool:
    """Every member of `seat.gen` arrives; False if a newer generation replaced it meanwhile.

    Gathered by node: each member adds to its node's counter (its node store), the node's last
    adds once to the job's, and the job's last opens the barrier; every member waits on that one
    key, woken by the store, with no polling. Done before the process group exists, so a member
    that died after the plan was published cannot block the others inside the group's
    constructor (the supervisor's next plan marks this barrier stale)."""
    return run(barrier_steps(seat), {"job": store, "node": node_store})


def relay(store, node_store, node: int, gen: int) -> None:
    """A node's agent, for its workers: wait for generation `gen`'s plan in the job's store and
    copy it to the node's store (its node's part first, then the head a waiting rank wakes on,
    then `gen`); then wait for its barrier's outcome ("go", or "stale" once a newer plan exists)
    and copy that. The job's store then wakes one waiter per node for each, not one per rank:
    every rank waits, and reads, in its node's store."""
    store.wait([keys.plan_key(gen)], timedelta(days=1))
    part_key = keys.plan_node_key(gen, node)
    part = peek(store, part_key)  # written before the head: absent means none for this node
    names, values = ([part_key], [part]) if part is not None else ([], [])
    # a part carries the head's every field, and in a node's store the head is only waited
    # for (its ranks then read their part): a node with a part copies it under both keys, one
    # read fewer per node and generation at the coordinator
    names += [keys.plan_key(gen), keys.GEN]
    values += [part if part is not None else peek(store, keys.plan_key(gen)), str(gen)]
    node_store.multi_set(names, values)
    done = keys.barrier_done_key(gen)
    store.wait([done], timedelta(days=1))
    node_store.set(done, peek(store, done))


def results_in(store, world_size: int) -> bool:
    """Every rank reported its result (job.finish): the end of the run is reached."""
    return all(store.check([keys.result_key(r)]) for r in range(world_size))
