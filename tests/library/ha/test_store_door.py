"""A node's door to the coordinator's store (checkpointless/ha/store_door.py), with torch's own
client and servers: every call the workers make passes through it unchanged, and when the
coordinator's server is SIGKILLed and another takes its place, a call blocked in the old one is
answered by the new one, and the client goes on as if nothing happened."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

from checkpointless.ha.store_door import StoreDoor  # noqa: E402

# in `make test`, not `make test-fast`: five store servers in processes of their own, ~20 s
pytestmark = pytest.mark.slow

SERVER = ("import sys, time, torch.distributed as d; from datetime import timedelta; "
          "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, "
          "timeout=timedelta(seconds=60)); print(s.port, flush=True); time.sleep(600)")


def _server():
    """A coordinator's store in a process of its own, killed for real by the test."""
    p = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    return p, int(p.stdout.readline())


def _client(port: int, timeout_s: float = 30.0):
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))


def test_every_call_passes_through_unchanged():
    proc, port = _server()
    door = StoreDoor()
    try:
        door.retarget("127.0.0.1", port)
        c = _client(door.port)
        direct = _client(port)
        c.set("a", "1")
        assert direct.get("a") == b"1" and c.get("a") == b"1"
        assert c.add("n", 2) == 2 and c.add("n", 3) == 5
        assert c.check(["a"]) and not c.check(["a", "missing"])
        c.multi_set(["x", "y"], ["1", "2"])
        assert c.multi_get(["x", "y", "a"]) == [b"1", b"2", b"1"]
        assert c.compare_set("a", "1", "2") == b"2" and c.compare_set("a", "1", "3") == b"2"
        assert c.num_keys() == direct.num_keys()
        assert c.delete_key("x") and not direct.check(["x"])
        # a wait answered by another client's set, and one that times out (cancelled)
        threading.Timer(0.3, lambda: direct.set("later", "v")).start()
        c.wait(["later"], timedelta(seconds=10))
        t0 = time.time()
        try:
            c.wait(["never"], timedelta(seconds=0.5))
            raise AssertionError("the wait did not time out")
        except (RuntimeError, dist.DistStoreError):
            pass
        assert time.time() - t0 < 5
        assert c.get("later") == b"v"  # the connection is still in step after the cancel
    finally:
        door.close()
        proc.kill()
        proc.wait()


def test_a_call_blocked_in_a_killed_coordinator_is_answered_by_the_next():
    old, old_port = _server()
    door = StoreDoor()
    new = None
    try:
        door.retarget("127.0.0.1", old_port)
        c = _client(door.port)
        assert c.add("lost", 1) == 1
        got = {}

        def blocked():  # a survivor waiting for the coordinator's word
            c.wait(["plan/1"], timedelta(seconds=60))
            got["plan"] = c.get("plan/1")

        t = threading.Thread(target=blocked)
        t.start()
        time.sleep(0.3)
        old.kill()
        old.wait()
        time.sleep(0.5)
        assert t.is_alive()  # still waiting: the door holds the call for the next coordinator
        new, new_port = _server()
        door.retarget("127.0.0.1", new_port)
        fresh = _client(new_port)
        fresh.set("lost", "0")  # the new coordinator rebuilds its counters (from etcd)
        fresh.set("plan/1", "from the new coordinator")
        t.join(15)
        assert got.get("plan") == b"from the new coordinator"
        # the same client object goes on, on the new store
        assert c.add("lost", 1) == 1
        c.set("rec/1/0", "entered")
        assert fresh.get("rec/1/0") == b"entered"
        # a connection made after the move goes to the new coordinator too
        assert _client(door.port).get("plan/1") == b"from the new coordinator"
    finally:
        door.close()
        for p in (old, new):
            if p is not None:
                p.kill()
                p.wait()


def test_a_call_made_while_no_coordinator_is_up_waits_for_one():
    old, old_port = _server()
    door = StoreDoor()
    new = None
    try:
        door.retarget("127.0.0.1", old_port)
        c = _client(door.port)
        c.set("k", "old")
        old.kill()
        old.wait()
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("n", c.add("gen", 1)))
        t.start()
        time.sleep(0.5)
        assert t.is_alive()
        new, new_port = _server()
        door.retarget("127.0.0.1", new_port)
        t.join(15)
        assert got == {"n": 1} and _client(new_port).get("gen") == b"1"
    finally:
        door.close()
        for p in (old, new):
            if p is not None:
                p.kill()
                p.wait()
