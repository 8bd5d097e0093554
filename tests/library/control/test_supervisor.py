"""The supervisor's side of a recovery, in one process: a real TCPStore, the real Supervisor with
its loss finder and replacer, and stand-in processes (no worker is started, nothing is
trained). A worker that exits is a loss of cause exit and a silent one behind a stalled job is
hung; a lost rank goes to the first ready spare in a new generation of the same world size, as
read back from the store the way a worker reads it; and a coordinator taking over from etcd's
facts (take_over, Supervisor.resume) republishes the newest plan, goes on with its ranks, gives
figures() for Prometheus, and fences the node that never said hello, whose ranks then move
together to the spare node."""
import json
import time
from datetime import timedelta
from types import SimpleNamespace as NS

import torch.distributed as dist

from checkpointless import protocol
from checkpointless.control.agent import NodeAgent
from checkpointless.control.cluster import ClusterPool
from checkpointless.control.facts import Known, NoFacts
from checkpointless.control.processes import Worker
from checkpointless.control.prometheus import Snapshot
from checkpointless.control.supervisor import Supervisor, SupervisorConfig
from checkpointless.control.takeover import adopt, take_over
from checkpointless.protocol import membership
from checkpointless.control.report import goodput_from_steps
from checkpointless.protocol.records import Entered, NodeWord, Word
from tests.support.fakes_supervisor import FakeProc, at_generation_zero, beat, new_store

TIMEOUT_S = 0.5  # heartbeat_timeout_s and node_timeout_s: short, so each test takes a second


class Facts(NoFacts):
    """What a JobFacts would write to etcd, kept here (a takeover's figures in `taking`)."""
    durable = True

    def __init__(self):
        self.taking = {"node": 0, "token": 2, "t_taken": time.time()}
        self.plans, self.fences, self.moves, self.records = {}, [], [], {}

    def record_plan(self, plan, lost, next_wid):
        self.plans[plan.gen] = {"ranks": dict(plan.ranks), "lost": lost, "next_wid": next_wid}

    def record_fence(self, node, why):
        self.fences.append((node, why))

    def record_move(self, move):
        self.moves.append(move)

    def record(self, name, value):
        self.records[name] = value
        return True


def one_machine(nproc=2, spares=2, ready_spares=(3,), facts=None):
    """A supervisor on one machine, in generation 0: ranks 0..nproc-1 held by workers of the
    same ids, spares after them (only `ready_spares` warmed up)."""
    cfg = SupervisorConfig(nproc=nproc, spares=spares, refill=False,
                           heartbeat_timeout_s=TIMEOUT_S)
    return at_generation_zero(cfg, ready_spares, facts)


def part(store, gen: int, node: int) -> dict:
    return json.loads(store.get(protocol.plan_node_key(gen, node)))


# ---- losses ----------------------------------------------------------------------------------
def test_a_worker_that_exits_is_a_loss_of_cause_exit():
    sup, store = one_machine()
    assert sup.losses.exited() == []
    sup.workers[1].proc.returncode = -9
    lost = sup.losses.exited()
    assert [w.wid for w in lost] == [1]
    f = sup.replacer.record_failure(lost[0], False, time.time())
    assert (f.cause, f.wid, f.rank, f.error) == ("exit", 1, 1, None)
    assert sup.ranks == {0: 0} and sup.workers[1].rank == -2
    assert any("rank 1 lost (exit, worker 1" in line for line in sup.said)


def test_a_worker_that_exits_after_its_done_is_no_loss():
    sup, store = one_machine()
    sup.workers[0].proc.returncode = 0
    store.set(protocol.done_key(0), "1")
    assert sup.losses.exited() == []


def test_a_worker_silent_past_the_timeout_and_behind_a_stalled_job_is_hung():
    sup, store = one_machine()
    now = time.time()
    beat(store, 0, 5, now)
    beat(store, 1, 4, now)
    assert sup.losses.hung() == []  # one step behind, but beating
    beat(store, 0, 5, now - 2 * TIMEOUT_S)
    beat(store, 1, 4, now - 2 * TIMEOUT_S)
    hung = sup.losses.hung()
    assert [(w.wid, was_hung) for w, was_hung in hung] == [(1, True)]
    f = sup.replacer.record_failure(hung[0][0], True, time.time())
    assert (f.cause, f.rank, f.step) == ("hang", 1, 5)  # the job's step, not its own


