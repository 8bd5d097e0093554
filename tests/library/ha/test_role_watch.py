"""A node follows the coordinator's role and its own fence with etcd's watch
(checkpointless/ha/role_watch.py), against a real etcd: a new holder and a fence are seen within
a fraction of a second, and while nothing changes the node sends etcd (almost) no request."""
import json
import time
import urllib.request

import pytest

from checkpointless.ha.etcd import Etcd
from checkpointless.ha.role_watch import RoleWatch
from tests.support.etcd_cluster import Cluster

pytestmark = pytest.mark.slow  # a real etcd member, about 5 s


class _Door:
    broke_at = None

    def __init__(self):
        self.targets = []

    def retarget(self, host, port):
        self.targets.append((host, port))


def _ranges(endpoint: str) -> int:
    """Range requests etcd served so far (its own metrics)."""
    text = urllib.request.urlopen(endpoint + "/metrics", timeout=5).read().decode()
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith("grpc_server_handled_total") and 'grpc_method="Range"' in line)


def test_a_new_holder_and_a_fence_are_seen_at_once_and_quiet_costs_no_reads():
    cluster = Cluster(size=1)
    etcd = Etcd(cluster.endpoints, timeout_s=2.0)
    door, ended = _Door(), []
    watch = None
    try:
        etcd.put("/job/coordinator", json.dumps({"host": "h1", "port": 1, "node": 0}))
        watch = RoleWatch(etcd, "/job", 3, door, give_up_s=10, poll_s=0.25,
                          on_end=lambda code, why: ended.append(code))
        deadline = time.time() + 5
        while not door.targets and time.time() < deadline:
            time.sleep(0.02)
        assert door.targets == [("h1", 1)]
        time.sleep(0.5)
        before = _ranges(cluster.endpoints[0])
        time.sleep(2.0)  # quiet: the watch holds its streams and reads nothing
        assert _ranges(cluster.endpoints[0]) - before <= 2
        # the role moves: a new key (its lease ran out, another node took it)
        etcd.delete("/job/coordinator")
        etcd.put("/job/coordinator", json.dumps({"host": "h2", "port": 2, "node": 1}))
        t0 = time.time()
        while len(door.targets) < 2 and time.time() - t0 < 5:
            time.sleep(0.01)
        assert door.targets[-1] == ("h2", 2) and time.time() - t0 < 1.0
        assert watch.moved.is_set()
        t0 = time.time()
        etcd.put("/job/fence/3", "declared lost")
        while not ended and time.time() - t0 < 5:
            time.sleep(0.01)
        assert ended == [3] and time.time() - t0 < 1.0 and watch.fenced == "declared lost"
    finally:
        if watch is not None:
            watch.stop()
        cluster.close()
