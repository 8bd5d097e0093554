"""The coordinator's commands reach node agents through a bell per group of nodes, so the keys
waited for in the coordinator's store grow with groups, not nodes (torch's server walks every
waited key on each cancel: bells.py). Real agents' command threads, a real ClusterPool, one
real store, in-process."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import threading  # noqa: E402
import time  # noqa: E402
from datetime import timedelta  # noqa: E402

from checkpointless import protocol  # noqa: E402
from checkpointless.control.agent import NodeAgent  # noqa: E402
from checkpointless.control.bells import Bells  # noqa: E402
from checkpointless.control.cluster import ClusterPool  # noqa: E402
from checkpointless.protocol import membership  # noqa: E402
from checkpointless.protocol.records import NodeCommand, NodeOp  # noqa: E402

NODES = protocol.NODES_PER_BELL + 2  # two groups: 64 nodes and 2


class _Logged:
    """A store client that notes each call with its first argument."""

    def __init__(self, store, log):
        self.store, self.log = store, log

    def __getattr__(self, name):
        attr = getattr(self.store, name)

        def call(*a, **k):
            self.log.append((name, a[0] if a else None))
            return attr(*a, **k)
        return call


def _agents(port: int, nodes=range(NODES)):
    """Real agents of `nodes` with only their command threads running, each logging its calls."""
    calls = {k: [] for k in nodes}
    agents = [NodeAgent(None, k, ["true"], {}, "127.0.0.1", port, 3.0, log=lambda m: None,
                        starter=lambda cmd, env: None,
                        connect=lambda h, p, k=k: _Logged(membership.connect(h, p), calls[k]))
              for k in nodes]
    threads = [threading.Thread(target=a._follow_commands, daemon=True) for a in agents]
    for t in threads:
        t.start()
    return agents, calls, threads


def _ring_waits(log) -> list[str]:
    return [arg[0] for name, arg in log if name == "wait" and arg[0].count("/") == 2]


def _awaits(calls, k: int, ring: str) -> bool:
    """Agent `k`'s newest call is its wait for `ring`."""
    return bool(calls[k]) and calls[k][-1] == ("wait", [ring])


def _until(cond, within_s: float = 20.0) -> None:
    deadline = time.time() + within_s
    while not cond():
        assert time.time() < deadline, "not within the time"
        time.sleep(0.02)


