"""A spare node's spares across a coordinator takeover (coordinator=etcd), in one process: a real
TCPStore, the real Supervisor and node agents, stand-in processes. What the new coordinator counts
as ready is what each spare had said when its agent said hello (its key in the node's store), and
afterwards what it writes itself: a spare still warming up at the hello is not ready, the lost
node's ranks shrink onto the survivors, and once the spare writes its key (joining.py, through its
node's door, which by then points at the new store) the job grows back to every process.

Found while chasing test_coordinator_loss's shrink after a takeover: the spares there were not
warm yet (their warm-up, on the test's two shared cores, took 20-40 s); these pin down that the
new coordinator sees them the moment they are."""
import time
from datetime import timedelta
from types import SimpleNamespace as NS

import pytest
import torch.distributed as dist

from checkpointless import protocol
from checkpointless.control.agent import NodeAgent
from checkpointless.control.facts import Known
from checkpointless.control.processes import Worker
from checkpointless.control.supervisor import Supervisor, SupervisorConfig
from checkpointless.control.takeover import take_over
from checkpointless.protocol import membership
from tests.library.control.test_supervisor import TIMEOUT_S, Facts, FakeProc, beat, new_store

# generation 0 as etcd keeps it: node 0 holds ranks 0, 1 (workers 0, 1), node 1 ranks 2, 3
PLAN = {"world_size": 4, "ranks": {"0": 0, "1": 1, "2": 2, "3": 3},
        "nodes": {"0": 0, "1": 0, "2": 1, "3": 1}}
SPARES = (4, 5)  # spare node 2's, in slots 0 and 1


def taken_over(warm: tuple = ()):
    """A stand-alone coordinator with shrink on takes over at generation 0: node 0 and spare
    node 2 say hello to its new store, node 1 never does; of the spare node's spares, only
    those in `warm` had said they were ready before the hello."""
    cfg = SupervisorConfig(nproc=4, nodes=2, spare_nodes=1, spares=0, standalone=True,
                           refill=False, node_timeout_s=TIMEOUT_S, shrink="exact")
    said = []
    sup = Supervisor(["true"], cfg, env={}, log=said.append, facts=Facts())
    store, agents = new_store(), {}
    for node, workers in {0: {0: 0, 1: 1}, 2: {4: 0, 5: 1}}.items():
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False,
                               timeout=timedelta(seconds=10))
        agent = NodeAgent(client, node, ["true"], {}, "127.0.0.1", store.port, TIMEOUT_S,
                          log=said.append)
        agent.role_watch = NS(coordinator_lost_at=time.time() - 1.0)
        for wid, slot in workers.items():
            agent.workers[wid] = Worker(wid=wid, proc=FakeProc(wid), slot=slot, started=0.0,
                                        node=node)
            if wid in SPARES:
                agent.spare_wids.add(wid)
                if wid in warm:  # joining.py writes it into its node's store too
                    agent.node_store.set(protocol.ready_key(wid), "1")
            else:
                beat(agent.node_store, wid, 7, time.time())
        agent.hello(len(workers))
        agents[node] = agent
    known = Known(spec=cfg.spec().to_json(), gen=0, plans={0: PLAN}, lost=0, next_wid=6,
                  moves=[{"node": 1, "token": 1, "start": True}])
    sup.store = store
    sup.resume(take_over(store, sup.pool, sup.facts, known, said.append))
    return sup, store, agents


def lose_silent_node(sup, agents) -> None:
    """The watch loop's looks until node 1, which never said hello, is found lost; then its
    loss is handled."""
    t0, lost = time.time(), []
    while not lost and time.time() < t0 + 8 * TIMEOUT_S:
        for agent in agents.values():  # the nodes that answered go on reporting
            agent.health(news=False)
        lost = sup.losses.exited() + [w for w, _ in sup.losses.silent_nodes([])]
        time.sleep(0.02)
    assert sorted(w.wid for w in lost) == [2, 3]
    sup.replacer.handle([(w, False) for w in lost])


@pytest.mark.parametrize("warm", [SPARES, SPARES[:1]])
def test_spares_warm_at_the_hello_take_the_lost_nodes_ranks(warm):
    sup, store, agents = taken_over(warm=warm)
    assert {w.wid for w in sup.pool.spares(store, ready=True)} == set(warm)
    lose_silent_node(sup, agents)
    if warm == SPARES:  # the whole lost node moves to the spare node, slot for slot
        assert (sup.ranks, sup.resizes) == ({0: 0, 1: 1, 4: 2, 5: 3}, [])
        return
    # one spare covers one lost rank; the other lost rank is hosted by a survivor
    assert [e["kind"] for e in sup.resizes] == ["shrink"] and sup.placement.processes == 3


def test_spares_still_warming_at_the_hello_grow_the_job_back_once_they_say_so():
    sup, store, agents = taken_over(warm=())
    assert sup.pool.spares(store, ready=False) and not sup.pool.spares(store, ready=True)
    lose_silent_node(sup, agents)
    assert sup.placement.processes == 2 and sup.placement.logical_world == 4
    sup.grower.grow_if_ready()
    assert sup.placement.processes == 2  # nothing warm yet: no grow
    for wid in SPARES:  # warm now: each says so in the store it reaches, the new one
        store.set(protocol.ready_key(wid), f"{time.time():.6f}")
    sup.grower.grow_if_ready()  # the notice: every worker stops before the step after next
    assert sup.placement.processes == 2 and sup.grow_at is not None
    store.set(protocol.LAST_STEP, str(sup.grow_at[1] - 1))  # the job is there
    sup.grower.grow_if_ready()
    assert sup.placement.processes == 4
    assert sorted(sup.ranks) == [0, 1, 4, 5]
    assert [(e["kind"], e["to_processes"]) for e in sup.resizes] == [("shrink", 2), ("grow", 4)]
    head = membership.current_gen(store)
    assert head == sup.gen and {sup.workers[w].took_over_gen for w in SPARES} == {head}
