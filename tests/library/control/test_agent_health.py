"""A node agent's health record, in-process on real stores and a real process: what it reports
of its workers (heartbeats, a stopped process), in as few store calls as it can."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

from checkpointless.control import detection  # noqa: E402
from checkpointless.protocol import membership
from checkpointless import protocol
from checkpointless.control.agent import NodeAgent  # noqa: E402


class _Counted:
    """A store client whose calls are counted by name."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        attr = getattr(self.store, name)

        def call(*a, **k):
            self.calls.append(name)
            return attr(*a, **k)
        return call


def _until_stopped(procs, within_s: float = 10.0) -> None:
    deadline = time.time() + within_s
    while not all(detection.process_stopped(p.pid) for p in procs):
        assert time.time() < deadline, "SIGSTOP not delivered"
        time.sleep(0.01)


def _beat(store, wid: int, age_s: float) -> None:
    store.set(protocol.heartbeat_key(wid), json.dumps(
        {"t": time.time() - age_s, "step": 3, "gen": 0, "phase": "step"}))


def test_a_stopped_worker_is_reported_once_silent_and_beats_are_read_in_one_call():
    server, job = membership.host("127.0.0.1")
    procs = []
    agent = NodeAgent(job, 1, [sys.executable, "-c", "import time; time.sleep(60)"], {},
                      "127.0.0.1", server.port, 3.0, log=lambda m: None,
                      starter=lambda cmd, env: procs.append(subprocess.Popen(cmd)) or procs[-1])
    try:
        agent._spawn(10, 0, False)
        agent._spawn(11, 1, False)
        # worker 10 has beaten just now, worker 11 not yet: a check each, one read of 10's
        _beat(agent.node_store, 10, 0.0)
        agent.node_store = _Counted(agent.node_store)
        assert str(agent.health(news=False)) == "run"
        assert agent.node_store.calls == ["check", "check", "multi_get"]
        record = json.loads(job.get(protocol.node_health_key(1)))
        assert set(record["beats"]) == {"10"} and record["stopped"] == []
        assert agent.beaten == {10}
        # 10 known to beat, 11 still silent (a spare never beats until it holds a rank): one
        # multi_get for 10, one check for 11, not a check and a read per worker
        agent.node_store.calls.clear()
        agent.health(news=False)
        assert agent.node_store.calls == ["check", "multi_get"]

        # both beat: from now on one multi_get and no check
        _beat(agent.node_store.store, 11, 0.0)
        agent.health(news=False)
        agent.node_store.calls.clear()
        agent.health(news=False)
        assert agent.node_store.calls == ["multi_get"]
        assert agent.beaten == {10, 11}

        # worker 11 stopped (SIGSTOP) and silent: reported; worker 10 stopped but its beat is
        # fresh (it cannot be judged hung yet): /proc is not read for it
        for p in procs:
            os.kill(p.pid, signal.SIGSTOP)
        _until_stopped(procs)  # the signal is delivered when the process is next scheduled
        _beat(agent.node_store.store, 11, detection.STOPPED_AFTER_S + 1.0)
        agent.health(news=False)
        record = json.loads(job.get(protocol.node_health_key(1)))
        assert record["stopped"] == [11]
        assert record["beats"]["11"][1] > detection.STOPPED_AFTER_S
        _beat(agent.node_store.store, 10, detection.STOPPED_AFTER_S + 1.0)
        agent.health(news=False)
        assert json.loads(job.get(protocol.node_health_key(1)))["stopped"] == [10, 11]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_read_beats_without_a_known_set_checks_first():
    server, store = membership.host("127.0.0.1")
    counted = _Counted(store)
    _beat(store, 1, 0.0)
    assert detection.read_beats(counted, [1, 2])[2] is None
    assert counted.calls[0] == "check"
    beaten: set = set()
    _beat(store, 2, 0.0)
    counted.calls.clear()
    beats = detection.read_beats(counted, [1, 2], beaten)
    assert set(beats) == {1, 2} and beaten == {1, 2}
    assert counted.calls == ["check", "check", "multi_get"]
    assert beats[2]["step"] == 3


def test_one_call_writes_the_record_or_answers_the_coordinators_word():
    """The coordinator replaces a node's record with its word; the agent's next write (a
    compare_set expecting its own last record) answers it, and a fenced node writes no more."""
    server, job = membership.host("127.0.0.1")
    key = protocol.node_health_key(1)
    agent = NodeAgent(job, 1, ["unused"], {}, "127.0.0.1", server.port, 3.0, log=lambda m: None,
                      starter=lambda cmd, env: None)
    agent.store = _Counted(job)
    assert str(agent.health(news=False)) == "run" and str(agent.health(news=False)) == "run"
    assert agent.store.calls == ["compare_set", "compare_set"]  # one call a record
    assert json.loads(job.get(key))["seq"] == 2

    # the job ends while the agent writes its last record: the word first, then the record
    job.set(key, "stopped: a worker failed")
    assert str(agent.health(news=False)) == "stopped: a worker failed"
    assert job.get(key) == b"stopped: a worker failed"  # the word is not overwritten...
    agent.health(news=False, final=True)
    assert json.loads(job.get(key))["final"] is True  # ...except by the agent's last record
    job.set(key, "shutdown")
    agent.health(news=False, final=True)  # its own last record expected: answered the word
    assert json.loads(job.get(key))["final"] is True

    # a coordinator that takes over has a new, empty store: the first write lands there
    server2, job2 = membership.host("127.0.0.1")
    agent.store = job2
    assert str(agent.health(news=False)) == "run"
    assert json.loads(job2.get(key))["seq"] == agent.seq

    # fenced: told at the next write, and nothing it writes after lands, its last record neither
    job2.set(key, "fenced: silent for 3.1 s")
    assert str(agent.health(news=False)) == "fenced: silent for 3.1 s"
    assert str(agent.health(news=True, final=True)).startswith("fenced")
    assert job2.get(key) == b"fenced: silent for 3.1 s"


def test_record_json_carries_every_field():
    """The record is written by hand (asdict deep-copies every beat): every field of NodeRecord,
    and only those, round-trips."""
    import dataclasses
    from checkpointless.protocol.records import NodeRecord
    rec = NodeRecord(seq=7, t=12.5, beats={"3": [4, 0.1, 2, "step", [0.5]]}, stopped=[3],
                     exited={"5": -9}, final=True)
    assert json.loads(rec.to_json()) == dataclasses.asdict(rec)
    assert NodeRecord.parse(rec.to_json()) == rec
