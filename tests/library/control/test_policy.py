"""The supervisor's decisions (policy.py) and the node agents' exit notices, in-process and fast:
every stop rule, the spares chosen for a lost process and for a lost node, find_hung, and the
store operations a coordinator spends watching remote workers (by node, not by rank)."""
import json
import time
from datetime import timedelta
from types import SimpleNamespace as NS

import pytest
import torch.distributed as dist

from checkpointless.control import policy
from checkpointless import protocol
from checkpointless.protocol.records import RUN, Word
from checkpointless.control.agent import NodeAgent
from checkpointless.control.cluster import ClusterPool, RemoteProc
from checkpointless.control.processes import Worker
from checkpointless.control.supervisor import SupervisorConfig


# ---- stop rules --------------------------------------------------------------------------------
def test_a_start_up_error_of_the_workers_own_stops_and_a_signal_death_is_a_fault():
    assert policy.startup_failure(3, 1, 1, ready=True) is None
    msg = policy.startup_failure(3, 1, 1, ready=False)
    assert msg.startswith("worker 3 (rank 1) exited with code 1 before it finished starting up")
    assert "output above" in msg
    msg = policy.startup_failure(3, 1, 1, False, "Traceback ...\nValueError: bad recipe\n")
    assert "starting up: ValueError: bad recipe." in msg
    assert policy.startup_failure(3, 1, -9, ready=False) is None  # SIGKILL, the OOM killer
    assert policy.startup_failure(3, 1, None, ready=False) is None  # hung, or its node lost


def test_a_first_generation_worker_silent_past_the_start_up_deadline_is_overdue():
    started = {0: 100.0, 1: 100.0, 2: 150.0}
    beats = {0: {"t": 160.0, "step": 0}, 1: None, 2: None}
    assert policy.startup_overdue(started, beats, 60.0, 170.0) == [1]
    assert policy.startup_overdue(started, beats, 60.0, 159.0) == []
    assert policy.startup_overdue(started, beats, 10.0, 170.0) == [1, 2]


def test_exit_0_without_finish_stops_unless_hung_or_its_node_was_lost():
    assert "without calling job.finish()" in policy.clean_exit(2, 0, 0, hung=False,
                                                               node_lost=False)
    assert policy.clean_exit(2, 0, 0, hung=True, node_lost=False) is None
    assert policy.clean_exit(2, 0, 0, hung=False, node_lost=True) is None
    assert policy.clean_exit(2, 0, -9, hung=False, node_lost=False) is None


def test_checkpointless_off_stops_at_the_first_failure():
    assert policy.disabled(True, 1, 4, "exit", -9) is None
    assert policy.disabled(False, 1, 4, "exit", -9) == (
        "rank 1 (worker 4) failed (exit, exit code -9) and checkpointless is off: the run "
        "stops here")


def test_every_active_worker_lost_stops_with_the_first_error():
    assert policy.none_left(1, []) is None
    assert policy.none_left(0, ["Traceback\nValueError: boom\n"]).endswith(
        "The first error: ValueError: boom")
    assert policy.none_left(0, []).endswith("see the output above")


def test_a_replacement_crash_loop_stops_after_the_limit_in_a_row():
    crashes = 0
    for stepped in (False, True, False):
        crashes = policy.crashes_after(crashes, stepped)
    assert crashes == 1  # a replacement that stepped resets the count
    assert policy.crash_loop(2, 1, 2, None, -9) is None
    msg = policy.crash_loop(2, 2, 2, None, -9)
    assert "failed before completing its first step 2 times in a row" in msg
    assert "max_replacement_failures=2" in msg and "exit code -9" in msg
    assert policy.crash_loop(2, 2, 2, "Trace\nRuntimeError: bad device\n", 1).endswith(
        "RuntimeError: bad device")


