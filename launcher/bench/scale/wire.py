"""Thousands of c10d store connections on one thread: the store's wire format written directly,
and an event loop that runs each simulated rank as a generator of store calls (scale_sim.py).

Why not torch's own client: each of its calls blocks a thread, and thousands of Python threads on
two cores spend more CPU taking turns at the GIL than in the calls (about 1 ms of CPU per rank
per recovery here; asyncio's streams, tried next, about 0.45 ms on the loop alone). This loop
reads each socket once per wake-up, answers every call whose reply is complete, and sends what
the resumed ranks wrote in one write per connection (about 0.3 ms a rank). The servers are torch's (the coordinator's store, each agent's node store); only the
simulated ranks' side of the socket is written here.

The format (torch 2.x, as its client writes it; tests/bench/test_scale_wire.py checks it against
torch's server and client): a connection opens with VALIDATE and a magic number, then PING with a
nonce the server echoes. Each call is one byte of query type and its arguments; a string or a
value is a little-endian uint64 length and its bytes, a count a uint64, a number an int64. Keys
carry the client's "/" prefix. `get` and `multi_get` first wait for their keys, as torch's do.

A rank's program is a generator. It yields `(conn, method, *args)` and is sent the call's result
(`set` and `multi_set` have none: the program goes on at once), `("open", port)` for a new
connection, or `("sleep", seconds)`. `on(steps, stores)` runs the library's own protocol steps
(`membership.follow_steps`, `.barrier_steps`) inside such a program.
"""
from __future__ import annotations

import heapq
import os
import selectors
import socket
import struct
import threading
import time
from collections import deque

# torch/csrc/distributed/c10d/TCPStoreBackend.hpp: QueryType's order
VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT = 0, 1, 2, 3, 4, 5, 6
MULTI_GET, MULTI_SET, PING = 10, 11, 13
MAGIC = 0x3C85F7CE  # the validation number a client sends first
READY = 0  # CheckResponseType::READY, and WaitResponseType::STOP_WAITING


def _u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def _bytes(v) -> bytes:
    b = v.encode() if isinstance(v, str) else bytes(v)
    return _u64(len(b)) + b


def _keys(keys) -> bytes:
    return _u64(len(keys)) + b"".join(_bytes("/" + k) for k in keys)


class Conn:
    """One connection to a store server; `count` runs once per call (the harness counts)."""

    def __init__(self, port: int, count=None):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = os.getpid() & 0xFFFFFFFF
        self.sock.sendall(bytes([VALIDATE]) + struct.pack("<I", MAGIC)
                          + bytes([PING]) + struct.pack("<I", nonce))
        got = b""
        while len(got) < 4:
            part = self.sock.recv(4 - len(got))
            if not part:
                raise ConnectionError(f"the store on port {port} closed the connection")
            got += part
        if struct.unpack("<I", got)[0] != nonce:
            raise ConnectionError(f"the store on port {port} did not answer the ping")
        self.sock.setblocking(False)
        self.count = count
        self.out = bytearray()  # written, not yet sent
        self.inbuf = bytearray()
        self.replies: deque = deque()  # (parse, then): the calls in flight, in order

    def close(self) -> None:
        self.sock.close()


# What each call sends, and how its reply is read: a parser takes the received bytes and returns
# (value, bytes used), or None while the reply is incomplete.
def _ready(buf):  # CHECK: every key there?
    return (buf[0] == READY, 1) if buf else None


def _stopped(buf):  # WAIT: its one answer, STOP_WAITING
    if not buf:
        return None
    if buf[0] != READY:
        raise ConnectionError(f"the store answered a wait with {buf[0]}")
    return None, 1


def _i64(buf):
    return (struct.unpack_from("<q", buf)[0], 8) if len(buf) >= 8 else None


def _value(buf, at=0):
    if len(buf) < at + 8:
        return None
    n = struct.unpack_from("<Q", buf, at)[0]
    return (bytes(buf[at + 8:at + 8 + n]), 8 + n) if len(buf) >= at + 8 + n else None


def _values(n):
    def parse(buf):
        out, at = [], 0
        for _ in range(n):
            got = _value(buf, at)
            if got is None:
                return None
            out.append(got[0])
            at += got[1]
        return out, at
    return parse


def request(method: str, args: tuple):
    """The frames of one call and its reply's parsers: [(frame, parser or None)], sent in turn
    (a get's GET goes once its WAIT is answered, as torch's client does)."""
    if method == "set":
        return [(bytes([SET]) + _bytes("/" + args[0]) + _bytes(args[1]), None)]
    if method == "multi_set":
        keys, values = args
        return [(bytes([MULTI_SET]) + _u64(len(keys)) + b"".join(
            _bytes("/" + k) + _bytes(v) for k, v in zip(keys, values)), None)]
    if method == "add":
        return [(bytes([ADD]) + _bytes("/" + args[0]) + struct.pack("<q", args[1]), _i64)]
    if method == "compare_set":
        key, expected, desired = args
        return [(bytes([COMPARE_SET]) + _bytes("/" + key) + _bytes(expected) + _bytes(desired),
                 _value)]
    if method == "check":
        return [(bytes([CHECK]) + _keys(args[0]), _ready)]
    if method == "wait":  # no timeout here: the harness ends by killing the process
        return [(bytes([WAIT]) + _keys(args[0]), _stopped)]
    if method == "get":
        return [(bytes([WAIT]) + _keys([args[0]]), _stopped),
                (bytes([GET]) + _bytes("/" + args[0]), _value)]
    if method == "multi_get":
        return [(bytes([WAIT]) + _keys(args[0]), _stopped),
                (bytes([MULTI_GET]) + _keys(args[0]), _values(len(args[0])))]
    raise ValueError(method)


