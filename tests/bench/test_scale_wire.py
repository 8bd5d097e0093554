"""The scale harness's own store client (launcher/bench/scale/wire.py) against torch's store: each
call it makes is the call torch's client would make, as torch's server and client see it."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import queue  # noqa: E402
import threading  # noqa: E402

from checkpointless.protocol import membership  # noqa: E402
from checkpointless import protocol
from launcher.bench.scale import wire  # noqa: E402


def _run(program_of, timeout_s: float = 20.0):
    """Run one program on a fresh loop; what it returns, or the exception it raised."""
    loop, out = wire.Loop(), queue.Queue()

    def program():
        try:
            out.put((yield from program_of()))
        except Exception as exc:  # noqa: BLE001
            out.put(exc)
    loop.start(program())
    got = out.get(timeout=timeout_s)
    if isinstance(got, Exception):
        raise got
    return got


def test_every_call_reads_and_writes_what_torchs_client_does():
    server, torch_client = membership.host("127.0.0.1")
    calls = []

    def program():
        s = yield ("open", server.port, lambda: calls.append(1))
        yield (s, "set", "a", "xyz")
        yield (s, "multi_set", ["k1", "k2"], ["v1", b"v2"])
        added = [(yield (s, "add", "n", 3)), (yield (s, "add", "n", 2))]
        checks = [(yield (s, "check", ["a", "k1"])), (yield (s, "check", ["a", "absent"]))]
        got = yield (s, "get", "a")
        many = yield (s, "multi_get", ["k1", "k2", "a"])
        swapped = [(yield (s, "compare_set", "cs", "", "go")),
                   (yield (s, "compare_set", "cs", "", "other"))]
        # a wait and a get on a key that comes later, from torch's own client
        threading.Timer(0.2, lambda: torch_client.set("late", "1")).start()
        yield (s, "wait", ["late"])
        late = yield (s, "get", "late")
        return added, checks, got, many, swapped, late

    added, checks, got, many, swapped, late = _run(program)
    assert torch_client.get("a") == b"xyz"
    assert torch_client.multi_get(["k1", "k2"]) == [b"v1", b"v2"]
    assert added == [3, 5] and torch_client.add("n", 0) == 5
    assert checks == [True, False]
    assert got == b"xyz" and many == [b"v1", b"v2", b"xyz"]
    assert swapped == [b"go", b"go"] and torch_client.get("cs") == b"go"
    assert late == b"1"
    assert len(calls) == 12  # one count per call, a get's wait included in it


def test_the_librarys_barrier_steps_run_the_same_over_it():
    """Two members of one node meet at membership's barrier: one over torch's client
    (membership.barrier), one over this loop (membership.barrier_steps); both pass, the
    outcome copied into their node's store by the agent's relay."""
    job, job_client = membership.host("127.0.0.1")
    node, node_client = membership.host("127.0.0.1")
    job_client.set(protocol.plan_key(0), "{}")
    relay = threading.Thread(target=membership.relay, daemon=True, args=(
        membership.connect("127.0.0.1", job.port), membership.connect("127.0.0.1", node.port),
        0, 0))
    relay.start()
    seat = membership.Seat(gen=0, world_size=2, rank=1, node=0, members_here=2, nodes=1, lost=0,
                           t_published=0.0)

    def program():
        j = yield ("open", job.port)
        n = yield ("open", node.port)
        return (yield from wire.on(membership.barrier_steps(seat), {"job": j, "node": n}))

    other = threading.Thread(target=lambda: membership.barrier(job_client, node_client, seat))
    other.start()
    assert _run(program) is True
    other.join(10)
    relay.join(10)
    assert job_client.get(protocol.barrier_done_key(0)) == b"go"
    assert job_client.add(protocol.barrier_key(0), 0) == 1  # one add for the node


def test_a_closed_server_fails_the_call_in_flight():
    server, _ = membership.host("127.0.0.1")
    port = server.port

    def program():
        s = yield ("open", port)
        threading.Timer(0.2, lambda: _close(server)).start()
        yield (s, "wait", ["never"])

    def _close(srv):
        nonlocal server
        server = None
        del srv
    try:
        _run(program, timeout_s=10)
    except ConnectionError:
        return
    raise AssertionError("the wait on a closed server returned")
