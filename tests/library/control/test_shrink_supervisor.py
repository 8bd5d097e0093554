"""The supervisor's side of a shrink and a grow (checkpointless.shrink, issue 40), in one process:
a real TCPStore, the real Supervisor, stand-in processes (nothing is trained). With no spare
ready, a lost process's logical ranks move to the survivors, which are numbered anew in a plan of
fewer processes; a spare that warms up later joins as a new process and takes one back; what is
not covered by the ready spares shrinks; a limit on the ranks a process may host stops the run
with its key; the report counts the processes there are, the shrinks and grows, and the capacity
lost while shrunk; a takeover keeps the placement; stragglers are not judged while shrunk."""
import json
import time

import pytest

from checkpointless import protocol
from checkpointless.control.facts import NoFacts
from checkpointless.control.ledger import Ledger
from checkpointless.protocol.placement import Placement
from checkpointless.control.report import Failure, new_recoveries, recovery_entry, \
    shrunk_capacity_lost
from checkpointless.control.stragglers import Stragglers
from checkpointless.control.supervisor import JobFailed, SupervisorConfig, placement_of
from checkpointless.control.takeover import _plan_of
from checkpointless.protocol import membership
from checkpointless.protocol.records import Entered
from tests.support.fakes_supervisor import at_generation_zero


class Facts(NoFacts):
    durable = True

    def __init__(self):
        self.taking = {"node": 0, "token": 2, "t_taken": time.time()}
        self.plans, self.records = {}, {}

    def record_plan(self, plan, lost, next_wid):
        self.plans[plan.gen] = plan

    def record(self, name, value):
        self.records[name] = value
        return True


def shrinkable(nproc=4, spares=1, ready_spares=(), shrink="exact", max_hosted=0, facts=None):
    """Generation 0 of a supervisor with checkpointless.shrink on: ranks 0..nproc-1 held by
    workers of those ids, spares after them, only `ready_spares` warm."""
    cfg = SupervisorConfig(nproc=nproc, spares=spares, refill=False, heartbeat_timeout_s=0.5,
                           shrink=shrink, shrink_max_hosted=max_hosted)
    return at_generation_zero(cfg, ready_spares, facts)


def lose(sup, *wids):
    for wid in wids:
        sup.workers[wid].proc.returncode = -9
    sup.replacer.handle([(w, False) for w in sup.losses.exited()])


def grow(sup, store) -> None:
    """A grow as a running job meets it: the supervisor's notice (every worker of the
    generation stops before the step after next), then the job at that step, where the plan
    comes. Nothing is published before the job is there."""
    gen = sup.gen
    sup.grower.grow_if_ready()
    if sup.grow_at is None:
        return
    _, before = sup.grow_at
    notice = json.loads(store.get(protocol.notice_key(sup.notices.count - 1)))
    assert notice == {"kind": "regroup", "gen": gen, "before_step": before}
    store.set(protocol.LAST_STEP, str(before - 2))  # the step before: still on its way
    sup.grower.grow_if_ready()
    assert sup.gen == gen and sup.grow_at == (gen, before)
    store.set(protocol.LAST_STEP, str(before - 1))  # every worker stops there
    sup.grower.grow_if_ready()
    assert sup.grow_at is None


def seat(store, wid, rank, after):
    return membership.follow(store, wid, 0, rank, after, membership.current_gen(store))


def test_no_spare_ready_the_lost_logical_rank_moves_to_a_survivor_in_a_plan_of_fewer():
    sup, store = shrinkable()
    lose(sup, 1)
    head = json.loads(store.get(protocol.plan_key(1)))
    assert (head["world_size"], head["logical_world"]) == (3, 4)
    assert sup.ranks == {0: 0, 2: 1, 3: 2} and sup.workers[2].rank == 1
    assert sup.placement.hosts == ((0, 1), (2,), (3,))
    assert sup.state.plan.hosts == {0: [0, 1], 2: [2], 3: [3]}
    # what each survivor reads of generation 1, as it would
    s0, s2 = seat(store, 0, 0, 0), seat(store, 2, 2, 0)
    assert (s0.rank, s0.world_size, s0.logical_ranks, s0.logical_size) == (0, 3, (0, 1), 4)
    assert (s2.rank, s2.logical_ranks, s2.logical_size) == (1, (2,), 4)
    assert seat(store, 1, 1, 0) is None and seat(store, 4, -1, 0) is None
    f, = sup.failures
    assert (f.gen, f.shrunk, f.new_wid, f.moved) == (1, True, 0, {1: 0})
    assert ("[checkpointless] no spare ready: logical rank 1 moves to process 0 (worker 0); "
            "3 processes host 4 logical ranks (checkpointless.shrink=exact)") in sup.said
    assert sup.resizes == [{"kind": "shrink", "step": 0, "from_processes": 4,
                            "to_processes": 3, "logical_ranks_moved": [1]}]
    assert sup.stragglers.paused


