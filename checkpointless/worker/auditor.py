"""The two ends of an audit (audit.py says what is compared): a spare that replays sampled ranks'
steps while it waits for a rank (`AuditServer`), and the witness rank's background thread that
ships it the parameters of the audited step (`Shipper`).

The transfer is a plain TCP connection from witness to spare, outside the job's process groups
(a spare is in none): a header (JSON), the parameters' skeleton and their bytes, each after its
length. The spare reads every audit as it arrives and replays them in order in a thread of its
own so neither side's training thread waits for the other: the
witness only copies its parameters to host memory as its forward uses them.

What the spare decides (audit.judge) it writes to the store: a pass (`audit_pass/<rank>`), or a
finding against a worker (`sdc/<wid>`, counted in `sdc`), which the supervisor turns into an
eviction and a rewind (control/audits.py). A spare that agrees with neither the audited rank nor the
witness doubts its own hardware: it marks itself unhealthy (health.py's record) and stops auditing.
"""
from __future__ import annotations

import json
import queue
import socket
import struct
import threading
import time
from datetime import timedelta

import torch

from .. import protocol
from ..protocol import membership
from . import health
from .audit import GradTap, checksum, judge, rewind_bound
from .transfer import flatten_state, unflatten_state

_LEN = struct.Struct("<Q")
WAIT_S = 120.0  # how long the spare waits for the digests an audited step's ranks publish


def _send_parts(sock: socket.socket, *parts: bytes) -> None:
    for p in parts:
        sock.sendall(_LEN.pack(len(p)))
        sock.sendall(p)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the witness closed the connection mid-audit")
        got += k
    return bytes(buf)


def _recv_part(sock: socket.socket) -> bytes:
    return _recv_exact(sock, _LEN.unpack(_recv_exact(sock, _LEN.size))[0])


def _reach_address(host: str, port: int) -> str:
    """This host's address on the route to the coordinator: where peers on other nodes reach
    it too (a network namespace's own address, not the hostname's)."""
    with socket.create_connection((host, port), timeout=10) as s:
        return s.getsockname()[0]


class Shipper:
    """The witness's side: sends the audited step's parameters to a spare that audits, from a
    thread of its own (with its own store connection), so the training thread never waits."""

    def __init__(self, connect, log=print):
        self._connect, self._log = connect, log
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self.shipped = self.unserved = 0

    def ship(self, header: dict, params: dict) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="checkpointless-audit-ship")
            self._thread.start()
        self._queue.put((header, params))

    def _run(self) -> None:
        store = self._connect()
        while True:
            header, params = self._queue.get()
            try:
                where = self._auditor(store, header["step"])
                if where is None:
                    self.unserved += 1
                    if self.unserved == 1:
                        self._log("[checkpointless] audit: no spare is auditing; audited steps "
                                  "go unchecked until one is ready")
                    continue
                skeleton, flat = flatten_state(params)
                with socket.create_connection((where["host"], where["port"]), timeout=30) as s:
                    _send_parts(s, json.dumps(header).encode(), skeleton,
                                flat.numpy().tobytes())
                self.shipped += 1
            except Exception as exc:  # a spare that took a rank meanwhile: this one goes unchecked
                self.unserved += 1
                self._log(f"[checkpointless] audit of step {header['step']} not shipped: {exc}")

    @staticmethod
    def _auditor(store, step: int) -> dict | None:
        """A spare that audits, taken in turn by step; None when none does."""
        auditors = serving(store)
        return auditors[step % len(auditors)] if auditors else None


def serving(store) -> list[dict]:
    """The spares auditing now ({wid, host, port} each): one that took a rank left ""."""
    out = []
    for i in range(store.add(protocol.AUDITORS, 0)):
        raw = store.get(protocol.auditor_key(i))
        if raw:
            out.append(json.loads(raw))
    return out