# ---- replacement -----------------------------------------------------------------------------
def test_a_lost_rank_goes_to_the_first_ready_spare_in_a_plan_of_the_same_world_size():
    sup, store = one_machine(ready_spares=(3,))  # spare 2 is still warming up
    sup.workers[1].proc.returncode = -9
    sup.replacer.handle([(w, False) for w in sup.losses.exited()])

    assert membership.current_gen(store) == 1
    head = json.loads(store.get(protocol.plan_key(1)))
    assert (head["gen"], head["world_size"], head["lost"]) == (1, 2, 1)
    assert part(store, 1, 0) == dict(head, joined={"3": 1}, left=[1], members=2)
    assert int(store.add(protocol.LOST, 0)) == 1
    # what each worker reads of generation 1, as it would
    seat = membership.follow(store, 3, 0, -1, 0, 1)
    assert (seat.rank, seat.world_size, seat.members_here) == (1, 2, 2)
    assert membership.follow(store, 0, 0, 0, 0, 1).rank == 0
    assert membership.follow(store, 1, 0, 1, 0, 1) is None  # the lost one holds no rank
    assert membership.follow(store, 2, 0, -1, 0, 1) is None  # the spare not ready: none
    assert store.get(protocol.barrier_done_key(0)) == b"stale"  # gen 0's waiters stop waiting

    assert sup.ranks == {0: 0, 3: 1} and sup.gen == 1
    assert (sup.workers[3].rank, sup.workers[3].took_over_gen) == (1, 1)
    f, = sup.failures
    assert (f.cause, f.gen, f.new_wid) == ("exit", 1, 3)


# ---- a takeover ------------------------------------------------------------------------------
KNOWN_PLANS = {  # as etcd keeps them (ha/etcd_facts.py): worker 1 of node 0 was replaced by 4
    2: {"world_size": 4, "ranks": {"0": 0, "1": 1, "2": 2, "3": 3},
        "nodes": {"0": 0, "1": 0, "2": 1, "3": 1}},
    3: {"world_size": 4, "ranks": {"0": 0, "4": 1, "2": 2, "3": 3},
        "nodes": {"0": 0, "4": 0, "2": 1, "3": 1}},
}


def taken_over(record=None):
    """A stand-alone coordinator (every node has an agent) taking over at generation 3: node
    0 (ranks 0, 1) and spare node 2 (two warm spares) say hello to its new store; node 1 (ranks
    2, 3) never does."""
    cfg = SupervisorConfig(nproc=4, nodes=2, spare_nodes=1, spares=0, standalone=True,
                           refill=False, node_timeout_s=TIMEOUT_S)
    facts, said = Facts(), []
    sup = Supervisor(["true"], cfg, env={}, log=said.append, facts=facts)
    assert isinstance(sup.pool, ClusterPool)
    store = new_store()
    lost_at = time.time() - 1.0  # when the first agent saw the old coordinator gone
    agents = {}
    for node, workers in {0: {0: (0, False), 4: (1, False), 1: (1, False)},
                          2: {5: (0, True), 6: (1, True)}}.items():
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                               timeout=timedelta(seconds=10))
        agent = NodeAgent(client, node, ["true"], {}, "127.0.0.1", store.port, TIMEOUT_S,
                          log=said.append)
        agent.role_watch = NS(coordinator_lost_at=lost_at + node)
        for wid, (slot, spare) in workers.items():
            agent.workers[wid] = Worker(wid=wid, proc=FakeProc(wid), slot=slot, started=0.0,
                                        node=node)
            if spare:
                agent.spare_wids.add(wid)
                agent.node_store.set(protocol.ready_key(wid), "1")
            else:
                beat(agent.node_store, wid, 7, time.time())
        if node == 0:
            agent.workers[1].proc.returncode = -9  # the worker that generation 3 replaced
        agent.new_exits()
        agent.hello(len(workers))
        agents[node] = agent
    known = Known(spec=cfg.spec().to_json(), gen=3, plans=KNOWN_PLANS, lost=1, next_wid=9,
                  notices=2, moves=[{"node": 1, "token": 1, "start": True}],
                  record=record or {})
    t = take_over(store, sup.pool, facts, known, said.append)
    sup.store = store
    sup.resume(t)
    return sup, store, facts, agents, lost_at


