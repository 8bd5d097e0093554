"""Redundancy for sharded state: each rank's slice lives on in peers' host memory.

Under FSDP a rank holds the only copy of its slice of parameters and optimizer state, so a dead
rank takes its slice with it. Every `interval` steps, at the start of a step, each rank snapshots
its slice into host memory and sends a copy to `factor - 1` holders (the next ranks on the ring,
or ranks a node apart when placement spreads copies over nodes). Each rank keeps its own snapshot
too, so that all ranks can roll back to the newest step for which every slice exists somewhere.

The two newest versions are kept on each side: a failure in the middle of an exchange leaves the
previous version complete everywhere.
"""
from __future__ import annotations


import torch
import torch.distributed as dist

from .failures import MembershipMoved, communicating
from .transfer import flatten_state

KEEP = 2


class ShardReplicas:
    """Owns this rank's snapshots of its own shard and the copies it holds of its peers' shards
    (two versions each), and the exchange that refreshes them."""

    def __init__(self, factor: int = 2, interval: int = 1, offset: int = 1):
        if factor < 1 or interval < 1:
            raise ValueError(f"replication factor={factor} and interval={interval} must be >= 1")
        self.factor, self.interval, self.offset = factor, interval, offset
        self.own: dict[int, tuple[bytes, torch.Tensor]] = {}  # step -> my slice
        self.held: dict[int, dict[int, tuple[bytes, torch.Tensor]]] = {}  # rank -> step -> slice
        self.bytes_per_copy = 0
        self._sizes: dict[int, int] = {}  # source rank -> bytes of its last message

    def holders_of(self, rank: int, world: int) -> list[int]:
        return [(rank + i * self.offset) % world for i in range(1, self.factor)
                if (rank + i * self.offset) % world != rank]

    def sources_for(self, rank: int, world: int) -> list[int]:
        return [(rank - i * self.offset) % world for i in range(1, self.factor)
                if (rank - i * self.offset) % world != rank]

    @staticmethod
    def _trim(versions: dict) -> None:
        for s in sorted(versions)[:-KEEP]:
            del versions[s]

    def due(self, step: int) -> bool:
        return self.factor > 1 and step % self.interval == 0

    def replicate(self, step: int, state, rank: int, world: int, moved=None,
                  sizes_known: bool = False) -> int:
        """Snapshot my slice (the state after `step` steps) and swap copies with my peers.

        A collective over the members: all ranks call it at the same step. Returns bytes sent.
        In steady state (`sizes_known`, the same on every rank) each rank sends one message per
        holder, sized as last time: a peer that fails cannot leave another waiting for a second
        message that will never come. Otherwise sizes go first, in their own exchange.
        """
        skel, flat = flatten_state(state)
        self.own[step] = (skel, flat.clone())  # flatten may alias a single tensor: own the bytes
        self._trim(self.own)
        self.bytes_per_copy = len(skel) + flat.numel()
        payload = torch.cat([torch.tensor([len(skel)], dtype=torch.int64).view(torch.uint8),
                             torch.frombuffer(bytearray(skel), dtype=torch.uint8), flat])
        holders, sources = self.holders_of(rank, world), self.sources_for(rank, world)
        if not (sizes_known and all(s in self._sizes for s in sources)):
            mine = torch.tensor([payload.numel()], dtype=torch.int64)
            got = {s: torch.empty(1, dtype=torch.int64) for s in sources}
            _run([dist.P2POp(dist.isend, mine, h) for h in holders] +
                 [dist.P2POp(dist.irecv, got[s], s) for s in sources], moved)
            self._sizes.update({s: int(got[s]) for s in sources})
        bufs = {s: torch.empty(self._sizes[s], dtype=torch.uint8) for s in sources}
        _run([dist.P2POp(dist.isend, payload, h) for h in holders] +
             [dist.P2POp(dist.irecv, bufs[s], s) for s in sources], moved)
        for s in sources:  # only complete copies are kept
            n = int(bufs[s][:8].view(torch.int64))
            versions = self.held.setdefault(s, {})
            versions[step] = (bufs[s][8:8 + n].numpy().tobytes(), bufs[s][8 + n:].clone())
            self._trim(versions)
        return self.bytes_per_copy * len(holders)

    def summary(self) -> dict:
        return {"own": sorted(self.own), "held": {str(r): sorted(v) for r, v in self.held.items()}}

    def host_bytes(self) -> int:
        own = sum(f.numel() for _, f in self.own.values())
        held = sum(f.numel() for v in self.held.values() for _, f in v.values())
        return own + held


def _run(ops, moved=None) -> None:
    """Run point-to-point ops and wait for them.

    (Gloo's send/recv work reports completion only through wait(), so this cannot poll; a peer
    that leaves for recovery releases us by tearing its group down, which closes the sockets.)"""
    if not ops:
        return
    with communicating("the replica exchange"):
        for r in dist.batch_isend_irecv(ops):
            r.wait()
    if moved is not None and moved():
        raise MembershipMoved("the membership moved during a replica exchange")


def restorable_step(infos: list[dict]) -> int | None:
    """The newest step to which every member's slice can be brought.

    `infos[r]` = {"completed": steps done by rank r (-1: a spare, holds nothing),
                  "own": steps of r's own snapshots, "held": {rank: steps of its copies}}.
    A member with state can be at step s if it completed exactly s or snapshotted s; a spare's
    rank can be at s if a member with state holds a copy of that rank's slice at s.
    """
    with_state = [r for r, i in enumerate(infos) if i["completed"] >= 0]
    spares = [r for r, i in enumerate(infos) if i["completed"] < 0]
    candidates = {i["completed"] for i in infos if i["completed"] >= 0}
    candidates |= {s for i in infos for s in i["own"]}
    for s in sorted(candidates, reverse=True):
        if not all(infos[r]["completed"] == s or s in infos[r]["own"] for r in with_state):
            continue
        if all(any(s in infos[h]["held"].get(str(f), []) for h in with_state) for f in spares):
            return s
    return None


def pick_holders(infos: list[dict], step: int) -> dict[int, int]:
    """For each spare's rank, a member holding its slice at `step`, spreading the load."""
    load: dict[int, int] = {}
    out = {}
    for f, info in enumerate(infos):
        if info["completed"] >= 0:
            continue
        holders = [h for h, i in enumerate(infos) if i["completed"] >= 0
                   and step in i["held"].get(str(f), [])]
        h = min(holders, key=lambda x: (load.get(x, 0), x))
        load[h] = load.get(h, 0) + 1
        out[f] = h
    return out