def test_a_spare_that_warms_up_grows_the_job_back_and_hosts_stay_published():
    sup, store = shrinkable()
    lose(sup, 1)
    sup.grower.grow_if_ready()
    assert sup.gen == 1  # no spare ready yet: nothing changes
    store.set(protocol.ready_key(4), "1")
    grow(sup, store)
    assert sup.gen == 2 and sup.ranks == {0: 0, 2: 1, 3: 2, 4: 3}
    assert sup.workers[4].took_over_gen == 2 and sup.workers[4].rank == 3
    # one logical rank a process, but not each its own: workers still need their hosts
    assert sup.placement.hosts == ((0,), (2,), (3,), (1,))
    assert sup.state.plan.hosts == {0: [0], 2: [2], 3: [3], 4: [1]}
    s4 = seat(store, 4, -1, 1)
    assert (s4.rank, s4.world_size, s4.logical_ranks) == (3, 4, (1,))
    assert seat(store, 0, 0, 1).logical_ranks == (0,)
    assert ("[checkpointless] spare ready: logical rank 1 moves to process 3 (spare worker 4); "
            "4 processes host 4 logical ranks (checkpointless.shrink=exact)") in sup.said
    assert not sup.stragglers.paused
    sup.grower.grow_if_ready()
    assert sup.gen == 2  # nothing left to grow
    report = sup.record.report()
    assert report["shrink"] == {"mode": "exact"} and report["processes_at_end"] == 4
    assert report["shrinks"] == [{"step": 0, "from_processes": 4, "to_processes": 3,
                                  "logical_ranks_moved": [1]}]
    assert report["grows"] == [{"step": 2, "from_processes": 3, "to_processes": 4,
                                "logical_ranks_moved": [1]}]  # at the boundary announced
    assert report["failures"][0]["shrunk"] is True


def test_no_grow_once_the_job_is_ending():
    sup, store = shrinkable(ready_spares=(4,), spares=2)
    lose(sup, 1)  # spare 4 takes rank 1
    lose(sup, 2)  # none ready: a shrink
    assert sup.placement.processes == 3
    store.set(protocol.ready_key(5), "1")
    store.set(protocol.result_key(0), "{}")
    sup.grower.grow_if_ready()
    assert sup.gen == 2
    store.delete_key(protocol.result_key(0))
    grow(sup, store)
    assert sup.gen == 3 and sup.placement.processes == 4


def test_the_ready_spares_take_what_they_cover_and_the_rest_shrinks():
    sup, store = shrinkable(nproc=4, spares=2, ready_spares=(4,), shrink="fast")
    lose(sup, 1, 2)
    assert sup.gen == 1 and sup.ranks == {0: 0, 4: 1, 3: 2}
    assert sup.placement.hosts == ((0, 2), (1,), (3,))
    f1, f2 = sup.failures
    assert (f1.new_wid, f1.shrunk, f2.new_wid, f2.shrunk) == (4, False, 0, True)
    assert sup.workers[4].took_over_gen == 1
    assert seat(store, 4, -1, 0).logical_ranks == (1,)
    assert sup.record.report()["shrink"]["bits"].startswith("may differ")


def test_with_shrink_off_the_plan_is_todays():
    sup, store = shrinkable(shrink="off", ready_spares=(4,))
    lose(sup, 1)
    head = json.loads(store.get(protocol.plan_key(1)))
    assert (head["world_size"], head["logical_world"]) == (4, 0)
    assert "hosted" not in json.loads(store.get(protocol.plan_node_key(1, 0)))
    assert sup.ranks == {0: 0, 4: 1, 2: 2, 3: 3} and "shrinks" not in sup.record.report()


def test_a_shrink_over_the_hosting_limit_waits_for_a_spare_saying_why():
    """On a device the limit comes from the memory plan (under fsdp a shrunk step gathers the
    whole model): a shrink over it would run out of memory, so the lost rank waits for a spare,
    as with shrink=off, and the run stops only when none comes."""
    sup, store = shrinkable(max_hosted=1)
    sup.cfg.spare_wait_s = 0.3
    with pytest.raises(JobFailed):
        lose(sup, 1)
    said = "\n".join(sup.said)
    assert "no shrink (" in said and "checkpointless.shrink_max_hosted=1" in said, said
    assert "waiting up to" in said and not sup.resizes


def test_a_recovery_by_shrink_counts_the_members_its_generation_had():
    sup, store = shrinkable()
    lose(sup, 1)
    for rank, wid in enumerate((0, 2, 3)):  # the 3 members of generation 1 enter and commit
        store.set(protocol.entered_key(1, rank), Entered(
            worker_id=wid, resumed_step=5, t_plan=1.0, t_group=1.1, t_ready=1.2).to_json())
        store.set(protocol.first_commit_key(1, rank), "1.5")
    f, = sup.failures
    e = recovery_entry(store, f, 4, sup.gen)
    assert e["shrunk"] and e["logical_ranks_moved"] == {"1": 0} and e["resumed_step"] == 5
    line, = new_recoveries(store, sup.failures, set(), 4, sup.gen)
    assert line.startswith("[checkpointless] recovered rank 1 (exit) by a shrink (logical "
                           "rank 1 on worker 0): 0.0 MB moved, resumed at step 5, ")
    for r in range(3):
        store.set(protocol.result_key(r), json.dumps({"r": r}))
    assert membership.results_in(store, sup.placement.processes)
    assert sorted(sup.record.report()["results_by_rank"]) == [0, 1, 2]


