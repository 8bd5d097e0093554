"""What the node's door (node_door.py) keeps for each local client, and for each set of keys
that local clients wait for."""
from __future__ import annotations

import socket
from collections import deque

from . import store_wire as w


class Client:
    """One local process's connection through the door."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.inbuf = bytearray()  # from the client, not yet a whole call
        self.out = bytearray()  # answers for it, sent at the end of the loop's turn
        self.greeted = False  # its VALIDATE and PING were answered by the door itself
        self.waiting: Wait | None = None
        self.held: deque = deque()  # its calls after a wait, until the wait is over


class Wait:
    """What every local client waiting for the same keys waits for."""

    def __init__(self, call: bytes):
        self.call = call  # WAIT and its keys
        self.keys = w.keys_of(call)
        self.clients: list[Client] = []
