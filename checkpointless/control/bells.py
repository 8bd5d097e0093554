"""The coordinator's side of the command bells (keys.bell_key): after it writes a node's
command, it rings the bell of the node's group, and the group's agents read their own commands.

Why a bell per group and not a wait per node: every node's door keeps its agent's waits armed at
the coordinator's store and cancels them before each call that expects an answer, and torch's
server forgets one connection's waits by walking every waited key of every connection. One key
per node made each of those calls cost O(nodes) on the server's one thread (a quarter of the
coordinator's CPU at 2,048 nodes); a key per 64 nodes leaves the walk a few entries long.

Commands written together (every node's spawns at the start, the shutdown) ring once per group
(`held`); one written alone rings at once. A coordinator that takes over rings again, in its own
store, every bell its nodes said they wait for (`ring_again`).
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

from .. import protocol


class Bells:
    def __init__(self):
        self._next: dict[int, int] = {}  # group -> the number of its next ring
        self._held: set[int] = set()  # groups with commands not rung yet, while held
        self._depth = 0
        self._lock = threading.Lock()  # commands come from the supervisor's threads
        self.waited: dict[int, set[int]] = {}  # a takeover's: group -> rings its nodes await

    def command_written(self, store, node: int) -> None:
        """A command for `node` is in the store: ring its group's bell (or, while held, once
        they are released)."""
        g = node // protocol.NODES_PER_BELL
        with self._lock:
            if self._depth:
                self._held.add(g)
            else:
                self._ring(store, g)

    @contextmanager
    def held(self, store):
        """Commands written inside ring their groups once, at the end."""
        with self._lock:
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if not self._depth:
                    groups, self._held = self._held, set()
                    for g in sorted(groups):
                        self._ring(store, g)

    def _ring(self, store, g: int) -> None:
        j = self._next.get(g, 0)
        self._next[g] = j + 1
        # the ring, then where the next one will be (a joining agent starts there)
        store.multi_set([protocol.bell_key(g, j), protocol.bell_next_key(g)], ["1", str(j + 1)])

    def resumed(self, node: int, at: int | None) -> None:
        """A takeover heard that `node`'s agent awaits ring `at` of its group (None: its
        command thread had not started)."""
        if at is not None:
            self.waited.setdefault(node // protocol.NODES_PER_BELL, set()).add(int(at))

    def ring_again(self, store) -> None:
        """A coordinator that took over, in its own (new) store: ring every bell its nodes
        await and the ones between (an agent walks them one by one), and number its own rings
        after them. An agent that moved one ring on after its hello awaits at most the next."""
        with self._lock:
            for g, at in sorted(self.waited.items()):
                lo, hi = min(at), max(at)
                self._next[g] = max(self._next.get(g, 0), hi + 1)
                names = [protocol.bell_key(g, j) for j in range(lo, hi + 1)]
                store.multi_set(names + [protocol.bell_next_key(g)],
                                ["1"] * len(names) + [str(self._next[g])])
            self.waited = {}