def on(steps, stores: dict):
    """Inside a program (`yield from`): the library's protocol steps, each (which store,
    method, *args) made a call on `stores[which]`; returns the steps' result."""
    try:
        call = next(steps)
        while True:
            where, name, *args = call
            call = steps.send((yield (stores[where], name, *args)))
    except StopIteration as done:
        return done.value


class Loop:
    """One thread running programs (generators of store calls) over non-blocking sockets."""

    def __init__(self):
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._calls: deque = deque()  # from other threads
        self._ready: deque = deque()  # (program, value to send it)
        self._timers: list = []
        self._dirty: set = set()  # connections with frames to send
        self._n = 0
        self.thread = threading.Thread(target=self._run, daemon=True, name="sim-ranks")
        self.thread.start()

    # from any thread
    def call_soon(self, fn, *args) -> None:
        self._calls.append((fn, args))
        os.write(self._wake_w, b"x")

    def start(self, program, on_error=None) -> None:
        """Run `program`; `on_error(exc)` if it raises (a closed socket: its store is gone)."""
        self.call_soon(self._start, program, on_error)

    def stop(self, program, conns) -> None:
        """End `program` and close its connections (from any thread): as a killed process."""
        self.call_soon(self._stop, program, conns)

    # on the loop's thread
    def _start(self, program, on_error) -> None:
        self._ready.append(((program, on_error), None))

    def _stop(self, program, conns) -> None:
        program.close()  # a call of it still in flight resumes nothing (a closed generator)
        for conn in conns:
            if conn is not None and conn.sock.fileno() >= 0:
                try:
                    self._sel.unregister(conn.sock)
                except (KeyError, ValueError):  # its server closed it first (_read)
                    pass
                conn.close()

    def _step(self, task, value, exc: Exception | None = None) -> None:
        """Resume a program with a call's result (or its failure), and start its next call."""
        prog, on_error = task
        try:
            call = prog.throw(exc) if exc is not None else prog.send(value)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001
            if on_error is not None:
                on_error(exc)
            return
        if call[0] == "sleep":
            self._n += 1
            heapq.heappush(self._timers, (time.monotonic() + call[1], self._n, task))
            return
        if call[0] == "open":
            try:
                conn = Conn(call[1], call[2] if len(call) > 2 else None)
            except OSError as exc:
                return self._step(task, None, exc)
            self._sel.register(conn.sock, selectors.EVENT_READ, conn)
            self._ready.append((task, conn))
            return
        conn, method, *args = call
        if conn.count is not None:
            conn.count()
        frames = request(method, tuple(args))
        if frames[0][1] is None:  # no reply: go on at once
            conn.out += frames[0][0]
            self._dirty.add(conn)
            self._ready.append((task, None))
            return
        conn.out += frames[0][0]
        self._dirty.add(conn)
        conn.replies.append((frames, 0, task))

    def _read(self, conn: Conn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the server is gone: every call in flight fails
            self._sel.unregister(conn.sock)
            while conn.replies:
                _, _, task = conn.replies.popleft()
                self._step(task, None, ConnectionError("the store closed the connection"))
            return
        conn.inbuf += data
        while conn.replies:
            frames, i, task = conn.replies[0]
            try:
                got = frames[i][1](conn.inbuf)
            except ConnectionError as exc:  # an answer this client does not understand
                conn.replies.popleft()
                self._step(task, None, exc)
                continue
            if got is None:
                return
            value, used = got
            del conn.inbuf[:used]
            conn.replies.popleft()
            if i + 1 < len(frames):  # the second half of a get: it goes now, its reply next
                conn.out += frames[i + 1][0]
                self._dirty.add(conn)
                conn.replies.appendleft((frames, i + 1, task))
            else:
                self._ready.append((task, value))

    def _flush(self) -> None:
        for conn in self._dirty:
            if conn.out:
                try:
                    conn.sock.sendall(conn.out)  # small frames: the socket buffer takes them
                except OSError:
                    pass  # its reader sees the close
                conn.out.clear()
        self._dirty.clear()

    def _run(self) -> None:
        while True:
            while self._calls:
                fn, args = self._calls.popleft()
                fn(*args)
            while self._ready:
                task, value = self._ready.popleft()
                self._step(task, value)
            self._flush()
            timeout = None
            if self._timers:
                timeout = max(0.0, self._timers[0][0] - time.monotonic())
            for key, _ in self._sel.select(timeout):
                if key.data is None:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                else:
                    self._read(key.data)
            now = time.monotonic()
            while self._timers and self._timers[0][0] <= now:
                self._ready.append((heapq.heappop(self._timers)[2], None))