class AuditServer:
    """A waiting spare's audits: receives shipped steps, replays them, judges, says what it
    found. `replay` is the loop's: `.model()` gives a whole model to replay on (built once,
    lazily), `.replay(model, step, rank, world)` runs that rank's micro-batches of `step`
    forward and backward, seeded as the rank did, and leaves the gradients on the model."""

    def __init__(self, connect, host: str, port: int, worker_id: int, replay, log=print):
        self._connect, self.worker_id, self._replay, self._log = connect, worker_id, replay, log
        self._reach = (host, port)
        self._stop = threading.Event()
        self._work: queue.Queue = queue.Queue()
        self._busy = threading.Lock()  # held while a replay runs: stop() waits for it
        self._index: int | None = None
        self._model = self._tap = None
        self.audits = 0

    def start(self) -> None:
        self._listener = socket.create_server(("", 0))
        self._listener.settimeout(0.5)
        store = self._store = self._connect()
        self._index = store.add(protocol.AUDITORS, 1) - 1
        store.set(protocol.auditor_key(self._index), "")  # offered once its burn-in passed
        for target, name in ((self._accept, "accept"), (self._audit_loop, "replay")):
            threading.Thread(target=target, daemon=True,
                             name=f"checkpointless-audit-{name}").start()

    def stop(self) -> None:
        """The spare takes a rank: no more audits; one replaying finishes first (the model and
        the generators are the loop's again once this returns)."""
        if self._index is None:
            return
        self._stop.set()
        try:
            self._store.set(protocol.auditor_key(self._index), "")
        except Exception:
            pass
        with self._busy:
            if self._model is not None:
                self._model.zero_grad(set_to_none=True)
        self._listener.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            try:
                with conn:
                    conn.settimeout(60)
                    header = json.loads(_recv_part(conn))
                    skeleton = _recv_part(conn)
                    flat = torch.frombuffer(bytearray(_recv_part(conn)), dtype=torch.uint8)
                self._work.put((header, unflatten_state(skeleton, flat, copy=False)))
            except Exception as exc:
                self._log(f"[checkpointless] audit: a shipment broke off: {exc}")

    def _audit_loop(self) -> None:
        # normal priority: at a lower one, on a node whose cores the ranks keep busy, the
        # audits would fall behind by more than the checkpoints a rewind needs are kept
        store = self._connect()
        with self._busy:
            if not self._burn_in(store):
                return
            store.set(protocol.auditor_key(self._index), json.dumps(
                {"wid": self.worker_id, "host": _reach_address(*self._reach),
                 "port": self._listener.getsockname()[1]}))
        while not self._stop.is_set():
            try:
                header, params = self._work.get(timeout=0.5)
            except queue.Empty:
                continue
            with self._busy:
                if self._stop.is_set():
                    return
                try:
                    self._audit(store, header, params)
                except Exception as exc:
                    self._log(f"[checkpointless] audit of step {header.get('step')} failed on "
                              f"spare worker {self.worker_id}: {exc!r}")
                finally:  # judged or not, the ranks waiting at the end need not wait for it
                    store.set(protocol.AUDIT_DONE, str(header.get("step", -1)))

    def _published(self, store, step: int, rank: int, gen: int | None = None) -> dict:
        """`rank`'s digest of `step`; with `gen`, one published in that generation or later.
        After a rewind the job redoes steps it had done: until the rank publishes the redone
        step, the key still holds the older timeline's digest, of other parameters (seen in
        CI: a healthy rank accused, its redone step judged against its digest from before the
        rewind). Past WAIT_S the newest digest is returned, and the caller sees its other
        parameters."""
        key = protocol.audit_digest_key(step, rank)
        store.wait([key], timedelta(seconds=WAIT_S))
        deadline = time.time() + WAIT_S
        while True:
            got = json.loads(store.get(key))
            if gen is None or got.get("gen", gen) >= gen or time.time() > deadline:
                return got
            time.sleep(0.05)

    def _burn_in(self, store) -> bool:
        """Before its first audit, a known step: rank 0's step 0 of the launch, replayed on this
        spare's own build of the model (the state every rank started from) and compared with
        the digest rank 0 published. A mismatch marks this spare unhealthy: it audits nothing
        and is never promoted. No known step (the job resumed from a checkpoint, or started
        from other values than the build): it is said, and the spare audits unproven."""
        try:
            store.wait([protocol.FIRST_STEP], timedelta(seconds=WAIT_S))
            theirs = self._published(store, 0, 0) if store.get(protocol.FIRST_STEP) == b"0" \
                else None
        except Exception:  # noqa: BLE001  no step 0 in this launch within the wait
            theirs = None
        if theirs is not None:
            self._model = self._replay.model()
            self._tap = GradTap(self._model)
            mine = self._run_replay(0, 0, theirs["world"], both=True)
            if mine[1] == theirs["params"] and mine[0] == theirs["grads"]:
                return True
            if mine[1] == theirs["params"]:
                return self._unfit(store, "its burn-in (rank 0's step 0 replayed on its own "
                                   "build) gave another gradient than rank 0's")
        self._log(f"[checkpointless] spare worker {self.worker_id}: no known step to burn in "
                  "on (the job did not start from the model's build at step 0); it audits "
                  "without one")
        return True

    def _unfit(self, store, why: str) -> bool:
        """This spare's own hardware is suspect: unhealthy (never promoted), no more audits."""
        self._log(f"[checkpointless] spare worker {self.worker_id}: {why}; its hardware is "
                  "suspect: it is marked unhealthy and audits nothing")
        health.record(store, self.worker_id, [f"audit: {why}"])
        self._stop.set()
        store.set(protocol.auditor_key(self._index), "")
        return False

    def _run_replay(self, step: int, rank: int, world: int, both: bool = False):
        self._tap.arm(step)
        try:
            self._replay.replay(self._model, step, rank, world)
            found = self._tap.digests()
        finally:
            self._tap.disarm()
            self._model.zero_grad(set_to_none=True)
        if found is None:
            raise RuntimeError("the replay computed no gradient")
        return found if both else found[0]

    def _load(self, params: dict) -> int:
        if self._model is None:
            self._model = self._replay.model()
            self._tap = GradTap(self._model)
        named = dict(self._model.named_parameters(remove_duplicate=False))
        total = 0
        with torch.no_grad():
            for name, t in params.items():
                named[name].copy_(t)
                total += int(checksum(t))
        return total

    def _audit(self, store, h: dict, params: dict) -> None:
        step, rank, witness, world = h["step"], h["rank"], h["witness"], h["world"]
        theirs = self._published(store, step, rank, h.get("gen"))
        theirs_w = self._published(store, step, witness, h.get("gen"))
        shipped = self._load(params)
        # both ranks' forwards used the same parameters, the ones shipped: a digest of others is
        # of another computation (an older timeline's step), never evidence against a rank
        if shipped != theirs_w["params"] or shipped != theirs["params"]:
            self._log(f"[checkpointless] audit of step {step}: the parameters arrived other "
                      f"than rank {rank} and its witness used them; not judged")
            return
        t0 = time.time()
        mine = self._run_replay(step, rank, world)
        mine_w = None
        if mine != theirs["grads"]:  # a third computation before anyone is accused
            mine_w = self._run_replay(step, witness, world)
        verdict = judge(mine, theirs["grads"], mine_w, theirs_w["grads"])
        self.audits += 1
        if verdict == "ok":
            store.set(protocol.audit_pass_key(rank), str(step))
            return
        if verdict == "auditor":
            self._unfit(store, f"its replay of step {step} agrees with neither rank {rank} nor "
                        f"its witness, rank {witness}")
            return
        self._accuse(store, theirs, rank, step, time.time() - t0)

    def _accuse(self, store, bad: dict, rank: int, step: int, replay_s: float) -> None:
        key = protocol.audit_pass_key(rank)
        last = int(store.get(key)) if store.check([key]) else None
        finding = {"wid": bad["wid"], "rank": rank, "step": step, "last_passed": last,
                   "rewind_to": rewind_bound(last), "auditor": self.worker_id,
                   "replay_s": round(replay_s, 3), "t": time.time()}
        store.set(protocol.sdc_key(bad["wid"]), json.dumps(finding))
        membership.tell(store, protocol.SDC, bad["wid"])
        self._log(f"[checkpointless] audit: rank {rank} (worker {bad['wid']}) computed a wrong "
                  f"gradient at step {step} (a replay on spare worker {self.worker_id} and the "
                  f"witness agree against it); its last audit that passed: "
                  f"{'none' if last is None else f'step {last}'}")
