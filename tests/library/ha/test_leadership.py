"""The coordinator's role held through an etcd lease, on a real 3-member etcd cluster: the client,
a holder SIGKILLed (the role moves within its lease), a holder paused past its lease (it comes
back fenced and writes nothing), and a majority of the members lost (the holder knows it).

Candidates run in processes of their own (tests/support/scripts/role_candidate.py), killed and stopped
for real."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from checkpointless.ha.etcd import Etcd, EtcdUnavailable  # noqa: E402
from checkpointless.ha.leadership import Fenced, Role  # noqa: E402
from tests.support.etcd_cluster import Cluster  # noqa: E402

# in `make test`, not `make test-fast`: three etcd members and a few candidate processes, ~20 s
pytestmark = pytest.mark.slow

from tests.conftest import ROOT as _ROOT  # noqa: E402
ROOT = str(_ROOT)
SCRIPT = os.path.join(ROOT, "tests", "support", "scripts", "role_candidate.py")
TTL = 2


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(3)
    yield c
    c.close()


class Candidate:
    """A role_candidate.py process; its lines kept with the time each arrived."""

    def __init__(self, endpoints: list[str], name: str):
        self.proc = subprocess.Popen([sys.executable, SCRIPT, ",".join(endpoints), name, str(TTL)],
                                     stdout=subprocess.PIPE, text=True)
        self.lines: list[tuple[float, str]] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.strip()))

    def wait_for(self, prefix: str, timeout_s: float = 30.0) -> tuple[float, str]:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            for t, line in list(self.lines):
                if line.startswith(prefix):
                    return t, line
            time.sleep(0.02)
        raise AssertionError(f"no '{prefix}' line in {timeout_s} s: {self.lines[-5:]}")

    def end(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def test_the_client_reads_writes_and_fences_on_a_real_cluster(cluster):
    c = Etcd(cluster.endpoints)
    c.put("t/a", "1")
    assert c.get("t/a").value == b"1" and c.get("t/none") is None
    ok, _ = c.create("t/b", "first")
    again, there = c.create("t/b", "second")
    assert ok and not again and there.value == b"first"
    assert [e.key for e in c.get_prefix("t/")] == ["t/a", "t/b"]
    guard = c.get("t/b").create_revision
    assert c.put_if("t/c", "x", "t/b", guard)
    assert not c.put_if("t/c", "y", "t/b", guard + 1000) and c.get("t/c").value == b"x"
    lease = c.grant(5)
    c.put("t/leased", "v", lease=lease)
    assert c.keepalive(lease) == 5
    c.revoke(lease)
    assert c.get("t/leased") is None and c.keepalive(lease) == 0
    # a client given one dead endpoint first goes on to the next
    assert Etcd(["http://127.0.0.1:9"] + cluster.endpoints).get("t/a").value == b"1"


def test_a_killed_holder_hands_the_role_on_within_its_lease(cluster):
    a = Candidate(cluster.endpoints, "a")
    try:
        _, held = a.wait_for("holds")
        token_a = int(held.split()[1])
        a.wait_for("wrote")
        b = Candidate(cluster.endpoints, "b")
        try:
            time.sleep(1.5)  # b is campaigning: it holds nothing while a lives
            assert not any(line.startswith("holds") for _, line in b.lines)
            t_kill = time.time()
            a.proc.send_signal(signal.SIGKILL)
            t_held, held = b.wait_for("holds", timeout_s=TTL + 10)
            assert int(held.split()[1]) > token_a
            # the lease runs out within its TTL (etcd's clock), then b looks every 0.2 s
            assert t_held - t_kill < TTL + 1.5, t_held - t_kill
            b.wait_for("wrote")
        finally:
            b.end()
    finally:
        a.end()


def test_a_paused_holder_comes_back_fenced_and_writes_nothing(cluster):
    client = Etcd(cluster.endpoints)
    a = Candidate(cluster.endpoints, "p")
    b = None
    try:
        a.wait_for("holds")
        a.wait_for("wrote")
        os.kill(a.proc.pid, signal.SIGSTOP)  # as a partition: it neither refreshes nor writes
        last_by_a = client.get("by/p").value
        b = Candidate(cluster.endpoints, "q")
        b.wait_for("holds", timeout_s=TTL + 10)
        os.kill(a.proc.pid, signal.SIGCONT)
        assert a.proc.wait(15) == 3
        assert any(line.startswith("fenced") for _, line in a.lines), a.lines[-3:]
        assert client.get("by/p").value == last_by_a  # nothing written after it was replaced
        b.wait_for("wrote")
    finally:
        a.end()
        if b is not None:
            b.end()


def test_losing_a_majority_of_members_deposes_the_holder():
    c = Cluster(3)
    try:
        lost = []
        role = Role(Etcd(c.endpoints, timeout_s=0.5), "job/coordinator", {"node": 0},
                    ttl_s=TTL, on_lost=lost.append)
        assert role.campaign()
        role.write("job/x", "1")
        c.kill(1)
        c.kill(2)
        t0 = time.time()
        assert role.lost.wait(TTL + 3), "the holder still believes it holds the role"
        # a TTL after the last refresh etcd answered; a leader left alone answers them until it
        # sees it lost its quorum (its election timeout, 1 s)
        assert time.time() - t0 <= TTL + 2.0 and lost
        with pytest.raises((Fenced, EtcdUnavailable)):
            role.write("job/x", "2")
        with pytest.raises(EtcdUnavailable):
            Etcd(c.endpoints, timeout_s=0.5).get("job/x")
    finally:
        c.close()


def test_the_jobs_facts_round_trip_and_a_deposed_holder_records_none(cluster):
    from checkpointless.control.facts import Deposed
    from checkpointless.ha.etcd_facts import JobFacts
    from checkpointless.protocol.membership import Plan
    etcd = Etcd(cluster.endpoints)
    role = Role(etcd, "facts/coordinator", {"node": 1}, ttl_s=TTL)
    assert role.campaign()
    facts = JobFacts(etcd, "facts", role)
    assert facts.known().gen == -1
    facts.record_spec('{"nproc": 4}')
    for g in range(3):
        facts.record_plan(Plan(gen=g, world_size=2, ranks={10 + g: 0, 1: 1},
                               nodes={10 + g: g, 1: 0}), lost=g, next_wid=11 + g)
    facts.record_fence(0, "fenced: silent")
    facts.record_move({"token": role.token, "node": 1})
    facts.record_notices(2)
    k = facts.known()
    assert (k.spec, k.gen, k.lost, k.next_wid, k.notices, k.done) == ('{"nproc": 4}', 2, 2, 13, 2,
                                                                     None)
    assert sorted(k.plans) == [1, 2]  # the newest two
    assert k.plans[2] == {"ranks": {"12": 0, "1": 1}, "nodes": {"12": 2, "1": 0},
                          "world_size": 2, "hosts": {}, "logical_world": 0}  # no shrink
    assert k.fenced == {0: "fenced: silent"} and k.moves == [{"token": role.token, "node": 1}]
    facts.record("steps/0", '{"0": [1.0, 1.5]}')  # the run's record (control/ledger.py)
    facts.record("recovery/7", '{"generation": 1}')
    assert facts.known().record == {"steps/0": '{"0": [1.0, 1.5]}',
                                    "recovery/7": '{"generation": 1}'}
    facts.finish("ok")
    assert facts.known().done == "ok"
    # a holder whose key was taken over writes nothing more
    etcd.delete("facts/coordinator")
    other = Role(etcd, "facts/coordinator", {"node": 2}, ttl_s=TTL)
    assert other.try_take()
    with pytest.raises(Deposed):
        facts.record_fence(3, "fenced: too late")
    with pytest.raises(Deposed):
        facts.record("steps/1", "{}")
    assert 3 not in facts.known().fenced and "steps/1" not in facts.known().record
    other.resign()


def test_a_resumed_launch_clears_the_ended_job_and_a_new_one_is_refused(cluster):
    """A job that ended (preempted) under a prefix: a launch with checkpoint.resume=auto clears
    its keys (its resubmission), a launch without is refused naming the way out, and a node
    arriving after the new job began deletes nothing of it."""
    from omegaconf import OmegaConf

    from launcher.run.etcd_node import ended_job
    etcd = Etcd(cluster.endpoints)
    ended = "preempted before step 10 (SIGTERM on node 0)"
    for name, value in {"gen": "3", "plan/3": "{}", "record/steps/0": "{}",
                        "done": ended}.items():
        etcd.put(f"ended/{name}", value)
    etcd.put("ended-too/gen", "4")  # another job's prefix, sharing the first letters

    def cfg(resume):
        return OmegaConf.create({"run": {"name": "r"}, "checkpoint": {"resume": resume},
                                 "checkpointless": {"etcd": {"prefix": "ended"}}})
    why = ended_job(cfg("never"), etcd)
    assert "checkpointless.etcd.prefix=ended" in why and ended in why
    assert "checkpoint.resume=auto" in why
    assert etcd.get("ended/gen") is not None  # refused: nothing removed
    assert ended_job(cfg("auto"), etcd) is None
    assert etcd.get_prefix("ended/") == [] and etcd.get("ended-too/gen").value == b"4"
    etcd.put("ended/gen", "0")  # the new job began; a late node clears what it read before
    assert not etcd.delete_prefix_if("ended/", "ended/done", ended)
    assert etcd.get("ended/gen").value == b"0"
    assert ended_job(cfg("auto"), etcd) is None and etcd.get("ended/gen").value == b"0"


def test_a_kept_member_stopped_by_sigterm_starts_again_on_its_data(tmp_path):
    """A preemption's SIGTERM under Slurm reaches the embedded members too: each starts again
    on its data (member.Kept), its keys still there; once killed by its launcher, it stays
    down."""
    from checkpointless.ha import member
    from tests.support.etcd_cluster import _free_ports
    if member.binary() is None:
        pytest.skip("no etcd binary (Debian's etcd-server package; .ci/run installs it)")
    spec = member.MemberSpec("solo", "127.0.0.1", *_free_ports(2))
    said = []
    kept = member.Kept(lambda: member.start(spec, [spec], str(tmp_path / "data"), token="t"),
                       log=said.append)
    try:
        member.wait_healthy([spec.client_url])
        Etcd([spec.client_url]).put("kept", "yes")
        first = kept.proc
        first.send_signal(signal.SIGTERM)
        deadline = time.time() + 10
        while kept.proc is first and time.time() < deadline:
            time.sleep(0.05)
        member.wait_healthy([spec.client_url], timeout_s=20)
        assert Etcd([spec.client_url]).get("kept").value == b"yes"
        assert len(said) == 1 and "exit -15" in said[0], said
    finally:
        kept.kill()
        kept.wait()
    time.sleep(0.5)
    assert kept.poll() is not None and kept.restarts == 1