def test_a_takeover_republishes_the_known_plan_and_resumes_from_it():
    sup, store, facts, agents, lost_at = taken_over()
    assert membership.current_gen(store) == 3
    head = json.loads(store.get(protocol.plan_key(3)))
    assert (head["world_size"], head["lost"], head["nodes"]) == (4, 1, 2)
    ranks = {int(w): r for w, r in KNOWN_PLANS[2]["ranks"].items()}  # gen 3 replayed on gen 2
    for node in (0, 1):
        p = part(store, 3, node)
        for wid in p["left"]:
            del ranks[wid]
        ranks.update({int(w): r for w, r in p["joined"].items()})
    assert ranks == {0: 0, 4: 1, 2: 2, 3: 3}
    assert (part(store, 3, 0)["members"], part(store, 3, 1)["members"]) == (2, 2)
    assert int(store.add(protocol.LOST, 0)) == 1

    assert (sup.gen, sup.ranks, sup.notices.count) == (3, {0: 0, 4: 1, 2: 2, 3: 3}, 2)
    assert sup.pool.next_wid == 9
    move = sup.moves[-1]
    assert len(sup.moves) == 2 and facts.moves == [move]
    assert (move["gen"], move["nodes_heard"], move["from_node"]) == (3, [0, 2], 1)
    assert move["t_lost"] == lost_at  # the earliest an agent saw
    assert {w.wid: (w.node, w.rank) for w in sup.workers.values()} == {
        0: (0, 0), 4: (0, 1), 1: (0, -1), 2: (1, 2), 3: (1, 3), 5: (2, -1), 6: (2, -1)}
    assert not sup.workers[1].alive()  # its exit, as node 0's hello said
    assert all(store.check([protocol.ready_key(w)]) for w in (0, 2, 3, 4, 5, 6))
    assert not store.check([protocol.ready_key(1)])

    snap = sup.figures(store)
    assert isinstance(snap, Snapshot)
    assert (snap.gen, snap.world_size, snap.nproc, snap.spares_ready) == (3, 4, 4, 2)
    assert (snap.nodes_alive, snap.nodes_lost, snap.failures) == (3, 0, [])


def test_the_node_that_never_said_hello_is_fenced_and_its_ranks_move_to_the_spare_node():
    sup, store, facts, agents, lost_at = taken_over()
    t0, lost = time.time(), []
    while not lost and time.time() < t0 + 8 * TIMEOUT_S:  # the watch loop's order of looks
        for agent in agents.values():  # the nodes that answered go on reporting
            assert agent.health(news=False).kind is Word.RUN
        lost = sup.losses.exited() + [w for w, _ in sup.losses.silent_nodes([])]
        time.sleep(0.02)
    assert sorted(w.wid for w in lost) == [2, 3]
    assert all(w.node_lost and w.proc.poll() == -9 for w in lost)
    assert sup.pool.lost_node_ids() == {1}
    word = NodeWord.parse(store.get(protocol.node_health_key(1)).decode())
    assert word.kind is Word.FENCED and word.why.startswith("silent for")
    assert facts.fences == [(1, str(word))]

    sup.replacer.handle([(w, False) for w in lost])
    assert membership.current_gen(store) == 4
    head = json.loads(store.get(protocol.plan_key(4)))
    assert (head["world_size"], head["lost"]) == (4, 3)
    assert part(store, 4, 1) == dict(head, joined={}, left=[2, 3], members=0)
    assert part(store, 4, 2) == dict(head, joined={"5": 2, "6": 3}, members=2, left=[])
    assert sup.ranks == {0: 0, 4: 1, 5: 2, 6: 3}
    assert facts.plans[4] == {"ranks": sup.ranks, "lost": 3, "next_wid": 9}
    assert sorted((f.cause, f.rank, f.new_wid, f.new_node) for f in sup.failures) == [
        ("node_lost", 2, 5, 2), ("node_lost", 3, 6, 2)]

    snap = sup.figures(store)
    assert (snap.gen, snap.world_size, snap.spares_ready) == (4, 4, 0)
    assert (snap.nodes_alive, snap.nodes_lost, len(snap.failures)) == (2, 1, 2)


# ---- two takeover bugs this file found, fixed ---------------------------------------------------
def test_the_node_that_never_said_hello_is_lost_at_the_first_look_dated_when_it_was_last_heard():
    sup, store, facts, agents, lost_at = taken_over()
    lost = sup.losses.exited() + [w for w, _ in sup.losses.silent_nodes([])]
    assert sorted(w.wid for w in lost) == [2, 3]
    assert all(w.lost_at == lost_at for w in lost)


