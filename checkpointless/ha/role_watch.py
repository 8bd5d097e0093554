"""A node's view of who coordinates, under coordinator=etcd: the agent's side of leadership.py.

A thread follows the role's key and this node's fence with etcd's watch. When a new holder
appears (a larger token), the node's door (store_door.py) is pointed at its store, and `moved` is
set so that the agent says hello to it. A fence in etcd (this node was declared lost) is read
here too, so that a node coming back from a partition stops its processes before anything else.
When etcd itself cannot be reached (a majority of its members lost, or this node cut off) for
`give_up_s`, the node gives up: nothing could coordinate it any more.
"""
from __future__ import annotations

import json
import threading
import time

from .etcd import Etcd, EtcdError, EtcdUnavailable

# A read while the watches say nothing: a stream a partition left open delivers nothing, and a
# node must still see its fence when the partition heals. Two reads per node every 10 s (0.2 a
# second), where polling read two every 0.25 s (8 a second): 40 times fewer.
IDLE_S = 10.0
STALL_S = 1.0  # the door's oldest call unanswered this long: the coordinator may be cut off


class RoleWatch:
    def __init__(self, etcd: Etcd, prefix: str, node: int, door, give_up_s: float,
                 poll_s: float = 0.25, log=print, on_end=None, idle_s: float = IDLE_S):
        self.etcd, self.prefix, self.node, self.door = etcd, prefix.rstrip("/"), node, door
        self.give_up_s, self.poll_s, self.idle_s, self.log = give_up_s, poll_s, idle_s, log
        self.token = 0  # the holder the door points at
        self.holder: dict | None = None
        self.moved = threading.Event()  # a holder after the first: say hello to it
        self.fenced: str | None = None
        self.gave_up: str | None = None
        self.role_gone_at: float | None = None  # the role's key vanished (its lease ran out)
        # when this node first saw the coordinator before the newest one gone: a broken
        # connection, else the role vanishing from etcd (a partition breaks no connection)
        self.coordinator_lost_at: float | None = None
        # on_end(code, why): this node must stop (3: fenced, 4: given up), called once, from
        # this thread: the agent's own loop may be blocked in a call to a coordinator that is
        # gone and will never answer
        self.on_end = on_end
        self._stop = threading.Event()
        self._changed = threading.Event()  # a watched key changed, or a stream broke
        self._streams: dict = {}  # key -> its etcd watch (etcd.Watch)
        self._broken = False
        threading.Thread(target=self._run, daemon=True, name="role-watch").start()

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()

    def _run(self) -> None:
        """Read the role and the fence, then sleep on etcd's watch of both keys until one of
        them changes, and read them again. While etcd is quiet a node costs it two open streams
        and no request; reads come every `poll_s` only while something is amiss (a watch broke,
        the role is vacant, or the door lost its coordinator), and every `idle_s` regardless,
        should a stream hang where a partition leaves it open."""
        last_ok = time.time()
        while not self._stop.is_set():
            try:
                role, rev_role = self.etcd.get_at(f"{self.prefix}/coordinator")
                fence, rev_fence = self.etcd.get_at(f"{self.prefix}/fence/{self.node}")
            except (EtcdUnavailable, EtcdError) as exc:
                if time.time() - last_ok > self.give_up_s and not self.gave_up:
                    self.gave_up = (f"etcd has answered nothing for {self.give_up_s:g} s "
                                    f"(its members lost, or this node cut off: {exc})")
                    return self._end(4, self.gave_up)
                self._stop.wait(self.poll_s)
                continue
            last_ok = time.time()
            if fence is not None:  # before any new holder: a fenced node says hello to none
                self.fenced = fence.value.decode()
                return self._end(3, f"fenced ({self.fenced})")
            self._follow_role(role)
            self._watch({f"{self.prefix}/coordinator": rev_role,
                         f"{self.prefix}/fence/{self.node}": rev_fence})
            deadline = time.time() + self.idle_s
            while not self._changed.wait(self.poll_s) and time.time() < deadline:
                if self._amiss(role):
                    break
            self._changed.clear()
        for w in list(self._streams.values()):
            w.close()

    def _amiss(self, role) -> bool:
        """Read etcd every poll_s, not only on its news: a watch broke, the role is vacant, or
        the door lost the coordinator (a closed connection, or calls unanswered for STALL_S: a
        partition leaves the streams to a cut-off member open and silent)."""
        stalled = getattr(self.door, "stalled_s", lambda: 0.0)()
        return (self._broken or role is None or self.door.broke_at is not None
                or stalled > STALL_S)

    def _follow_role(self, role) -> None:
        if role is None:
            self.role_gone_at = self.role_gone_at or time.time()
            return
        if role.create_revision > self.token:
            if self.token:  # the one before was lost: when this node first saw it
                self.coordinator_lost_at = self.door.broke_at or self.role_gone_at
            self.holder = json.loads(role.value)
            self.door.retarget(self.holder["host"], self.holder["port"])
            if self.token:
                self.log(f"[node {self.node}] the coordinator is now node "
                         f"{self.holder.get('node')} at {self.holder['host']}:"
                         f"{self.holder['port']} (token {role.create_revision})")
                self.moved.set()
            self.token = role.create_revision
            self.role_gone_at = None

    def _watch(self, keys: dict[str, int]) -> None:
        """A stream for each key, from the revision it was read at, unless one runs."""
        self._broken = False
        for key, rev in keys.items():
            if key not in self._streams:
                try:
                    self._streams[key] = self.etcd.watch(key, rev)
                except EtcdUnavailable:
                    self._broken = True
                    continue
                threading.Thread(target=self._stream, args=(key,), daemon=True,
                                 name="role-watch-stream").start()

    def _stream(self, key: str) -> None:
        stream = self._streams[key]
        try:
            while True:
                stream.next_change()
                self._changed.set()
        except EtcdUnavailable:
            self._streams.pop(key, None)
            self._broken = True
            self._changed.set()

    def _end(self, code: int, why: str) -> None:
        if self.on_end is not None and not self._stop.is_set():
            self.on_end(code, why)
