"""A node's view of who coordinates, under coordinator=etcd: the agent's side of leadership.py.

A thread reads the role's key and this node's fence in etcd every `poll_s`. When a new holder
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


class RoleWatch:
    def __init__(self, etcd: Etcd, prefix: str, node: int, door, give_up_s: float,
                 poll_s: float = 0.25, log=print, on_end=None):
        self.etcd, self.prefix, self.node, self.door = etcd, prefix.rstrip("/"), node, door
        self.give_up_s, self.poll_s, self.log = give_up_s, poll_s, log
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
        threading.Thread(target=self._run, daemon=True, name="role-watch").start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        last_ok = time.time()
        while not self._stop.wait(self.poll_s):
            try:
                role = self.etcd.get(f"{self.prefix}/coordinator")
                fence = self.etcd.get(f"{self.prefix}/fence/{self.node}")
            except (EtcdUnavailable, EtcdError) as exc:
                if time.time() - last_ok > self.give_up_s and not self.gave_up:
                    self.gave_up = (f"etcd has answered nothing for {self.give_up_s:g} s "
                                    f"(its members lost, or this node cut off: {exc})")
                    return self._end(4, self.gave_up)
                continue
            last_ok = time.time()
            if fence is not None:  # before any new holder: a fenced node says hello to none
                self.fenced = fence.value.decode()
                return self._end(3, f"fenced ({self.fenced})")
            if role is None:
                self.role_gone_at = self.role_gone_at or time.time()
                continue
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

    def _end(self, code: int, why: str) -> None:
        if self.on_end is not None and not self._stop.is_set():
            self.on_end(code, why)
