"""The two threads of a node agent (agent.py) that block on the coordinator's store so that
nothing polls it: one follows the coordinator's commands to this node, one copies each
generation's plan and barrier outcome into the node store. Each reaches the store on
connections of its own (`agent.connect`), and hands what it learnt to the agent's loop."""
from __future__ import annotations

import time
from datetime import timedelta

from .. import protocol
from ..protocol import membership
from ..protocol.records import NodeCommand, NodeOp

D = protocol.DEFAULTS


def follow_commands(agent) -> None:
    """Block on this node's group's next bell (keys.bell_key), on a connection of its own;
    at each ring, queue this node's new commands and wake the loop. Where the rings stand
    is read before the commands: a command written after that read is followed by a ring
    at or after it, so none waits unread. The rings are walked one by one (a takeover
    rings again every one its nodes said they wait for: bells.py)."""
    try:
        store = agent.connect(agent.host, agent.port)
        group = agent.node // protocol.NODES_PER_BELL
        # written by the coordinator before any command (a new one's store: after the
        # hellos, which may take long on a big job: waited for as a command is)
        store.wait([protocol.bell_next_key(group)], timedelta(days=1))
        agent.bell_at = int(store.get(protocol.bell_next_key(group)))
        while True:
            # each new command in one round trip (peek), the first absent one ends the turn
            while (raw := membership.peek(
                    store, protocol.node_cmd_key(agent.node, agent.next_cmd))) is not None:
                c = NodeCommand.parse(raw)
                agent.next_cmd += 1
                agent.command_came(c)
                if c.op is NodeOp.SHUTDOWN:  # nothing follows; a thread still blocked in
                    return  # the store as the coordinator exits would abort us
            store.wait([protocol.bell_key(group, agent.bell_at)], timedelta(days=1))
            agent.bell_at += 1
    except Exception:  # noqa: BLE001  the coordinator is gone: the loop sees it too
        return


def relay_plans(agent) -> None:
    """Copy every generation's plan and barrier outcome into the node store, in order
    (membership.relay), on connections of its own. A broken connection is made again and
    the generation in hand copied again (each copy is idempotent): a relay that stopped
    would leave this node's workers waiting for a plan while the others form the group
    without them. Once the coordinator is gone for good, the agent's loop (`NodeAgent._serve`)
    ends the agent (this thread is a daemon)."""
    gen, tries = 0, 0
    while True:
        try:
            store = agent.connect(agent.host, agent.port)
            node_store = agent.connect("127.0.0.1", agent.node_server.port)
            while True:
                membership.relay(store, node_store, agent.node, gen)
                gen, tries = gen + 1, 0
        except Exception as exc:  # noqa: BLE001
            tries += 1
            if agent.leaving:
                return
            if tries == 1:  # once per outage
                agent.log(f"[node {agent.node}] the plan relay broke at generation {gen} "
                          f"({type(exc).__name__}: {exc}); connecting again")
            time.sleep(min(1.0, D.reconnect_step_s * tries))