def test_an_error_again_at_the_same_step_escalates():
    a = NS(cause="error", step=5, rank=0, error="x\nValueError: again", gen=1)  # replaced
    b = NS(cause="error", step=5, rank=1, error="x\nValueError: again", gen=-1)
    other = NS(cause="exit", step=5, rank=1, error=None, gen=1)
    assert policy.escalation([a], a) is None
    assert policy.escalation([other, a], a) is None
    msg = policy.escalation([a, b], b)
    assert msg.startswith("step 5 raised an error again after a recovery (ranks 0 and 1)")
    assert msg.endswith("The error: ValueError: again")
    # two ranks raising at once, before any recovery: a bug too, and said as it happened
    at_once = NS(cause="error", step=0, rank=0, error="x\nKeyError: 'labels'", gen=-1)
    too = NS(cause="error", step=0, rank=1, error="x\nKeyError: 'labels'", gen=-1)
    msg = policy.escalation([at_once, too], too)
    assert msg.startswith("step 0 raised an error on two ranks at once (ranks 0 and 1)")
    assert "after a recovery" not in msg
    # before the job's first step: its set-up after joining (shards, weights), not "the step"
    msg = policy.escalation([at_once, too], too, stepped=False)
    assert msg.startswith("the job's set-up before its first step (after joining: the model's "
                          "shards, its weights, the optimizer) raised an error on two ranks at "
                          "once (ranks 0 and 1)")
    assert "bug in the step" not in msg and msg.endswith("KeyError: 'labels'")


def test_no_spare_left_and_the_spare_wait_running_out_stop():
    assert policy.no_spare_left(1, 1, 1, True) is None
    assert policy.no_spare_left(2, 0, 1, False).startswith(
        "2 rank(s) lost and no spare left (checkpointless.spares=1, refill=False)")
    assert policy.spare_wait_over(10.0, 600.0) is None
    assert "spare_wait_s=600 s" in policy.spare_wait_over(600.5, 600.0)


def test_done_workers_that_exit_non_zero_fail_and_killed_ones_stand():
    assert policy.bad_exits({0: 0, 1: -9}) is None
    assert policy.bad_exits({0: 0, 1: 3}) == (
        "workers [1] reported done but exited non-zero (exit codes [3])")
    assert policy.killed_after_done({0: 0, 1: -9, 2: None}) == [1]


def test_cause_and_job_step():
    assert policy.cause(True, True, True, {"error": "x"}) == "node_lost"
    assert policy.cause(False, True, True, None) == "hang"
    assert policy.cause(False, False, True, {"error": "x"}) == "diverged"
    assert policy.cause(False, False, False, {"error": "x"}) == "error"
    assert policy.cause(False, False, False, None) == "exit"
    assert policy.job_step([None, {"step": 3}, {"step": 4}]) == 4
    assert policy.job_step([None]) == 0


# ---- hung workers ------------------------------------------------------------------------------
def test_find_hung_judges_a_silent_worker_only_when_behind_a_stalled_job_or_stopped():
    now = 100.0
    stalled = {0: {"t": 90.0, "step": 5}, 1: {"t": 91.0, "step": 4}, 2: None}
    assert policy.find_hung(stalled, 3.0, now) == [1]  # behind the lead, all silent
    moving = {0: {"t": 99.9, "step": 5}, 1: {"t": 91.0, "step": 4}}
    assert policy.find_hung(moving, 3.0, now) == []  # a slow step, not a hang
    assert policy.find_hung(moving, 3.0, now, stopped=lambda w: w == 1) == [1]
    done = {0: {"t": 10.0, "step": 9, "phase": "done"}, 1: {"t": 10.0, "step": 8}}
    assert policy.find_hung(done, 3.0, now) == []  # done workers are out of the judgement


# ---- spares ------------------------------------------------------------------------------------
def spare(wid, node, slot):
    return NS(wid=wid, node=node, slot=slot)


def test_a_lost_process_gets_the_first_ready_spare_on_its_node():
    ready = [spare(10, 1, 2), spare(11, 0, 3), spare(12, 0, 2)]
    chosen = policy.choose_spares(ready, [(0, 1)], set(), set())
    assert [w.wid for w in chosen] == [11]  # its node's first, whatever the slot
    chosen = policy.choose_spares(ready, [(2, 0)], set(), set())
    assert [w.wid for w in chosen] == [10]  # none on its node: any, in order
    assert policy.choose_spares(ready[:1], [(0, 0), (0, 1)], set(), set()) is None


