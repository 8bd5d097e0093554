"""Redundancy for sharded state: each rank's slice lives on in peers' host memory.

Under FSDP a rank holds the only copy of its slice of parameters and optimizer state, so a dead
rank takes its slice with it. Every `interval` steps, at the start of a step, each rank copies its
slice into a host buffer (its own snapshot) and a background thread sends that buffer to
`factor - 1` holders (the next ranks on the ring, or ranks a node apart when placement spreads
copies over nodes) while the step computes. The step itself pays for the copy only.

The thread talks over its own gloo group (one per generation, built by the thread itself on first
use): collectives of the training group cannot be used from two threads at once. Before a rank
starts the exchange of a new snapshot it waits for its previous exchange to finish; that wait
watches for a newer membership, so a peer lost mid-exchange is never waited for.

Which versions exist. A copy counts only once every byte of it has arrived (`held` gets the entry
after the receive completed). With interval k, take P the newest snapshot any rank has taken. That
rank finished step P-1, whose collectives every rank joined after finishing its exchange of P-2k.
So version P-2k is complete on every holder, and at most two newer ones are in flight or partial.
Each side therefore keeps three versions: own snapshots v-2k, v-k, v, and held copies v-2k, v-k
plus the one arriving. A failure at any moment leaves a version that every slice has somewhere
(restore.restorable_step finds the newest). Buffers of dropped versions are reused, not reallocated.
"""
from __future__ import annotations

import pickle
import threading
import time

import numpy as np
import torch

from .failures import MembershipMoved, PeerLost
from .exchange import Exchanger, Shipment
from . import scrub
from .scrub import CopySums
from .transfer import strip_tensors

KEEP = 3  # versions of each slice kept on each side (see above)
ROLLBACK_KEEP = 2  # own versions kept when twins are the copies (HSDP, see ShardReplicas)
_SLACK = 1 << 16  # buffers are rounded up so a skeleton a few bytes longer fits the same buffer


class Abandoned(RuntimeError):
    """The exchange belongs to a generation that was left; its results are discarded."""