def test_capacity_lost_while_shrunk_counts_the_missing_processes_share():
    steps = {s: (float(s), s + 1.0) for s in range(10)}
    resizes = [{"kind": "shrink", "step": 2, "to_processes": 3},
               {"kind": "grow", "step": 6, "to_processes": 4}]
    assert shrunk_capacity_lost(steps, resizes, 4) == 1.0  # steps 2..5: 4 x 1 s x 1/4
    assert shrunk_capacity_lost(steps, [], 4) == 0.0


def test_a_takeover_keeps_the_placement_and_the_resizes():
    facts = Facts()
    sup, store = shrinkable(facts=facts)
    lose(sup, 1)
    plan = facts.plans[1]
    # as etcd keeps it (ha/etcd_facts.py record_plan), then as a takeover reads it back
    kept = json.loads(json.dumps({"ranks": {str(w): r for w, r in plan.ranks.items()},
                                  "nodes": {str(w): 0 for w in plan.ranks},
                                  "world_size": plan.world_size,
                                  "hosts": {str(w): h for w, h in plan.hosts.items()},
                                  "logical_world": plan.logical_world}))
    again = _plan_of(1, kept, 1)
    assert (again.hosts, again.logical_world, again.world_size) == (plan.hosts, 4, 3)
    assert placement_of(again, 4).hosts == ((0, 1), (2,), (3,))
    assert placement_of(_plan_of(0, {"ranks": {"0": 0, "1": 1}, "nodes": {},
                                     "world_size": 2}, 0), 2) == Placement.identity(2)
    ledger = Ledger(facts)
    ledger.resume(store, {k: v for k, v in facts.records.items() if k.startswith("resize/")})
    assert ledger.earlier_resizes == sup.resizes


def test_stragglers_are_not_judged_while_shrunk():
    sup, _ = shrinkable()
    s = Stragglers(sup.cfg)
    s.placement_changed(True)
    s.note({0: {"pace": [[1, 100.0]]}})
    assert s.paces == {} and s.judge({}, 1, 0) == ([], [])
    s.placement_changed(False)
    s.note({0: {"pace": [[1, 100.0]]}})
    assert s.paces == {0: {1: 100.0}}


def test_a_shrunk_failure_is_on_the_ledgers_record():
    from checkpointless.control.report import failure_of
    f = Failure(wid=1, rank=1, cause="exit", t_fail=1.0, t_detect=1.0, step=3, shrunk=True)
    assert failure_of(f)["shrunk"] is True


def test_a_process_lost_while_shrunk_takes_every_rank_it_hosted_along():
    sup, store = shrinkable()
    lose(sup, 1)
    lose(sup, 0)  # it hosted logical ranks 0 and 1
    assert any("rank 0 lost (exit, worker 0" in line and
               line.endswith("; it hosted logical ranks [0, 1]") for line in sup.said)
    assert sup.placement.hosts == ((0, 2), (1, 3)) and sup.ranks == {2: 0, 3: 1}
    assert sup.failures[1].moved == {0: 2, 1: 3}
    assert [e["to_processes"] for e in sup.resizes] == [3, 2]
    assert seat(store, 3, 2, 1).logical_ranks == (1, 3)
    assert sup.figures(store).processes == 2


def test_an_announced_grow_is_published_at_its_step_even_with_no_spare_left():
    """The workers stop at the announced step and wait for a plan: if the spare is gone by
    then, a plan with the same processes comes all the same; a failure's plan before the step
    cancels the announcement (its generation gets a notice of its own)."""
    sup, store = shrinkable()
    lose(sup, 1)
    store.set(protocol.ready_key(4), "1")
    sup.grower.grow_if_ready()
    gen, before = sup.grow_at
    store.delete_key(protocol.ready_key(4))
    store.set(protocol.LAST_STEP, str(before - 1))
    sup.grower.grow_if_ready()
    assert sup.gen == gen + 1 and sup.placement.processes == 3 and sup.grow_at is None
    assert "no longer ready" in " ".join(sup.said)
    store.set(protocol.ready_key(4), "1")
    sup.grower.grow_if_ready()
    assert sup.grow_at == (sup.gen, int(store.get(protocol.LAST_STEP)) + 3)
    lose(sup, 2)  # a failure first: its plan, and the grow forgotten for its generation
    sup.grower.grow_if_ready()
    assert sup.grow_at is None


def test_an_announced_grow_is_dropped_once_the_job_ended_before_its_step():
    """Announced for a step the job never reached (it ended first; a takeover publishes an
    announced grow at once): no plan for processes that are gone."""
    sup, store = shrinkable()
    lose(sup, 1)
    store.set(protocol.ready_key(4), "1")
    sup.grower.grow_if_ready()
    gen = sup.gen
    sup.grower.grow_at = (gen, 0)  # as a takeover sets it
    store.set(protocol.result_key(0), "{}")
    sup.grower.grow_if_ready()
    assert sup.grow_at is None and sup.gen == gen and sup.placement.processes == 3
