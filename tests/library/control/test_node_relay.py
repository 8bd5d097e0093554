"""The node's door multiplexes (checkpointless/ha/store_door.py): however many local clients, the
coordinator's store sees one connection from the node; every client's calls and waits are
answered as a direct connection would answer them, waits for the same keys share one upstream
wait, and with hold=False a coordinator that dies fails the clients' calls at once."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402

import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

from checkpointless.control.node_door import StoreDoor  # noqa: E402
from checkpointless.protocol import membership  # noqa: E402


def _established(port: int) -> int:
    """Connections the server on `port` (in this process) has accepted and holds."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                n += state == "01" and int(local.rsplit(":", 1)[1], 16) == port
    return n


def _client(port: int, timeout_s: float = 20.0):
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))


def test_sixteen_clients_reach_the_store_over_one_connection():
    server, direct = membership.host("127.0.0.1")
    door = StoreDoor(hold=False)
    try:
        door.retarget("127.0.0.1", server.port)
        before = _established(server.port)
        clients = [_client(door.port) for _ in range(16)]
        got: dict[int, bytes] = {}

        def rank(i: int, c) -> None:  # each waits for its own key, set in reverse order
            c.set(f"ready/{i}", str(i))
            got[i] = c.get(f"go/{i}")
            assert c.add("arrived", 1) >= 1
            c.wait(["all"])  # the same keys for all: one upstream wait

        threads = [threading.Thread(target=rank, args=(i, c)) for i, c in enumerate(clients)]
        for t in threads:
            t.start()
        direct.wait([f"ready/{i}" for i in range(16)], timedelta(seconds=20))
        for i in reversed(range(16)):
            direct.set(f"go/{i}", f"value {i}")
            time.sleep(0.005)
        while int(direct.add("arrived", 0)) < 16:
            time.sleep(0.01)
        time.sleep(0.2)  # every client in its wait for "all"
        direct.set("all", "1")
        for t in threads:
            t.join(20)
        assert got == {i: f"value {i}".encode() for i in range(16)}
        assert _established(server.port) - before == 1, _established(server.port) - before
        assert door.stats["waits_shared"] >= 15  # the 16 waits for "all", one upstream
        # the calls' answers stay in step after all that
        assert clients[3].multi_get(["go/1", "all"]) == [b"value 1", b"1"]
        assert clients[5].compare_set("all", "1", "2") == b"2" and direct.get("all") == b"2"
    finally:
        door.close()


def test_wake_ups_among_answers_leave_every_answer_in_step():
    """Waits armed upstream wake while other clients' calls are answered on the same connection:
    each wake-up byte must be told from the answers around it (the door's CANCEL_WAIT framing).
    Counters, compare-and-sets and reads are all checked against what they must answer."""
    server, direct = membership.host("127.0.0.1")
    door = StoreDoor(hold=False)
    try:
        door.retarget("127.0.0.1", server.port)
        callers, waiters = [_client(door.port) for _ in range(4)], [_client(door.port)
                                                                      for _ in range(3)]
        adds: list[int] = []
        bad: list[str] = []
        seen = {i: 0 for i in range(3)}

        def call(i: int, c) -> None:
            for n in range(150):
                adds.append(c.add("counter", 1))  # list.append: atomic under the GIL
                c.set(f"own/{i}", str(n))
                if c.get(f"own/{i}") != str(n).encode():
                    bad.append(f"client {i} read back another value at {n}")
                # an empty answer (a value of length 0) starts with a zero byte, as a wake does
                if c.compare_set(f"empty/{i}", "", "") != b"":
                    bad.append(f"client {i}: compare_set of an empty value")

        def wait(i: int, c) -> None:
            for g in range(40):
                c.wait([f"wake/{i}/{g}"])
                seen[i] = g + 1

        # daemons: a door that lost the thread of its answers leaves them blocked, and the
        # assertions below must still report it
        threads = [threading.Thread(target=call, args=(i, c), daemon=True)
                   for i, c in enumerate(callers)]
        threads += [threading.Thread(target=wait, args=(i, c), daemon=True)
                    for i, c in enumerate(waiters)]
        for t in threads:
            t.start()
        for g in range(40):  # the waits wake all through the callers' calls
            for i in range(3):
                direct.set(f"wake/{i}/{g}", "1")
            time.sleep(0.004)
        for t in threads:
            t.join(60)
        assert not bad, bad
        assert sorted(adds) == list(range(1, 601)), "an add's answer went to another call"
        assert seen == {0: 40, 1: 40, 2: 40}
        assert door.stats["upstream_connects"] == 1  # no answer was in doubt: never reconnected
    finally:
        door.close()


SERVER = ("import time, torch.distributed as d; from datetime import timedelta; "
          "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, "
          "timeout=timedelta(seconds=60)); print(s.port, flush=True); time.sleep(600)")


# in `make test`: a store server in a process of its own, killed; about 5 s
@pytest.mark.slow
def test_without_hold_a_dead_coordinator_fails_the_calls_at_once():
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    door = StoreDoor(hold=False)
    try:
        door.retarget("127.0.0.1", int(proc.stdout.readline()))
        c = _client(door.port, timeout_s=30)
        c.set("k", "v")
        errors = []

        def blocked():
            try:
                c.wait(["never"])
            except (RuntimeError, dist.DistStoreError) as exc:
                errors.append(exc)

        t = threading.Thread(target=blocked)
        t.start()
        time.sleep(0.3)
        t0 = time.time()
        proc.kill()
        proc.wait()
        t.join(10)
        assert errors and time.time() - t0 < 5, "the wait was not failed at once"
    finally:
        door.close()
        proc.kill()
        proc.wait()