class ShardReplicas:
    """Owns this rank's snapshots of its own shard and the copies it holds of its peers' shards,
    their host buffers, and the background exchange that refreshes the copies."""

    def __init__(self, factor: int = 2, interval: int = 1, offset: int = 1,
                 shard_size: int = 0, pp_size: int = 1):
        if factor < 1 or interval < 1:
            raise ValueError(f"replication factor={factor} and interval={interval} must be >= 1")
        self.factor, self.interval, self.offset = factor, interval, offset
        # HSDP with replica groups: twins (mesh.py) are the copies, so snapshots are
        # taken only to roll this rank back, and nothing is sent
        self.shard_size = shard_size
        self.pp_size = pp_size  # pipeline stages: a slice's twins are in its own stage
        self.rollback_only = factor <= 1 and shard_size > 0
        # Own versions kept. With peer copies, three (see above). With twins alone a restore
        # resumes at a step some rank of each position reached or snapshotted: ranks are at
        # most one step apart, so the snapshot of the step in flight's start and the one before
        # it are enough; the second covers a rank that already began the next step
        self.keep_own = ROLLBACK_KEEP if self.rollback_only else KEEP
        self.own: dict[int, tuple[bytes, torch.Tensor]] = {}  # step -> my slice
        self.held: dict[int, dict[int, tuple[bytes, torch.Tensor]]] = {}  # rank -> step -> slice
        self.bytes_per_copy = 0
        # called in the exchange thread as (rank, step) between headers and payloads (faults.py)
        self.on_exchange = None
        self._lock = threading.Lock()  # own, held, the pool and the token, across both threads
        self._pool: list[torch.Tensor] = []  # buffers of dropped versions, to be reused
        self._retired: set[int] = set()  # buffers an abandoned exchange may still read
        self._token = 0  # bumped when a generation is left: its exchange may commit nothing
        self._exchanger: Exchanger | None = None
        self._inflight: Shipment | None = None
        self._pin = torch.cuda.is_available()  # pinned buffers make device-to-host copies fast
        # what the exchanges cost the training thread itself (the rest runs beside the step)
        self.timing = {"exchanges": 0, "snapshot_s": 0.0, "wait_s": 0.0}
        self.sums = CopySums()  # each copy's checksum, checked before use and by a scrub

    def holders_of(self, rank: int, world: int) -> list[int]:
        return [(rank + i * self.offset) % world for i in range(1, self.factor)
                if (rank + i * self.offset) % world != rank]

    def sources_for(self, rank: int, world: int) -> list[int]:
        return [(rank - i * self.offset) % world for i in range(1, self.factor)
                if (rank - i * self.offset) % world != rank]

    def twins(self, rank: int, world: int) -> list[int]:
        """Ranks holding the same slice as `rank` in their live state (HSDP), else none."""
        stage_world = world // self.pp_size
        if not self.shard_size or self.shard_size >= stage_world or \
                stage_world % self.shard_size:
            return []
        from .mesh import Layout
        return Layout(world, self.shard_size, pp=self.pp_size).twins(rank)

    def due(self, step: int) -> bool:
        return (self.factor > 1 or self.rollback_only) and step % self.interval == 0

    # ---- buffers (call with the lock held) ------------------------------------------------
    def _take(self, nbytes: int) -> torch.Tensor:
        fits = [i for i, b in enumerate(self._pool) if b.numel() >= nbytes]
        if fits:  # the smallest that fits (list.remove would compare tensors by value)
            return self._pool.pop(min(fits, key=lambda i: self._pool[i].numel()))
        # none fits: the layout grew (the optimizer state appears after the first step), and
        # smaller spares would never fit again
        self._pool.clear()
        size = -(-nbytes // _SLACK) * _SLACK
        return torch.empty(size, dtype=torch.uint8, pin_memory=self._pin)

    def _release(self, view: torch.Tensor) -> None:
        buf = view if view._base is None else view._base
        if buf.data_ptr() in self._retired:  # an abandoned thread may still read it: drop it
            self._retired.discard(buf.data_ptr())
            return
        self._pool.append(buf)

    @staticmethod
    def _keep_newest(versions: dict, n: int, release) -> None:
        for s in sorted(versions)[:max(0, len(versions) - n)]:
            release(versions.pop(s)[1])

    # ---- the exchange ---------------------------------------------------------------------
    def snapshot(self, step: int, state) -> tuple[torch.Tensor, int]:
        """Copy my slice (the state after `step` steps) into a reused host buffer laid out as
        [tensor bytes | pickled skeleton]; returns (the whole message, its tensor bytes)."""
        skeleton, tensors = strip_tensors(state)
        skel = pickle.dumps(skeleton)
        sizes = [t.numel() * t.element_size() for t in tensors]
        nflat = sum(sizes)
        with self._lock:
            for s in [s for s in self.own if s >= step]:  # redone after a rollback: replaced
                self._release(self.own.pop(s)[1])
            self._keep_newest(self.own, self.keep_own - 1, self._release)
            buf = self._take(nflat + len(skel))
        # one fused copy of every tensor into its place (split makes the places in one call)
        srcs = [t.reshape(-1).view(torch.uint8) for t, n in zip(tensors, sizes) if n]
        if srcs:
            torch._foreach_copy_(list(buf[:nflat].split([n for n in sizes if n])), srcs)
        buf[nflat:nflat + len(skel)].numpy()[:] = np.frombuffer(skel, dtype=np.uint8)
        total = scrub.of(buf[:nflat])  # a pass over the copy, while it is hot in the cache
        with self._lock:
            self.own[step] = (skel, buf[:nflat])
            self.sums.note(("own", step), total)
        self.sums.start_scrub(self.verify)
        self.bytes_per_copy = nflat + len(skel)
        return buf[:nflat + len(skel)], nflat

    def replicate(self, step: int, state, rank: int, world: int, gen: int = 0, connect=None,
                  moved=None) -> int:
        """Snapshot my slice and start sending it to my holders in the background (receiving my
        sources' slices at the same time). Every rank calls it at the same steps. `state`: the
        state, or a function returning it.

        Waits first for this rank's previous exchange (raising PeerLost if it failed, or
        MembershipMoved as soon as `moved()` says a newer generation exists). `connect()` builds
        the side group of generation `gen`; it is called in the exchange thread, once per
        generation. Returns the bytes this exchange sends."""
        t0 = time.perf_counter()
        if callable(state):  # read here, so reading the state dicts is timed with the copy
            state = state()
        payload, nflat = self.snapshot(step, state)
        t1 = time.perf_counter()
        self.wait(moved)
        self.timing["exchanges"] += 1
        self.timing["snapshot_s"] += t1 - t0
        self.timing["wait_s"] += time.perf_counter() - t1
        holders, sources = self.holders_of(rank, world), self.sources_for(rank, world)
        if not holders and not sources:
            return 0
        ex = self._exchanger
        if ex is None or ex.gen != gen or ex.broken:
            if ex is not None:
                self.abandon()
            if connect is None:
                raise ValueError("replicate(): connect (the side group's constructor) is needed")
            ex = self._exchanger = Exchanger(self, gen, connect)
        job = Shipment(step, rank, payload, nflat, holders, sources, self._token)
        job.checksum = self.sums.sums.get(("own", step), 0)
        self._inflight = job
        ex.submit(job)
        return payload.numel() * len(holders)

    def wait(self, moved=None, timeout_s: float | None = None) -> bool:
        """Wait for the exchange in flight, if any; True when none is left in flight.

        Raises PeerLost when it failed, MembershipMoved when `moved()` turns true first. Gloo's
        point-to-point work reports completion only through its own wait(), which the thread
        does; this side polls the thread's event, so it can give up at any moment."""
        job = self._inflight
        if job is None:
            return True
        pause, waited = 0.0005, 0.0
        while not job.done.wait(pause):
            if moved is not None and moved():
                raise MembershipMoved(f"the membership moved during the replica exchange of step "
                                      f"{job.step}")
            waited += pause
            if timeout_s is not None and waited >= timeout_s:
                return False
            pause = min(0.01, pause * 2)
        self._inflight = None
        if job.error is not None:
            raise PeerLost(f"the replica exchange of step {job.step} failed: "
                           f"{job.error}") from job.error
        return True

    def abandon(self, join_s: float = 0.0) -> None:
        """Leave the current generation's exchange: whatever it still does is discarded.

        Called when a recovery begins. The thread may be blocked on a dead peer (tearing the
        group down shuts its sockets too: group.sever_peer_connections) or still building its
        group; it is never joined (unless `join_s`). It commits nothing once the token moved, and the buffer it may
        still be sending from is never reused."""
        with self._lock:
            self._token += 1
            job = self._inflight
            if job is not None and not job.done.is_set():
                self._retired.add(job.payload.data_ptr())
        self._inflight = None
        if self._exchanger is not None:
            self._exchanger.stop(join_s)
            self._exchanger = None

    def close(self, moved=None, timeout_s: float = 30.0) -> None:
        """At the end of a run: let the last exchange finish (peers are still there), then stop
        the thread and wait until its group is gone: a gloo group still being destroyed while
        the process exits aborts it (seen here: exit code -6, "terminate called without an
        active exception"). A failure of that last copy no longer matters."""
        try:
            self.wait(moved, timeout_s)
        except Exception:  # noqa: BLE001  the run is over: a late copy is worth nothing
            pass
        self.abandon(join_s=timeout_s)

    def _commit_receive(self, job: Shipment, headers: dict[int, torch.Tensor]):
        """In the thread, after the headers: drop what the arriving versions replace and hand
        out receive buffers. {source: (buffer view, flat bytes, skeleton bytes)}."""
        out = {}
        with self._lock:
            if job.token != self._token:
                raise Abandoned("generation left")
            for s, h in headers.items():
                step, nflat, nskel, total = (int(x) for x in h)
                if step != job.step:
                    raise RuntimeError(f"replica exchange: rank {s} sent step {step}, "
                                       f"expected {job.step}")
                versions = self.held.setdefault(s, {})
                for old in [v for v in versions if v >= step]:
                    self._release(versions.pop(old)[1])
                self._keep_newest(versions, KEEP - 1, self._release)
                out[s] = (self._take(nflat + nskel)[:nflat + nskel], nflat, nskel, total)
        return out

    def _commit_copies(self, job: Shipment, bufs) -> None:
        """In the thread, once every byte has arrived: the copies become restorable."""
        with self._lock:
            if job.token != self._token:
                raise Abandoned("generation left")
            for s, (buf, nflat, nskel, total) in bufs.items():
                skel = buf[nflat:nflat + nskel].numpy().tobytes()
                self.held.setdefault(s, {})[job.step] = (skel, buf[:nflat])
                self.sums.note((s, job.step), total)  # checked as the members agree (verify)

    # ---- what the agreement reads ----------------------------------------------------------
    def verify(self) -> None:
        """Drop every copy whose bytes no longer match their checksum (scrub.py)."""
        with self._lock:
            versions = {("own", s): f for s, (_, f) in self.own.items()}
            versions.update({(r, s): f for r, v in self.held.items() for s, (_, f) in v.items()})
            for key in self.sums.damaged(versions):
                where = self.own if key[0] == "own" else self.held[key[0]]
                self._release(where.pop(key[1])[1])
            self.sums.forget(set(versions))

    def summary(self) -> dict:
        self.verify()  # a damaged copy is never offered to a restore
        with self._lock:
            return {"own": sorted(self.own),
                    "held": {str(r): sorted(v) for r, v in self.held.items()}}

    def host_bytes(self, part: str = "all") -> int:
        """Host memory of the buffers this holds: "held" the copies of peers' slices, "own" this
        rank's snapshots and the reusable spare buffers, "all" both."""
        with self._lock:
            views = [f for _, f in self.own.values()] if part != "held" else []
            if part != "own":
                views += [f for v in self.held.values() for _, f in v.values()]
            bases = {}
            pool = self._pool if part != "held" else []
            for b in [f if f._base is None else f._base for f in views] + pool:
                bases[b.data_ptr()] = b.numel()
            return sum(bases.values())
