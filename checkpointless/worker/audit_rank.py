"""A rank's part in audits (audit.py): at an audited step the audited rank and its witness tap
their gradients and publish the digests; the witness ships the step's parameters to a spare.
Also where an injected `sdc` fault makes this rank's gradient wrong."""
from __future__ import annotations

import json
import time

import torch

from .. import protocol
from .audit import GradTap, audited

END_WAIT_S = 120.0  # the longest the ranks wait at the loop's end for the last audits


class RankAudits:
    """Armed by the step loop as a step's body opens, read as it closes."""

    def __init__(self, store, worker_id: int, every: int, connect, log=print):
        self.store, self.worker_id, self.every = store, worker_id, every
        self._connect, self._log = connect, log
        self.tap: GradTap | None = None
        self._roles: tuple[int, int] | None = None
        self._shipper = None

    def install(self, objects, faults) -> None:
        """Tap the gradients of the protected model (under checkpointless's ddp wrapper, the
        model inside) when audits are on or an sdc fault may strike."""
        from .ddp import DistributedDataParallel
        if self.every <= 0 and not any(f.kind == "sdc" for f in faults):
            return
        for obj in objects:
            if self.tap is None and isinstance(obj, torch.nn.Module):
                self.tap = GradTap(obj.module if isinstance(obj, DistributedDataParallel)
                                   else obj)

    def open(self, step: int, rank: int, world: int, sdc: bool) -> None:
        if self.tap is None:
            return
        self._roles = audited(step, self.every, world)
        if (self._roles is not None and rank in self._roles) or sdc:
            witness = self._roles is not None and rank == self._roles[1]
            self.tap.arm(step, capture=witness, flip=sdc)
        else:
            self.tap.disarm()

    def close(self, step: int, rank: int, world: int, gen: int, committed: bool) -> None:
        """The step's body ended: publish what an audited rank or witness computed (a step cut
        short, or redone from kept gradients without a backward, publishes nothing)."""
        tap = self.tap
        if tap is None or not tap.armed:
            return
        if tap.flipped:
            self._log(f"[fault] rank {rank}, step {step}: one bit of the gradient of "
                      f"{tap.flipped} flipped before the reduction", flush=True)
        found, params = tap.digests(), tap.params
        tap.disarm()
        roles = self._roles
        if not committed or found is None or roles is None or rank not in roles:
            return
        self.store.set(protocol.audit_digest_key(step, rank), json.dumps(
            {"grads": found[0], "params": found[1], "wid": self.worker_id, "gen": gen,
             "world": world}))
        if rank == roles[1]:
            if self._shipper is None:
                from .auditor import Shipper
                self._shipper = Shipper(self._connect, self._log)
            self._shipper.ship({"step": step, "rank": roles[0], "witness": roles[1],
                                "world": world, "gen": gen}, params)

    def last_audited(self, completed: int, world: int) -> int | None:
        """The newest audited step before `completed`."""
        if self.every <= 0 or world < 2 or completed <= 0:
            return None
        return (completed - 1) // self.every * self.every

    def judged_through(self, step: int) -> bool:
        """The spares judged every audit up to `step`, or no spare is auditing (nobody will)."""
        if (protocol.read_json(self.store, protocol.AUDIT_DONE) or 0) >= step:
            return True
        from .auditor import serving
        return not serving(self.store)

    def settle(self, completed: int, world: int, failed) -> bool:
        """At the loop's end: wait until the spares judged the last audited step, so that a
        wrong gradient found only now is still recovered (the accused is evicted, the job
        rewinds, and the loop goes on); `failed()` is checked between looks. False when it
        turned True (a peer was lost: the caller recovers)."""
        last = self.last_audited(completed, world)
        if last is None:
            return True
        deadline = time.time() + END_WAIT_S
        while not self.judged_through(last):
            if failed():
                return False
            if time.time() > deadline:
                self._log(f"[checkpointless] audit: the spares had not judged step {last} "
                          f"{END_WAIT_S:.0f} s after the last step; the run ends with it "
                          "unchecked", flush=True)
                return True
            time.sleep(0.2)
        return not failed()
