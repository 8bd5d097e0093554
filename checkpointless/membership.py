"""Membership generations kept in the supervisor's store.

Every change of who trains (start, a failure, a spare taking over) is a new generation `g` with a
plan: which worker holds which rank and the world size. Workers build a fresh process group for each
generation on its own store prefix, so nothing left from an older, broken group (keys, sockets) can
leak into the new one. The store lives in the supervisor, never in a training worker, so losing
any worker, rank 0 included, loses no coordination state.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from . import protocol


@dataclass
class Plan:
    """Who holds which rank in one generation."""
    gen: int
    world_size: int
    ranks: dict[int, int]  # worker id -> rank
    t_published: float = 0.0
    lost: int = 0  # workers the supervisor had declared lost when it published this plan

    def to_json(self) -> str:
        return json.dumps({"gen": self.gen, "world_size": self.world_size, "t": self.t_published,
                           "lost": self.lost,
                           "ranks": {str(k): v for k, v in self.ranks.items()}})

    @classmethod
    def from_json(cls, text) -> "Plan":
        d = json.loads(text)
        return cls(gen=d["gen"], world_size=d["world_size"], t_published=d["t"],
                   lost=d.get("lost", 0), ranks={int(k): int(v) for k, v in d["ranks"].items()})


def connect(host: str, port: int, timeout_s: float = 120.0) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def current_gen(store) -> int:
    return int(store.get(protocol.GEN)) if store.check([protocol.GEN]) else -1


def publish(store, plan: Plan) -> None:
    """Write the plan first, then move `gen`: a reader that sees the new gen finds its plan."""
    plan.t_published = time.time()
    store.set(protocol.plan_key(plan.gen), plan.to_json())
    store.set(protocol.GEN, str(plan.gen))


def read_plan(store, gen: int) -> Plan:
    return Plan.from_json(store.get(protocol.plan_key(gen)))


def counter(store, key: str) -> int:
    return store.add(key, 0)


def barrier(store, gen: int, world_size: int,
            poll_s: float = protocol.DEFAULTS.plan_poll_s) -> bool:
    """All members of `gen` arrive; False if a newer generation replaces it while waiting.

    Done on the store, before the process group exists, so a member that died after the plan was
    published cannot block the others inside the process-group constructor.
    """
    key = protocol.barrier_key(gen)
    store.add(key, 1)
    while counter(store, key) < world_size:
        if current_gen(store) != gen:
            return False
        time.sleep(poll_s)
    return True


def results_in(store, world_size: int) -> bool:
    """Every rank reported its result (job.finish): the end of the run is reached."""
    return all(store.check([protocol.result_key(r)]) for r in range(world_size))