def test_commands_ring_one_bell_per_group_and_wake_only_that_group():
    server, store = membership.host("127.0.0.1")
    pool = ClusterPool(["true"], {}, "127.0.0.1", 0, nodes=NODES, spare_nodes=0, per_node=1,
                       spares_per_node=0, node_timeout_s=3.0, local=False)
    pool.store, pool.port = store, server.port
    agents, calls, threads = _agents(server.port)
    time.sleep(0.3)  # where the rings stand is not written yet: the agents wait for it
    assert all(a.bell_at is None for a in agents)
    pool.bells.open(store, pool.nodes)
    _until(lambda: all(_awaits(calls, k, protocol.bell_key(k // 64, 0)) for k in range(NODES)))
    # every node's spawn written together: one ring per group
    with pool.bells.held(store):
        for k in range(NODES):
            pool.spawn_on(k, 0, spare=False)
    _until(lambda: all(a._cmds.qsize() == 1 for a in agents))
    assert [store.get(protocol.bell_next_key(g)) for g in (0, 1)] == [b"1", b"1"]
    assert all(a._cmds.get().op is NodeOp.SPAWN for a in agents)
    _until(lambda: all(_awaits(calls, k, protocol.bell_key(k // 64, 1)) for k in range(NODES)))
    # one command alone: its group's agents wake, read their own next command, and wait again;
    # the other group's make no call at all
    before = {k: len(c) for k, c in calls.items()}
    pool._command(NODES - 1, NodeCommand(NodeOp.KILL, wid=7))
    _until(lambda: agents[-1]._cmds.qsize() == 1 and
           _awaits(calls, NODES - 2, protocol.bell_key(1, 2)))
    assert agents[-1]._cmds.get() == NodeCommand(NodeOp.KILL, wid=7)
    assert agents[-2]._cmds.empty()
    time.sleep(0.3)
    assert all(len(calls[k]) == before[k] for k in range(protocol.NODES_PER_BELL))
    # what the store was asked to wait for: where the rings stand, then one key per ring of
    # each group, never a node's own
    waited = {key for c in calls.values() for name, arg in c if name == "wait" for key in arg}
    assert waited == {protocol.bell_next_key(0), protocol.bell_next_key(1),
                      protocol.bell_key(0, 0), protocol.bell_key(0, 1),
                      protocol.bell_key(1, 0), protocol.bell_key(1, 1), protocol.bell_key(1, 2)}
    # a shutdown ends each thread after its command
    with pool.bells.held(store):
        for k in range(NODES):
            pool._command(k, NodeCommand(NodeOp.SHUTDOWN))
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    assert all(a._cmds.get().op is NodeOp.SHUTDOWN for a in agents)


def test_an_agent_starting_late_begins_at_the_groups_next_ring():
    server, store = membership.host("127.0.0.1")
    pool = ClusterPool(["true"], {}, "127.0.0.1", 0, nodes=2, spare_nodes=0, per_node=1,
                       spares_per_node=0, node_timeout_s=3.0, local=False)
    pool.store, pool.port = store, server.port
    pool.bells.open(store, pool.nodes)
    pool._command(0, NodeCommand(NodeOp.KILL, wid=1))
    pool._command(1, NodeCommand(NodeOp.KILL, wid=2))  # written before node 1's agent started
    (agent,), calls, _ = _agents(server.port, nodes=[1])
    _until(lambda: agent._cmds.qsize() == 1 and _awaits(calls, 1, protocol.bell_key(0, 2)))
    pool._command(1, NodeCommand(NodeOp.KILL, wid=3))
    _until(lambda: agent._cmds.qsize() == 2 and _awaits(calls, 1, protocol.bell_key(0, 3)))
    assert [agent._cmds.get().wid for _ in range(2)] == [2, 3]
    # rings 0 and 1 came before it: it never waited for them
    assert _ring_waits(calls[1]) == [protocol.bell_key(0, 2), protocol.bell_key(0, 3)]


def test_a_takeover_rings_again_in_its_store_every_ring_its_nodes_await():
    """A coordinator that took over has an empty store; the agents' doors wait there again for
    the rings they awaited at the one lost, and an agent whose command thread had not read where
    the rings stand asks this store. It rings those awaited and the ones between, numbers its
    own after them, and says where every group stands."""
    server, store = membership.host("127.0.0.1")
    pool = ClusterPool(["true"], {}, "127.0.0.1", 0, nodes=NODES, spare_nodes=0, per_node=1,
                       spares_per_node=0, node_timeout_s=3.0, local=False)
    pool.store, pool.port = store, server.port
    for k, at in ((0, 3), (1, 5), (NODES - 1, 0)):  # as their hellos said
        pool.resume_node(k, time.time(), next_cmd=4, bell=at)
    pool.resume_node(2, time.time(), next_cmd=0, bell=None)  # its thread had not read it yet
    (late,), calls, _ = _agents(server.port, nodes=[2])  # and now asks this store
    waiters = [membership.connect("127.0.0.1", server.port) for _ in range(3)]
    woke = []
    for c, key in zip(waiters, (protocol.bell_key(0, 3), protocol.bell_key(0, 4),
                                protocol.bell_key(1, 0))):
        threading.Thread(target=lambda c=c, key=key: (c.wait([key], timedelta(seconds=30)),
                                                      woke.append(key)), daemon=True).start()
    time.sleep(0.3)
    assert woke == [] and late.bell_at is None
    pool.bells.ring_again(store, pool.nodes)
    _until(lambda: len(woke) == 3 and _awaits(calls, 2, protocol.bell_key(0, 6)))
    assert store.get(protocol.bell_next_key(0)) == b"6"
    assert store.get(protocol.bell_next_key(1)) == b"1"
    assert not store.check([protocol.bell_key(0, 2)])  # below every node's: nobody awaits it
    pool._command(1, NodeCommand(NodeOp.KILL, wid=9))
    assert store.get(protocol.node_cmd_key(1, 4)) == \
        NodeCommand(NodeOp.KILL, wid=9).to_json().encode()
    assert store.check([protocol.bell_key(0, 6)]) and store.get(protocol.bell_next_key(0)) == b"7"
    pool._command(2, NodeCommand(NodeOp.KILL, wid=10))  # the late agent gets its own
    _until(lambda: late._cmds.qsize() == 1)
    assert late._cmds.get().wid == 10


def test_a_ring_that_fails_is_owed_not_skipped():
    """Agents walk the rings one at a time: a ring number never set would stop a whole group."""
    server, store = membership.host("127.0.0.1")
    bells = Bells()

    class Broken:
        def multi_set(self, keys, values):
            raise RuntimeError("the store is gone")
    try:
        with bells.held(Broken()):
            bells.command_written(Broken(), 5)
    except RuntimeError:
        pass
    bells.command_written(store, 6)  # the next ring of group 0 is still number 0
    assert store.check([protocol.bell_key(0, 0)]) and store.get(protocol.bell_next_key(0)) == b"1"
