"""A node's door to the coordinator's store: a local port whose far end can move.

When the coordinator's role moves to another node (leadership.py), its store (a TCPStore server)
moves with it: a new, empty server on another host. Workers must not notice more than a pause:
their store clients live inside torch (process groups, threads, the loop's reporter) and cannot be
pointed elsewhere. So in that mode each node's agent hosts this door on 127.0.0.1 and gives its
workers the door's port as the coordinator's. The door forwards every call to the current
coordinator and, when the coordinator changes (`retarget`, with a newer token), sends the calls
that were waiting for an answer to the new one. A worker blocked in a call (a wait for a key, a
counter's add) is answered by the new coordinator, as if the call had been made there.

It speaks the store's wire format (the same as launcher/bench/scale_wire.py, checked against
torch's server by tests/test_store_door.py): each call is one byte of type and its arguments (a
string or a value: a little-endian uint64 length and its bytes; a count: a uint64; a number: an
int64). It reads each call whole to know where it ends and what answer to expect.

What it does not do:
- replay to the *same* coordinator: when a connection to it breaks while it still holds the
  role, a call it may have carried out (an add) is not sent twice; the client's calls wait for a
  new coordinator, or fail with the client's own timeout;
- carry the old store's keys over: the new coordinator starts from what etcd and the agents tell
  it, and the calls answered by the old one stay answered.
"""
from __future__ import annotations

import os
import selectors
import socket
import struct
import threading
import time
from collections import deque

# torch/csrc/distributed/c10d/TCPStoreBackend.hpp: QueryType's order
(VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND, MULTI_GET,
 MULTI_SET, CANCEL_WAIT, PING) = range(14)
MAGIC = 0x3C85F7CE
WAIT_CANCELED = 1


class _Short(Exception):
    """Not all of a call (or an answer) has arrived yet."""


def _u64(buf, at):
    if len(buf) < at + 8:
        raise _Short
    return struct.unpack_from("<Q", buf, at)[0], at + 8


def _blob(buf, at):
    n, at = _u64(buf, at)
    if len(buf) < at + n:
        raise _Short
    return at + n


def _blobs(buf, at, count):
    for _ in range(count):
        at = _blob(buf, at)
    return at


def _call_end(buf) -> tuple[int, str]:
    """Where the call at the start of `buf` ends, and its answer's shape: "" none, "b" a byte,
    "q" an int64, "v" a value, "v*N" N values, "u" a uint32 (ping). _Short if incomplete."""
    if not buf:
        raise _Short
    t = buf[0]
    if t in (SET, APPEND):
        return _blobs(buf, 1, 2), ""
    if t == COMPARE_SET:
        return _blobs(buf, 1, 3), "v"
    if t == GET:
        return _blob(buf, 1), "v"
    if t == ADD:
        at = _blob(buf, 1)
        if len(buf) < at + 8:
            raise _Short
        return at + 8, "q"
    if t in (CHECK, WAIT, MULTI_GET):
        n, at = _u64(buf, 1)
        return _blobs(buf, at, n), {CHECK: "b", WAIT: "w", MULTI_GET: f"v*{n}"}[t]
    if t == MULTI_SET:
        n, at = _u64(buf, 1)
        return _blobs(buf, at, 2 * n), ""
    if t == GETNUMKEYS:
        return 1, "q"
    if t == DELETE_KEY:
        return _blob(buf, 1), "q"
    if t == CANCEL_WAIT:
        return 1, "c"
    if t == PING:
        if len(buf) < 5:
            raise _Short
        return 5, "u"
    raise ValueError(f"a store call of type {t} the door does not know")


def _answer_end(buf, shape: str) -> int:
    if shape in ("b", "w", "c"):
        if not buf:
            raise _Short
        return 1
    if shape == "q":
        if len(buf) < 8:
            raise _Short
        return 8
    if shape == "u":
        if len(buf) < 4:
            raise _Short
        return 4
    if shape == "v":
        return _blob(buf, 0)
    if shape.startswith("v*"):
        return _blobs(buf, 0, int(shape[2:]))
    raise ValueError(shape)


def _recv(sock: socket.socket) -> bytes | None:
    """What a readable socket holds: None if nothing after all, b"" once it is closed."""
    try:
        return sock.recv(1 << 16)
    except BlockingIOError:
        return None
    except OSError:
        return b""