def test_on_one_machine_the_spares_go_in_order():
    ready = [spare(4, 0, 4), spare(5, 0, 5), spare(6, 0, 4)]
    assert [w.wid for w in policy.choose_spares(ready, [(0, 1), (0, 3)], set(), set())] == [4, 5]


def test_a_lost_node_moves_whole_to_a_spare_node_slot_by_slot():
    # node 1 lost (ranks in slots 0, 1); node 2 has one ready spare, node 3 covers both slots
    ready = [spare(20, 0, 2), spare(30, 2, 1), spare(41, 3, 1), spare(40, 3, 0)]
    chosen = policy.choose_spares(ready, [(1, 0), (1, 1)], {1}, {2, 3})
    assert [(w.node, w.slot) for w in chosen] == [(3, 0), (3, 1)]
    # no spare node covers the slots: each rank goes to any ready spare
    chosen = policy.choose_spares(ready[:2], [(1, 0), (1, 1)], {1}, {2, 3})
    assert [w.wid for w in chosen] == [20, 30]
    assert policy.choose_spares(ready[:1], [(1, 0), (1, 1)], {1}, {2, 3}) is None


def test_every_timer_is_due_once_per_period():
    t = policy.Every(0.5)
    assert t.due(10.0) and not t.due(10.2) and t.due(10.5)


# ---- one configuration -------------------------------------------------------------------------
def test_supervisor_config_from_settings_and_the_spec_it_gives_workers():
    c = SupervisorConfig.of({"spares": 2, "confirm_s": 7.0, "unrelated": 1}, nproc=4, nodes=2,
                            backend="nccl")
    assert (c.nproc, c.spares, c.confirm_s, c.refill) == (4, 2, 7.0, protocol.DEFAULTS.refill)
    spec = protocol.Spec.from_json(c.spec().to_json())
    assert (spec.backend, spec.confirm_s, spec.workers_per_node, spec.ranks_per_node) == (
        "nccl", 7.0, 4, 2)
    assert spec.replication == protocol.default_replication() == {
        "factor": 2, "interval": 1, "offset": 1}


# ---- node agents push exit notices -------------------------------------------------------------
class CountingStore:
    """A store client that counts the operations made through it."""

    def __init__(self, store):
        self.store, self.ops = store, 0

    def __getattr__(self, name):
        fn = getattr(self.store, name)

        def call(*a, **k):
            self.ops += 1
            return fn(*a, **k)
        return call


class FakeProc:
    """A child process of an agent, as far as it looks (no process is started)."""

    def __init__(self, pid):
        self.pid, self.returncode = pid, None

    def poll(self):
        return self.returncode


