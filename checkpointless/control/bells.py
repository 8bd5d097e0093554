"""The coordinator's side of the command bells (keys.bell_key): after it writes a node's
command, it rings the bell of the node's group, and the group's agents read their own commands.

Why a bell per group and not a wait per node: every node's door keeps its agent's waits armed at
the coordinator's store and cancels them before each call that expects an answer, and torch's
server forgets one connection's waits by walking every waited key of every connection. One key
per node made each of those calls cost O(nodes) on the server's one thread (a quarter of the
coordinator's CPU at 2,048 nodes); a key per 64 nodes leaves the walk a few entries long.

Commands written together (every node's spawns at the start, the shutdown) ring once per group
(`held`); one written alone rings at once. Where each group's rings stand (`keys.bell_next_key`)
is written before any agent needs it (`open`), and an agent waits for it rather than guess: a
coordinator that takes over has an empty store, writes it after its nodes' hellos, and rings
again there every ring they said they await (`ring_again`).
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
                while not self._depth and self._held:  # a ring that fails stays owed
                    g = min(self._held)
                    self._ring(store, g)
                    self._held.discard(g)

    def _ring(self, store, g: int) -> None:
        j = self._next.get(g, 0)
        # the ring, then where the next one will be (a joining agent starts there); counted
        # once written: agents walk the rings one by one, and one never set would stop them
        store.multi_set([protocol.bell_key(g, j), protocol.bell_next_key(g)], ["1", str(j + 1)])
        self._next[g] = j + 1

    def open(self, store, nodes) -> None:
        """Where every group of `nodes` stands, before their agents read it (a new job: 0)."""
        groups = sorted({k // protocol.NODES_PER_BELL for k in nodes})
        with self._lock:
            store.multi_set([protocol.bell_next_key(g) for g in groups],
                            [str(self._next.get(g, 0)) for g in groups])

    def resumed(self, node: int, at: int | None) -> None:
        """A takeover heard that `node`'s agent awaits ring `at` of its group (None: its
        command thread had not started)."""
        if at is not None:
            self.waited.setdefault(node // protocol.NODES_PER_BELL, set()).add(int(at))

    def ring_again(self, store, nodes) -> None:
        """A coordinator that took over, in its own (new) store: ring every bell its nodes
        await and the ones between (an agent walks them one by one), number its own rings after
        them, and say where every group of `nodes` stands (an agent whose command thread had not
        read it yet waits for it). An agent that moved one ring on after its hello awaits at
        most the next."""
        with self._lock:
            for g, at in sorted(self.waited.items()):
                lo, hi = min(at), max(at)
                names = [protocol.bell_key(g, j) for j in range(lo, hi + 1)]
                store.multi_set(names, ["1"] * len(names))
                self._next[g] = max(self._next.get(g, 0), hi + 1)
            self.waited = {}
        self.open(store, nodes)
