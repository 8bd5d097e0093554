"""Who coordinates: a role held through an etcd lease, taken over when its holder is gone.

Every launcher that may coordinate is a candidate. The holder is whoever created the role's key
under a lease of its own; the key's `create_revision` is its token. etcd's revisions only grow,
so each new holder's token is larger than every earlier one's.

- The holder refreshes its lease every third of its TTL. If it dies, hangs or is cut off, the
  lease runs out, etcd deletes the key, and the next candidate to look creates it: the role
  moves within the TTL plus one look (`poll_s`).
- A holder counts itself deposed once a TTL has passed since it *sent* its last refresh that
  etcd answered. etcd's clock for the lease started no earlier than that, so the holder gives up
  no later than etcd can hand the role on.
- The safety does not rest on clocks. Every write the holder makes to etcd is a transaction
  that holds only while the role's key still has the holder's token (`write`): a holder that
  comes back from a partition, or wakes from a pause, finds its writes refused (`Fenced`).
"""
from __future__ import annotations

import json
import threading
import time

from .etcd import Etcd, EtcdError, EtcdUnavailable


class Fenced(RuntimeError):
    """This holder's role was taken over (or its lease ran out): it may change nothing."""


class Role:
    """One candidate's side of the role kept at `key` in `etcd`. `me` is what the holder
    publishes there (its node, the address of the store it hosts)."""

    def __init__(self, etcd: Etcd, key: str, me: dict, ttl_s: int = 3, poll_s: float = 0.2,
                 on_lost=None):
        if ttl_s < 2:  # etcd's leases are whole seconds; 1 s leaves no room for a refresh
            raise ValueError(f"a role's lease TTL must be at least 2 s, not {ttl_s}")
        self.etcd, self.key, self.me = etcd, key, me
        self.ttl_s, self.poll_s = int(ttl_s), poll_s
        self.on_lost = on_lost
        self.token = 0  # the role key's create_revision while this candidate holds it
        self.lease = 0
        self.taken_at = 0.0
        self.lost = threading.Event()  # set once a holder is deposed
        self._stop = threading.Event()
        self._valid_until = 0.0

    # ---- looking --------------------------------------------------------------------------------
    def holder(self) -> tuple[dict | None, int]:
        """The current holder's record and token, (None, 0) when nobody holds the role."""
        e = self.etcd.get(self.key)
        return (json.loads(e.value), e.create_revision) if e else (None, 0)

    # ---- taking ---------------------------------------------------------------------------------
    def try_take(self) -> bool:
        """Take the role if nobody holds it; True when this candidate holds it now."""
        if self.token:
            return self.held()
        if not self.lease:
            self.lease = self.etcd.grant(self.ttl_s)
        sent = time.time()
        ok, _ = self.etcd.create(self.key, json.dumps(dict(self.me, t=time.time())), self.lease)
        if not ok:
            return False
        e = self.etcd.get(self.key)
        if e is None or e.lease != self.lease:  # our lease ran out between the two calls
            self.lease = 0
            return False
        self.token, self.taken_at = e.create_revision, time.time()
        self._valid_until = sent + self.ttl_s
        threading.Thread(target=self._keep, daemon=True, name="role-lease").start()
        threading.Thread(target=self._watch, daemon=True, name="role-expiry").start()
        return True

    def campaign(self, stop: threading.Event | None = None) -> bool:
        """Wait until this candidate holds the role (True), or until `stop` is set (False).
        etcd being unreachable is waited out too: the role cannot move without a quorum."""
        while not (stop is not None and stop.is_set()):
            try:
                if self.try_take():
                    return True
            except (EtcdUnavailable, EtcdError):
                self.lease = 0  # a lease we may have been granted is of no use now
            time.sleep(self.poll_s)
        return False

    def held(self) -> bool:
        """This candidate holds the role as far as its own clock can tell (see `write` for the
        guarantee)."""
        return bool(self.token) and not self.lost.is_set() and time.time() < self._valid_until

    # ---- acting as the holder -------------------------------------------------------------------
    def write(self, key: str, value: str | bytes) -> None:
        """Write `key` in etcd only while this candidate still holds the role; `Fenced` if not."""
        if not self.token or self.lost.is_set():
            raise Fenced(f"this launcher no longer holds {self.key}")
        if not self.etcd.put_if(key, value, self.key, self.token):
            self._depose("another launcher holds the role now")
            raise Fenced(f"{self.key} was taken over (this holder's token {self.token} is stale)")

    def resign(self) -> None:
        """Give the role up at once (the job is over): the next candidate need not wait a TTL."""
        self._stop.set()
        if self.token and not self.lost.is_set():
            try:
                self.etcd.delete_if(self.key, self.token)
                self.etcd.revoke(self.lease)
            except (EtcdUnavailable, EtcdError):
                pass
        self.token = 0

    # ---- the lease ------------------------------------------------------------------------------
    def _keep(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            sent = time.time()
            try:
                ttl = self.etcd.keepalive(self.lease)
            except (EtcdUnavailable, EtcdError):
                ttl = -1  # unknown: the lease lives until _valid_until at most
            if ttl > 0:
                self._valid_until = sent + self.ttl_s
            elif ttl == 0:
                return self._depose("its lease expired")
            if self.lost.is_set():
                return

    def _watch(self) -> None:
        # apart from _keep: a refresh may block for every endpoint's timeout in turn, and the
        # holder must count itself deposed when its lease may have run out, not after that call
        while not self.lost.is_set():
            left = self._valid_until - time.time()
            if left <= 0:
                return self._depose(f"its lease could not be refreshed for {self.ttl_s} s")
            if self._stop.wait(min(left, self.poll_s)):
                return

    def _depose(self, why: str) -> None:
        if self.lost.is_set():
            return
        self.lost.set()
        if self.on_lost is not None:
            self.on_lost(why)

