"""The c10d store's wire format as a relay reads it: where a call ends, and what its answer
looks like, without decoding either (node_door.py forwards the bytes as they came).

torch 2.x's format (tests/library/ha/test_store_door.py and test_node_relay.py check it against torch's
own client and server): each call is one byte of type and its arguments; a string or a value
is a little-endian uint64 length and its bytes, a count a uint64, a number an int64. A
connection opens with VALIDATE and a magic number, then PING with a nonce the server echoes.
"""
from __future__ import annotations

import os
import socket
import struct

# torch/csrc/distributed/c10d/TCPStoreBackend.hpp: QueryType's order
(VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND, MULTI_GET,
 MULTI_SET, CANCEL_WAIT, PING) = range(14)
MAGIC = 0x3C85F7CE
STOP_WAITING, WAIT_CANCELED = 0, 1  # WaitResponseType
READY = 0  # CheckResponseType


class Short(Exception):
    """Not all of a call (or an answer) has arrived yet."""


def _u64(buf, at):
    if len(buf) < at + 8:
        raise Short
    return struct.unpack_from("<Q", buf, at)[0], at + 8


def _blob(buf, at):
    n, at = _u64(buf, at)
    if len(buf) < at + n:
        raise Short
    return at + n


def _blobs(buf, at, count):
    for _ in range(count):
        at = _blob(buf, at)
    return at


def call_end(buf) -> tuple[int, str]:
    """Where the call at the start of `buf` ends, and its answer's shape: "" none, "b" a byte,
    "q" an int64, "v" a value, "v*N" N values, "u" a uint32 (ping), "w" a wait's byte, "c" a
    cancel's byte. Short if incomplete; ValueError for a call this module does not know."""
    if not buf:
        raise Short
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
            raise Short
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
            raise Short
        return 5, "u"
    raise ValueError(f"a store call of type {t} the relay does not know")


def answer_end(buf, shape: str) -> int:
    """Where the answer of shape `shape` at the start of `buf` ends (Short if incomplete)."""
    if shape in ("b", "w", "c"):
        if not buf:
            raise Short
        return 1
    if shape in ("q", "u"):
        n = 8 if shape == "q" else 4
        if len(buf) < n:
            raise Short
        return n
    if shape == "v":
        return _blob(buf, 0)
    if shape.startswith("v*"):
        return _blobs(buf, 0, int(shape[2:]))
    raise ValueError(shape)


def recv(sock: socket.socket) -> bytes | None:
    """What a readable socket holds: None if nothing after all, b"" once it is closed."""
    try:
        return sock.recv(1 << 16)
    except (BlockingIOError, socket.timeout):
        return None
    except OSError:
        return b""


def dial(target: tuple[str, int], timeout_s: float = 0.5) -> socket.socket:
    """A connection to the store at `target`, its handshake done (OSError if it fails)."""
    sock = socket.create_connection(target, timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(bytes([VALIDATE]) + struct.pack("<I", MAGIC) + bytes([PING])
                     + struct.pack("<I", 7))
        got = b""
        while len(got) < 4:
            part = sock.recv(4 - len(got))
            if not part:
                raise ConnectionError("closed during the handshake")
            got += part
    except OSError:
        sock.close()
        raise
    sock.settimeout(5.0)  # sends block (briefly); reads happen only when select says so
    return sock


def keys_of(call: bytes) -> list[bytes]:
    """The keys of a whole WAIT (or CHECK) call, each as it is framed (its length, its bytes)."""
    n, at = _u64(call, 1)
    out = []
    for _ in range(n):
        end = _blob(call, at)
        out.append(bytes(call[at:end]))
        at = end
    return out


def one_key(kind: int, key: bytes) -> bytes:
    """A WAIT or CHECK call for the one framed key `key`."""
    return bytes([kind]) + struct.pack("<Q", 1) + key


def listen(port: int) -> socket.socket:
    """A non-blocking listening socket on 127.0.0.1:`port` (0: any free port)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def recv_pipe(fd: int) -> None:
    """Empty a non-blocking wake-up pipe."""
    try:
        os.read(fd, 4096)
    except BlockingIOError:
        pass


def accepted(lsock: socket.socket) -> list[socket.socket]:
    """The connections waiting on a non-blocking listening socket, ready for a relay's use."""
    out = []
    while True:
        try:
            sock, _ = lsock.accept()
        except (BlockingIOError, OSError):
            return out
        sock.settimeout(2.0)  # answers are small; a client that reads nothing is dropped
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out.append(sock)
