"""A small etcd v3 client over etcd's own HTTP/JSON gateway: the standard library only.

Why not a client package: the Python clients of etcd v3 are in poor health (python-etcd3, the
usual one, has had no release since 2020, pins an old grpcio/protobuf pair, and breaks with
protobuf 4; the v2 client torch's elastic rendezvous uses speaks an API etcd 3.4 serves only with a
flag, and 3.6 not at all). Every etcd 3.x serves the same calls as JSON over HTTP (`/v3/kv/range`,
`/v3/kv/txn`, `/v3/lease/grant`, ...), with keys and values base64-encoded and 64-bit integers
written as strings. That is all this needs: a few calls a second, never on a training step's path.

Each call goes to the endpoint that answered last, then to the others in turn. etcd answers a
linearizable read or a write only with a quorum of its members, so when a majority is gone every
endpoint fails or times out, and the call raises `EtcdUnavailable`, naming each endpoint's error.
"""
from __future__ import annotations

import base64
import http.client
import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass


class EtcdUnavailable(RuntimeError):
    """No endpoint answered (a majority of the members lost, or every endpoint unreachable)."""


class EtcdError(RuntimeError):
    """An endpoint answered with an error (a bad request, an expired lease)."""


@dataclass
class Entry:
    key: str
    value: bytes
    create_revision: int  # the revision that created it: fixed until it is deleted
    mod_revision: int
    lease: int


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _entry(kv: dict) -> Entry:
    return Entry(key=base64.b64decode(kv["key"]).decode(),
                 value=base64.b64decode(kv.get("value", "")),
                 create_revision=int(kv.get("create_revision", 0)),
                 mod_revision=int(kv.get("mod_revision", 0)), lease=int(kv.get("lease", 0)))


def _prefix_end(prefix: str) -> str:
    """The first key after every key that starts with `prefix` (etcd's range_end)."""
    b = bytearray(prefix.encode())
    b[-1] += 1
    return _b64(bytes(b))


