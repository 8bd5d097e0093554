"""etcd's requests per second from the nodes of a job under coordinator=etcd, watched or polled:

    python -m launcher.bench.scale.etcd_load --nodes 512 [--window-s 10] [--json FILE]

One real etcd member (Debian's etcd 3.4) on loopback; N simulated nodes, each the product's own
`RoleWatch` (checkpointless/ha/role_watch.py: the role's key and the node's fence followed with
etcd's watch), with a stand-in for its door. The figure is etcd's own count of the requests it
served (`grpc_server_handled_total` in its /metrics; the HTTP gateway's calls are counted there)
over a quiet window once every node follows the role. `--poll` runs, for comparison, what the
nodes did before the watch: two reads every 0.25 s each (the same reads, in a loop).
"""
from __future__ import annotations

import argparse
import json
import shutil
import socket
import sys
import tempfile
import threading
import time
import urllib.request

from checkpointless.ha import member as etcd_member
from checkpointless.ha.etcd import Etcd
from checkpointless.ha.member import MemberSpec
from checkpointless.ha.role_watch import RoleWatch


class _Door:
    broke_at = None
    target = None

    def retarget(self, host, port):
        self.target = (host, port)


def _handled(endpoint: str) -> int:
    """Every request etcd served so far, by its own metrics."""
    text = urllib.request.urlopen(endpoint + "/metrics", timeout=10).read().decode()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("grpc_server_handled_total{"))


def _poll(etcd: Etcd, node: int, stop: threading.Event) -> None:
    while not stop.wait(0.25):  # the loop RoleWatch ran before it watched
        try:
            etcd.get("/job/coordinator")
            etcd.get(f"/job/fence/{node}")
        except RuntimeError:
            pass


def measure(nodes: int, window_s: float = 10.0, poll: bool = False) -> dict:
    if etcd_member.binary() is None:
        raise RuntimeError("no etcd binary (Debian's etcd-server package)")
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    me = MemberSpec("m0", "127.0.0.1", ports[0], ports[1])
    data = tempfile.mkdtemp(prefix="etcd-load-")
    proc = etcd_member.start(me, [me], data + "/m0", token="load", log_path=data + "/m0.log")
    stop, watches = threading.Event(), []
    try:
        etcd_member.wait_healthy([me.client_url])
        Etcd([me.client_url]).put("/job/coordinator", json.dumps({"host": "h", "port": 1}))
        t0 = time.time()
        for k in range(nodes):
            etcd = Etcd([me.client_url], timeout_s=5.0)
            if poll:
                threading.Thread(target=_poll, args=(etcd, k, stop), daemon=True).start()
            else:
                watches.append(RoleWatch(etcd, "/job", k, _Door(), give_up_s=60, log=lambda m: 0))
        while watches and not all(w.door.target for w in watches):
            time.sleep(0.1)
        started_s = time.time() - t0
        time.sleep(2.0)
        n0, t1 = _handled(me.client_url), time.time()
        time.sleep(window_s)
        per_s = (_handled(me.client_url) - n0 - 1) / (time.time() - t1)  # less our own read
        return {"nodes": nodes, "mode": "poll" if poll else "watch",
                "etcd_requests_per_s": round(per_s, 1), "window_s": window_s,
                "started_s": round(started_s, 1)}
    finally:
        stop.set()
        for w in watches:
            w.stop()
        proc.kill()
        proc.wait()
        shutil.rmtree(data, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m launcher.bench.scale.etcd_load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=512)
    p.add_argument("--window-s", type=float, default=10.0)
    p.add_argument("--poll", action="store_true", help="the polling nodes of before")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args(argv)
    got = measure(a.nodes, a.window_s, a.poll)
    print(f"{got['nodes']} nodes, {got['mode']}: etcd served {got['etcd_requests_per_s']} "
          f"requests/s over {got['window_s']:g} s (all following the role after "
          f"{got['started_s']} s)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(got, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