class _Client:
    """One worker's connection through the door."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.inbuf = bytearray()  # from the worker, not yet a whole call
        self.greeted = False  # its VALIDATE and PING were answered by the door itself
        self.up: socket.socket | None = None
        self.up_epoch = -1  # the target it was connected to
        self.up_ready = False  # its own handshake with the coordinator answered
        self.upbuf = bytearray()
        self.unsent: deque = deque()  # (call bytes, answer shape), for the next coordinator
        self.pending: deque = deque()  # sent, waiting for their answers, in order
        self.broken_at = 0.0  # its coordinator connection broke then (0: it did not)


class StoreDoor:
    """Listens on 127.0.0.1 (`port` 0: any free one); forwards to `retarget`'s address."""

    def __init__(self, port: int = 0, log=lambda m: None):
        self.log = log
        self._lsock = socket.socket()
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind(("127.0.0.1", port))
        self._lsock.listen(256)
        self._lsock.setblocking(False)
        self.port = self._lsock.getsockname()[1]
        self._target: tuple[str, int] | None = None
        self.epoch = 0  # moves with every retarget
        self.broke_at: float | None = None  # a connection to the current target first broke
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._lsock, selectors.EVENT_READ, "listen")
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._clients: set[_Client] = set()
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True, name="store-door")
        self.thread.start()

    def retarget(self, host: str, port: int) -> None:
        """The coordinator is now at host:port: calls waiting for an answer go there, and every
        connection to the one before is closed."""
        self._target = (host, port)
        self.epoch += 1
        self.broke_at = None
        os.write(self._wake_w, b"t")

    def close(self) -> None:
        self._stop = True
        os.write(self._wake_w, b"x")
        self.thread.join(5)

    # ---- the loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            for key, _ in self._sel.select(0.2):
                if key.data == "listen":
                    self._accept()
                elif key.data == "wake":
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                else:
                    c, side = key.data
                    if c in self._clients:
                        self._from_client(c) if side == "client" else self._from_up(c)
            for c in list(self._clients):
                if c.up is not None and c.up_epoch != self.epoch:
                    # retargeted: the old coordinator was deposed, even if its connection is
                    # still open (a partition drops packets, it resets nothing)
                    self._up_broke(c)
                self._connect_up(c)
        for c in list(self._clients):
            self._drop(c)
        self._lsock.close()

    def _accept(self) -> None:
        try:
            sock, _ = self._lsock.accept()
        except BlockingIOError:
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c = _Client(sock)
        self._clients.add(c)
        self._sel.register(sock, selectors.EVENT_READ, (c, "client"))

    def _drop(self, c: _Client) -> None:
        self._clients.discard(c)
        for s in (c.sock, c.up):
            if s is not None:
                try:
                    self._sel.unregister(s)
                except (KeyError, ValueError):
                    pass
                s.close()

    def _from_client(self, c: _Client) -> None:
        data = _recv(c.sock)
        if data is None:
            return
        if not data:  # the worker closed it (or died)
            return self._drop(c)
        c.inbuf += data
        if not c.greeted:  # VALIDATE + magic, then PING + nonce: answered here
            if len(c.inbuf) < 10:
                return
            if c.inbuf[0] != VALIDATE or c.inbuf[5] != PING:
                return self._drop(c)
            c.sock.sendall(bytes(c.inbuf[6:10]))
            del c.inbuf[:10]
            c.greeted = True
        while True:
            try:
                end, shape = _call_end(c.inbuf)
            except _Short:
                return
            except ValueError as exc:
                self.log(f"[store door] {exc}: closing that connection")
                return self._drop(c)
            call = bytes(c.inbuf[:end])
            del c.inbuf[:end]
            c.unsent.append((call, shape))
            self._send(c)

    def _send(self, c: _Client) -> None:
        """Send what waits to the coordinator, when connected to the current one."""
        if c.up is None or not c.up_ready:
            return
        out = bytearray()
        while c.unsent:
            call, shape = c.unsent.popleft()
            out += call
            if shape:
                c.pending.append((call, shape))
        try:
            c.up.sendall(out)  # small calls: the socket's buffer takes them
        except OSError:
            self._up_broke(c)

    def _connect_up(self, c: _Client) -> None:
        """Connect a client to the current target: at first, and after a break once the target
        changed (never again to the one that broke, see the module's docstring)."""
        if c.up is not None or self._target is None:
            return
        if c.broken_at and c.up_epoch == self.epoch:
            return
        try:
            up = socket.create_connection(self._target, timeout=0.5)
            up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            up.sendall(bytes([VALIDATE]) + struct.pack("<I", MAGIC) + bytes([PING])
                       + struct.pack("<I", 7))
            got = b""
            while len(got) < 4:
                part = up.recv(4 - len(got))
                if not part:
                    raise ConnectionError("closed during the handshake")
                got += part
        except OSError:
            return  # tried again on the next turn (every 0.2 s at most)
        up.setblocking(False)
        c.up, c.up_epoch, c.up_ready, c.broken_at = up, self.epoch, True, 0.0
        c.upbuf.clear()
        # the calls the broken connection never answered go first, in their order
        c.unsent.extendleft(reversed(c.pending))
        c.pending.clear()
        self._sel.register(up, selectors.EVENT_READ, (c, "up"))
        self._send(c)

    def _up_broke(self, c: _Client) -> None:
        if c.up is not None:
            try:
                self._sel.unregister(c.up)
            except (KeyError, ValueError):
                pass
            c.up.close()
        c.up, c.up_ready, c.broken_at = None, False, time.time()
        if c.up_epoch == self.epoch and self.broke_at is None:
            self.broke_at = c.broken_at

    def _from_up(self, c: _Client) -> None:
        data = _recv(c.up)
        if data is None:
            return
        if not data:  # the coordinator is gone: its answers come from the next one
            return self._up_broke(c)
        c.upbuf += data
        out = bytearray()
        while c.pending:
            call, shape = c.pending[0]
            try:
                end = _answer_end(c.upbuf, shape)
            except _Short:
                break
            answer = bytes(c.upbuf[:end])
            del c.upbuf[:end]
            c.pending.popleft()
            out += answer
            # a wait whose cancel came first is answered once, by the cancel's byte
            if shape == "w" and answer[0] == WAIT_CANCELED and c.pending \
                    and c.pending[0][1] == "c":
                c.pending.popleft()
        if out:
            try:
                c.sock.sendall(out)
            except OSError:
                self._drop(c)