def test_a_node_fenced_before_a_takeover_still_finds_its_fence_in_the_new_store():
    pool = ClusterPool(["true"], {}, "127.0.0.1", 0, nodes=1, spare_nodes=1, per_node=1,
                       spares_per_node=0, node_timeout_s=0.1, local=False, log=lambda m: None)
    store = new_store()
    known = Known(gen=0, plans={0: {"world_size": 1, "ranks": {"0": 0}, "nodes": {"0": 0}}},
                  fenced={1: "fenced: slow"})
    adopt(pool, store, known.plans[0], known)
    assert pool.nodes[1].lost
    assert store.get(protocol.node_health_key(1)) == b"fenced: slow"


# ---- the run's record across a takeover ----------------------------------------------------------
def steps_done(store, steps, t0: float) -> None:
    """Rank 0's step records: step s ran from t0 + s to t0 + s + 0.9."""
    for s in steps:
        store.set(protocol.step_key(s), f"{t0 + s:.6f},{t0 + s + 0.9:.6f}")


def test_a_takeover_keeps_the_runs_record_from_the_launch():
    """The first coordinator ran steps 0..79, lost rank 1 at step 40 and recovered it; its
    store is then lost. The one taking over reports steps, goodput, failures and recoveries from
    the launch: what the first copied into the job's facts (ledger.py), and its own on top."""
    t0 = time.time() - 200
    facts = Facts()
    first, store = one_machine(facts=facts)
    store.set(protocol.FIRST_STEP, "0")
    steps_done(store, range(80), t0)
    first.workers[1].proc.returncode = -9
    first.replacer.handle([(w, False) for w in first.losses.exited()])
    for rank, wid in ((0, 0), (1, 3)):  # both members entered generation 1 and went on
        store.set(protocol.entered_key(1, rank), Entered(
            worker_id=wid, resumed_step=40, t_plan=t0 + 40.1, t_group=t0 + 40.2,
            t_ready=t0 + 40.3, bytes_received=1000 * (rank == 1)).to_json())
        store.set(protocol.first_commit_key(1, rank), f"{t0 + 41:.6f}")
    first.record.say_recoveries()
    slow = {"rank": 0, "worker": 0, "from_step": 60, "until_step": 62, "action": "evicted"}
    first.stragglers.entries.append(slow)
    first.ledger.tick(store, first.failures, first.record.reported, 2, first.gen, force=True,
                      stragglers=first.stragglers.entries)
    had = first.record.report()
    assert had["steps_completed"] == 80 and len(had["recoveries"]) == 1
    assert set(facts.records) == {"steps/0", "steps/1", "failure/1", "recovery/1",  # 64 a chunk
                                  "stragglers/2"}

    sup, store2, _, _, _ = taken_over(record=dict(facts.records))
    # the new store's step records start after the known ones (not at 0, which it lacks)
    assert int(store2.get(protocol.FIRST_STEP)) == 80
    steps_done(store2, range(80, 120), t0)
    rep = sup.record.report()
    assert rep["steps_completed"] == 120
    assert rep["step_times"] == {s: (round(t0 + s, 6), round(t0 + s + 0.9, 6))
                                 for s in range(120)}
    assert rep["goodput"] == goodput_from_steps(rep["step_times"]) == round(108 / 119.9, 4)
    assert rep["recoveries"] == json.loads(json.dumps(had["recoveries"]))
    assert rep["recoveries"][0]["failed_rank"] == 1
    assert rep["stragglers"] == [slow]
    assert rep["failures"] == had["failures"] == [
        {"rank": 1, "worker": 1, "cause": "exit", "step": had["failures"][0]["step"],
         "error": None}]


def test_a_preemption_asked_before_a_takeover_still_stops_the_job_there():
    """The notices go to the job's facts before the store; the coordinator taking over publishes
    them again (a rank joining under it reads them all) and ends the job as preempted."""
    facts = Facts()
    first, store = one_machine(facts=facts)
    first.request_stop("SIGTERM on node 1")
    first.stops.preempt_if_asked()
    stop = first.preempted_at
    assert json.loads(facts.records["notice/0"]) == {
        "kind": "preempt", "before_step": stop, "why": "SIGTERM on node 1"}

    sup, store2, _, _, _ = taken_over(record=dict(facts.records))
    assert json.loads(store2.get(protocol.notice_key(0))) == json.loads(facts.records["notice/0"])
    assert (sup.preempted_at, sup.stop_asked) == (stop, "SIGTERM on node 1")
