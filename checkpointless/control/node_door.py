"""A node's door to the coordinator's store: every process of the node reaches the coordinator
through it, over one connection per node whatever the ranks per node.

The coordinator's connections must grow with nodes, not ranks. The node agent hosts the door on
127.0.0.1 and gives its workers (and its own threads) its port as the coordinator's. Every local
client's calls go up one connection in the order they arrive (torch's server answers a
connection's calls in order), a turn of the loop's in one write. Waits go up the same connection,
one per key however many clients wait for it (door_waits.py). A wait's wake-up byte may come
between any two answers, so calls that expect one go up behind a CANCEL_WAIT (whose answer
follows every wake-up sent before it), and the waits are armed again behind them: no byte is
ever in doubt.

When the coordinator moves (`retarget`, coordinator=etcd), the calls not yet answered and the
waits go to the new one, as if made there. Nothing is replayed to the *same* coordinator (an add
it may have carried out is not sent twice), nor are the old store's keys carried over. With
`hold=False` (one coordinator for the job's life) a broken connection closes every client's, so
their calls fail at once, as a direct connection's would.
"""
from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from collections import deque

from . import store_wire as w
from .door_parts import Client as _Client
from .door_waits import DoorWaits


class StoreDoor:
    """Listens on 127.0.0.1 (`port` 0: any free one); forwards to `retarget`'s address."""

    def __init__(self, port: int = 0, log=lambda m: None, hold: bool = True):
        self.log, self.hold = log, hold
        self._lsock = w.listen(port)
        self.port = self._lsock.getsockname()[1]
        self._target: tuple[str, int] | None = None
        self.epoch = 0  # moves with every retarget
        self.broke_at: float | None = None  # a connection to the current target first broke
        self.stats = {"calls": 0, "waits": 0, "waits_shared": 0, "upstream_connects": 0}
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._lsock, selectors.EVENT_READ, "listen")
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._clients: set[_Client] = set()
        self._outq: set[_Client] = set()  # clients with answers to send this turn
        # upstream: one connection to the coordinator's store, for the calls and the waits
        self._up: socket.socket | None = None
        self._up_epoch = -1
        self._broken_epoch = -1  # the epoch whose target broke (not dialled again when holding)
        self._upbuf = bytearray()
        self._unsent: deque = deque()  # (owner, call, shape): a _Client, or a _Wait's check
        self._pending: deque = deque()  # (owner, call, shape, when) sent, in order
        self._out = bytearray()  # upstream, at the end of the turn
        self.waits = DoorWaits(self)  # the keys local clients wait for, and their checks
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True, name="store-door")
        self.thread.start()

    def retarget(self, host: str, port: int) -> None:
        """The coordinator is now at host:port: what waits for an answer goes there, and the
        connections to the one before are closed."""
        self._target = (host, port)
        self.epoch += 1
        self.broke_at = None
        os.write(self._wake_w, b"t")

    def stalled_s(self) -> float:
        """How long the oldest call sent has waited for its answer (a partition breaks no
        connection: a coordinator cut off only stops answering)."""
        try:
            return time.monotonic() - self._pending[0][3]
        except IndexError:  # none in flight
            return 0.0

    def close(self) -> None:
        self._stop = True
        os.write(self._wake_w, b"x")
        self.thread.join(5)

    # ---- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop:
            # a turn every 0.2 s only while a coordinator must be dialled; else on events alone
            dial = self._up is None and self._target is not None and bool(self._clients)
            for key, _ in self._sel.select(0.2 if dial else None):
                if key.data == "listen":
                    self._accept()
                elif key.data == "wake":
                    w.recv_pipe(self._wake_r)
                elif key.data == "up" and key.fileobj is self._up:  # not lost this turn
                    self._from_up()
                elif key.data in self._clients:
                    self._from_client(key.data)
            if self._up is not None and self._up_epoch != self.epoch:
                # retargeted: the old coordinator was deposed, even if its connection is still
                # open (a partition drops packets, it resets nothing)
                self._up_lost(broke=False)
            self._connect_up()
            self._flush()
        for c in list(self._clients):
            self._drop(c)
        self._up_lost(broke=False)
        self._lsock.close()

    def _accept(self) -> None:
        for sock in w.accepted(self._lsock):
            c = _Client(sock)
            self._clients.add(c)
            self._sel.register(sock, selectors.EVENT_READ, c)

    def _drop(self, c: _Client) -> None:
        self._clients.discard(c)
        self.waits.unwait(c)
        self._forget(c.sock)

    def _forget(self, sock: socket.socket) -> None:
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def _from_client(self, c: _Client) -> None:
        data = w.recv(c.sock)
        if not data:  # nothing after all (None), or the client closed it (or died)
            return None if data is None else self._drop(c)
        c.inbuf += data
        if not c.greeted:  # VALIDATE + magic, then PING + nonce: answered here
            if len(c.inbuf) < 10:
                return
            if c.inbuf[0] != w.VALIDATE or c.inbuf[5] != w.PING:
                return self._drop(c)
            c.out += c.inbuf[6:10]
            self._outq.add(c)
            del c.inbuf[:10]
            c.greeted = True
        while True:
            try:
                end, shape = w.call_end(c.inbuf)
            except w.Short:
                return
            except ValueError as exc:
                self.log(f"[store door] {exc}: closing that connection")
                return self._drop(c)
            call = bytes(c.inbuf[:end])
            del c.inbuf[:end]
            if c.waiting is not None and call[0] != w.CANCEL_WAIT:
                c.held.append((call, shape))  # its order kept: after the wait
            else:
                self._take(c, call, shape)

    def _take(self, c: _Client, call: bytes, shape: str) -> None:
        self.stats["calls"] += 1
        if call[0] == w.WAIT:
            return self.waits.wait(c, call)
        if call[0] == w.CANCEL_WAIT:  # its wait ends here; the upstream one may go on
            self.waits.unwait(c)
            c.out.append(w.WAIT_CANCELED)
            self._outq.add(c)
            return self._release(c)
        self._unsent.append((c, call, shape))

    def _release(self, c: _Client) -> None:
        while c.held and c.waiting is None:
            self._take(c, *c.held.popleft())

    # ---- the coordinator's side --------------------------------------------------------------
    def _connect_up(self) -> None:
        if self._up is not None or self._target is None or not self._clients:
            return
        if self.hold and self._broken_epoch == self.epoch:
            return  # never again to the one that broke (see the module's docstring)
        try:
            up = w.dial(self._target)
        except OSError:
            return  # tried again on the next turn (every 0.2 s at most)
        self.stats["upstream_connects"] += 1
        self._up, self._up_epoch = up, self.epoch
        self._upbuf.clear()
        self._sel.register(up, selectors.EVENT_READ, "up")
        self.waits.reconnected()  # the keys still missing are armed once answered

    def _up_lost(self, broke: bool) -> None:
        if self._up is not None:
            self._forget(self._up)
        was_up = self._up is not None
        self._up = None
        self._out.clear()
        self.waits.reset()
        # the calls not answered go first next time, in their order; checks are asked again
        back = [(o, c, shape) for o, c, shape, _ in self._pending if isinstance(o, _Client)]
        self._unsent = deque(back + [e for e in self._unsent if isinstance(e[0], _Client)])
        self._pending.clear()
        if not broke or not was_up:
            return
        self._broken_epoch = self._up_epoch
        if self._up_epoch == self.epoch and self.broke_at is None:
            self.broke_at = time.time()
        if not self.hold:  # no other coordinator will come: the clients' calls fail now
            for c in list(self._clients):
                self._drop(c)
            self._unsent.clear()
            self.waits.by_keys.clear()

    def _from_up(self) -> None:
        data = w.recv(self._up)
        if not data:  # nothing after all, or the coordinator is gone
            return None if data is None else self._up_lost(broke=True)
        self._upbuf += data
        woke = False
        while self._upbuf:
            if not self._pending or self._pending[0][2] == "c":
                # between answers only a wait's wake-up byte may come; a CANCEL_WAIT's own
                # answer follows every one sent before it
                byte = self._upbuf.pop(0)
                if byte == w.STOP_WAITING:
                    woke = True
                elif self._pending and byte == w.WAIT_CANCELED:
                    self._pending.popleft()
                else:
                    self.log(f"[store door] byte {byte} where a wake-up was due: reconnecting")
                    return self._up_lost(broke=True)
                continue
            owner, _, shape, _ = self._pending[0]
            try:
                end = w.answer_end(self._upbuf, shape)
            except w.Short:
                break
            answer = bytes(self._upbuf[:end])
            del self._upbuf[:end]
            self._pending.popleft()
            if isinstance(owner, bytes):  # a key's check, for the waits
                self.waits.checked(owner, answer[0] == w.READY)
            elif owner in self._clients:
                owner.out += answer
                self._outq.add(owner)
        if woke:
            self.waits.woken()

    def _flush(self) -> None:
        """What this turn gathered leaves in one write."""
        if self._up is not None:
            now = time.monotonic()
            if self.waits.cancel_due(self._unsent):
                # an answer is due: no wake-up byte may come among the answers, so the waits
                # armed so far end first
                self._out.append(w.CANCEL_WAIT)
                self._pending.append((None, b"", "c", now))
            while self._unsent:
                owner, call, shape = self._unsent.popleft()
                self._out += call
                if shape:
                    self._pending.append((owner, call, shape, now))
            self._out += self.waits.arm_calls()  # behind the calls: their answers come first
            if self._out:
                try:
                    self._up.sendall(self._out)
                    self._out.clear()
                except OSError:
                    self._up_lost(broke=True)
        outq, self._outq = self._outq, set()
        for c in outq:
            if c not in self._clients:
                continue
            try:
                c.sock.sendall(c.out)
                c.out.clear()
            except OSError:
                self._drop(c)