def parse_endpoints(text: str) -> list[str]:
    """"host:port,host:port" (an http:// in front is allowed) -> base URLs."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        out.append(part.rstrip("/") if "://" in part else f"http://{part}")
    return out


class Etcd:
    """A client of one etcd cluster. Not thread-safe in its choice of endpoint only, which is a
    hint: any endpoint serves any call."""

    def __init__(self, endpoints: list[str] | str, timeout_s: float = 2.0):
        self.endpoints = parse_endpoints(endpoints) if isinstance(endpoints, str) else endpoints
        if not self.endpoints:
            raise ValueError("an etcd client needs at least one endpoint (host:port)")
        self.timeout_s = timeout_s
        self._first = 0

    # ---- the transport ------------------------------------------------------------------------
    def call(self, path: str, body: dict, stream: bool = False) -> dict:
        """POST `body` to `path` on the first endpoint that answers. `stream`: the answer is a
        stream of JSON lines (lease keepalive), of which the first is read."""
        errors = []
        n = len(self.endpoints)
        for i in range(n):
            at = (self._first + i) % n
            url = self.endpoints[at] + path
            req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    raw = resp.readline() if stream else resp.read()
            except urllib.error.HTTPError as exc:  # the member answered: a real error
                detail = exc.read().decode(errors="replace")[:300]
                if exc.code in (500, 503) and ("timed out" in detail or "leader" in detail
                                               or "quorum" in detail):
                    errors.append(f"{url}: {detail}")  # no quorum behind this member
                    continue
                raise EtcdError(f"etcd at {url} answered {exc.code}: {detail}") from None
            except (urllib.error.URLError, OSError, socket.timeout) as exc:
                errors.append(f"{url}: {getattr(exc, 'reason', exc)}")
                continue
            self._first = at
            out = json.loads(raw or b"{}")
            if "error" in out and not stream:
                raise EtcdError(f"etcd at {url}: {out['error']}")
            return out.get("result", out) if stream else out
        raise EtcdUnavailable("no etcd endpoint answered (a majority of its members lost, or "
                              "every endpoint unreachable): " + "; ".join(errors))

    # ---- keys ---------------------------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        kvs = self.call("/v3/kv/range", {"key": _b64(key)}).get("kvs", [])
        return _entry(kvs[0]) if kvs else None

    def get_at(self, key: str) -> tuple[Entry | None, int]:
        """`key` and the cluster's revision it was read at (a watch starts after it)."""
        out = self.call("/v3/kv/range", {"key": _b64(key)})
        kvs = out.get("kvs", [])
        return (_entry(kvs[0]) if kvs else None), int(out["header"]["revision"])

    def watch(self, key: str, after: int) -> "Watch":
        """Follow `key` from revision `after` + 1 with etcd's watch, which the gateway streams
        as JSON lines on one HTTP request: no poll. EtcdUnavailable if no endpoint takes it."""
        errors = []
        body = json.dumps({"create_request": {"key": _b64(key),
                                              "start_revision": str(after + 1)}})
        for i in range(len(self.endpoints)):
            at = (self._first + i) % len(self.endpoints)
            url = urllib.parse.urlsplit(self.endpoints[at])
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=self.timeout_s)
            try:
                conn.request("POST", "/v3/watch", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                first = json.loads(resp.readline() or b"{}").get("result", {})
                if resp.status != 200 or not first.get("created"):
                    raise OSError(f"answered {resp.status}: {first}")
            except (OSError, ValueError) as exc:
                conn.close()
                errors.append(f"{url.geturl()}: {exc}")
                continue
            conn.sock.settimeout(None)  # quiet for hours is normal; close() ends it
            return Watch(conn, resp)
        raise EtcdUnavailable("no etcd endpoint took the watch: " + "; ".join(errors))

    def get_prefix(self, prefix: str) -> list[Entry]:
        out = self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _prefix_end(prefix)})
        return [_entry(kv) for kv in out.get("kvs", [])]

    def put(self, key: str, value: str | bytes, lease: int = 0) -> int:
        """Write `key`; the cluster's revision after it."""
        body = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self.call("/v3/kv/put", body)["header"]["revision"])

    def delete(self, key: str) -> None:
        self.call("/v3/kv/deleterange", {"key": _b64(key)})

    def txn(self, compare: list[dict], success: list[dict],
            failure: list[dict] = ()) -> tuple[bool, list[dict]]:
        """One transaction: `success` if every comparison holds, else `failure`. Returns whether
        it succeeded, and the responses of the branch that ran."""
        out = self.call("/v3/kv/txn", {"compare": compare, "success": success,
                                       "failure": list(failure)})
        return bool(out.get("succeeded", False)), out.get("responses", [])

    def create(self, key: str, value: str | bytes, lease: int = 0) -> tuple[bool, Entry | None]:
        """Write `key` only if it does not exist. (True, None) when written, else (False, the
        entry that is there)."""
        put = {"key": _b64(key), "value": _b64(value)}
        if lease:
            put["lease"] = str(lease)
        ok, responses = self.txn(
            [{"target": "CREATE", "key": _b64(key), "create_revision": "0"}],
            [{"request_put": put}], [{"request_range": {"key": _b64(key)}}])
        if ok:
            return True, None
        kvs = responses[0].get("response_range", {}).get("kvs", []) if responses else []
        return False, (_entry(kvs[0]) if kvs else None)

    def put_if(self, key: str, value: str | bytes, guard: str, create_revision: int) -> bool:
        """Write `key` only while `guard` exists with `create_revision` (the fence: a holder of
        a role whose key was deleted and created again by someone else writes nothing)."""
        ok, _ = self.txn([{"target": "CREATE", "key": _b64(guard),
                           "create_revision": str(create_revision)}],
                         [{"request_put": {"key": _b64(key), "value": _b64(value)}}])
        return ok

    def delete_if(self, key: str, create_revision: int) -> bool:
        """Delete `key` only if it is the one created at `create_revision`."""
        ok, _ = self.txn([{"target": "CREATE", "key": _b64(key),
                           "create_revision": str(create_revision)}],
                         [{"request_delete_range": {"key": _b64(key)}}])
        return ok

    def delete_prefix_if(self, prefix: str, key: str, value: str | bytes) -> bool:
        """Delete every key under `prefix` only while `key` still holds `value`, in one
        transaction: of several launchers clearing the same ended job, one deletes and the
        others change nothing (not even keys a new job wrote meanwhile)."""
        ok, _ = self.txn([{"target": "VALUE", "key": _b64(key), "value": _b64(value)}],
                         [{"request_delete_range": {"key": _b64(prefix),
                                                    "range_end": _prefix_end(prefix)}}])
        return ok

    # ---- leases -------------------------------------------------------------------------------
    def grant(self, ttl_s: int) -> int:
        return int(self.call("/v3/lease/grant", {"TTL": str(int(ttl_s))})["ID"])

    def keepalive(self, lease: int) -> int:
        """Refresh `lease`; its TTL in seconds afterwards, 0 once it has expired."""
        out = self.call("/v3/lease/keepalive", {"ID": str(lease)}, stream=True)
        return int(out.get("TTL", 0))

    def revoke(self, lease: int) -> None:
        try:
            self.call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError:  # already expired
            pass

    # ---- the cluster --------------------------------------------------------------------------
    def healthy(self) -> bool:
        """A quorum answers a linearizable read."""
        try:
            self.call("/v3/kv/range", {"key": _b64("health")})
            return True
        except (EtcdUnavailable, EtcdError):
            return False


class Watch:
    """One watch stream: `next_change()` blocks until the key changes (its revision), and raises
    EtcdUnavailable once the stream ends (the member gone, or `close()` from another thread)."""

    def __init__(self, conn: http.client.HTTPConnection, resp):
        self._conn, self._resp = conn, resp

    def next_change(self) -> int:
        while True:
            try:
                line = self._resp.readline()
            except (OSError, ValueError, AttributeError) as exc:
                raise EtcdUnavailable(f"the watch stream broke: {exc}") from None
            if not line:
                raise EtcdUnavailable("the watch stream ended")
            got = json.loads(line).get("result", {})
            if got.get("canceled") or got.get("compact_revision", "0") != "0":
                raise EtcdUnavailable(f"etcd cancelled the watch: {got}")
            if got.get("events"):
                return int(got["header"]["revision"])

    def close(self) -> None:
        try:
            self._conn.sock.shutdown(socket.SHUT_RDWR)
        except (OSError, AttributeError):
            pass
        self._conn.close()