def cluster(per_node: int, remote_nodes: int = 2):
    """A coordinator's pool over node 0 (local, no workers here) and `remote_nodes` agents,
    each with `per_node` children; all in this process on one real TCPStore."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=10))
    pool = ClusterPool(["true"], {}, "127.0.0.1", 0, nodes=1 + remote_nodes, spare_nodes=0,
                       per_node=per_node, spares_per_node=0, node_timeout_s=0.2,
                       log=lambda m: None)
    coordinator = CountingStore(master)
    pool.store = coordinator
    agents = {}
    for node in range(1, 1 + remote_nodes):
        client = CountingStore(dist.TCPStore("127.0.0.1", master.port, is_master=False,
                                             timeout=timedelta(seconds=10)))
        agent = NodeAgent(client, node, ["true"], {}, "127.0.0.1", master.port, 0.2)
        for slot in range(per_node):
            wid = pool.next_wid
            pool.next_wid += 1
            pool.workers[wid] = Worker(wid=wid, proc=RemoteProc(pool, node, wid), slot=slot,
                                       started=0.0, node=node, rank=wid)
            # a pid past the kernel's largest: /proc has no such process
            agent.workers[wid] = Worker(wid=wid, proc=FakeProc(2 ** 22 + wid), slot=slot,
                                        started=0.0, node=node)
            agent.node_store.set(protocol.heartbeat_key(wid), json.dumps(
                {"t": time.time(), "step": 7, "gen": 0, "phase": "step"}))
        agent.hello(per_node)
        agents[node] = agent
    return master, pool, coordinator, agents


@pytest.mark.parametrize("per_node", [2, 16])
def test_agents_report_by_node_and_the_coordinator_reads_by_node(per_node):
    master, pool, coordinator, agents = cluster(per_node)
    for agent in agents.values():  # one health record: one call writes it and reads the state
        agent.store.ops = 0
        assert agent.health(news=bool(agent.new_exits())) == RUN
        assert agent.store.ops == 1
    coordinator.ops = 0
    for _ in range(10):  # ten wake-ups of the supervisor's loop, nothing new
        pool.refresh()
        assert all(w.alive() for w in pool.workers.values())
    assert coordinator.ops <= 10 + 1  # the event counter, and every record once, in one call
    pool.refresh(force=True)
    beats = pool.beats(list(pool.workers))
    assert {b["step"] for b in beats.values()} == {7} and len(beats) == 2 * per_node

    victim = next(w for w in pool.workers.values() if w.node == 2)
    agents[2].workers[victim.wid].proc.returncode = -9
    agents[2].store.ops = 0
    news = agents[2].new_exits()
    assert news == {victim.wid: -9} and agents[2].new_exits() == {}  # an exit is news once
    agents[2].health(news=True)
    assert agents[2].store.ops == 2  # the record (its write answers the node's state), the counter
    coordinator.ops = 0
    pool.refresh()  # the counter moved: every record is read at once
    assert coordinator.ops == 2
    assert victim.proc.poll() == -9 and victim.proc.wait(timeout=1) == -9
    assert [w.wid for w in pool.workers.values() if not w.alive()] == [victim.wid]
    record = json.loads(master.get(protocol.node_health_key(2)))
    assert record["exited"] == {str(victim.wid): -9} and str(victim.wid) not in record["beats"]


def test_a_silent_node_is_fenced_and_its_workers_fail_together():
    master, pool, coordinator, agents = cluster(2)
    pool.refresh(force=True)
    now = time.time()
    for n in pool.nodes.values():
        n.beat_seen_at = now
    assert pool.fence_silent_nodes() == []  # both reported
    time.sleep(0.25)
    agents[1].health(news=False)  # node 1 reports on, node 2 is silent
    pool.refresh(force=True)
    assert pool.fence_silent_nodes() == [2]
    assert pool.lost_node_ids() == {2}
    lost = [w for w in pool.workers.values() if w.node == 2]
    assert all(w.node_lost and w.proc.poll() == -9 for w in lost)
    assert agents[2].health(news=False).kind is Word.FENCED  # it learns so when it returns
    assert all(w.alive() for w in pool.workers.values() if w.node == 1)


def test_a_node_whose_record_stopped_is_unheard_so_its_workers_wait_for_the_node_verdict():
    """Losses.hung judges only heard nodes' workers: a dead node's frozen beats, behind a job
    stalled on it, once made its workers 'hung' before the node's silence was noticed."""
    from checkpointless.control.agent import record_interval_s
    from checkpointless.control.processes import WorkerPool
    master, pool, coordinator, agents = cluster(1)
    pool.refresh(force=True)
    now = time.time()
    for n in pool.nodes.values():
        n.beat_seen_at = now
    assert not pool.unheard(0) and not pool.unheard(1) and not pool.unheard(2)
    pool.nodes[2].beat_seen_at = now - 2 * record_interval_s(0.2) - 0.05  # two writes missed
    assert pool.unheard(2) and not pool.unheard(1)
    assert not pool.unheard(0)  # the coordinator's own node: its workers are read here
    assert WorkerPool.unheard(5) is False
