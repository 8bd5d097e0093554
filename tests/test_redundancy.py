"""Peer replicas of sharded state: choosing the step to roll back to and who serves each slice."""
import pytest
import torch

from checkpointless.redundancy import ShardReplicas, pick_holders, restorable_step
from tests.conftest import spawn_gloo


def info(completed, own, held):
    return {"completed": completed, "own": own, "held": {str(k): v for k, v in held.items()}}


def test_ring_placement():
    r = ShardReplicas(factor=2)
    assert r.holders_of(3, 4) == [0] and r.sources_for(0, 4) == [3]
    r3 = ShardReplicas(factor=3)
    assert r3.holders_of(1, 4) == [2, 3] and r3.sources_for(1, 4) == [0, 3]
    nodes = ShardReplicas(factor=2, offset=2)  # two ranks per node: the copy goes a node apart
    assert nodes.holders_of(0, 4) == [2]


def test_rollback_to_the_newest_step_every_slice_has():
    # rank 1 died; its slice at step 7 is held by rank 2; rank 0 had already applied step 8
    infos = [info(8, [6, 7], {3: [6, 7]}), info(-1, [], {}), info(7, [6, 7], {1: [6, 7]}),
             info(7, [6, 7], {2: [6, 7]})]
    assert restorable_step(infos) == 7
    assert pick_holders(infos, 7) == {1: 2}


def test_a_copy_missing_at_the_newest_step_falls_back_one_version():
    # the exchange at step 8 was cut short: rank 2 never received rank 1's slice at 8
    infos = [info(8, [7, 8], {3: [7, 8]}), info(-1, [], {}), info(8, [7, 8], {1: [7]}),
             info(8, [7, 8], {2: [7, 8]})]
    assert restorable_step(infos) == 7


def test_slice_and_its_holder_lost_together_has_no_peer_copy():
    infos = [info(8, [7, 8], {3: [7, 8]}), info(-1, [], {}), info(-1, [], {}),
             info(8, [7, 8], {2: [7, 8]})]
    assert restorable_step(infos) is None  # -> durable checkpoint


def test_load_is_spread_over_holders():
    infos = [info(5, [5], {3: [5], 2: [5]}), info(5, [5], {0: [5], 3: [5]}), info(-1, [], {}),
             info(-1, [], {})]
    holders = pick_holders(infos, 5)
    assert set(holders) == {2, 3} and len(set(holders.values())) == 2


def _side(port, gen, rank, world, timeout_s=60.0):
    """What the job's connect() builds: a gloo group of its own, per generation."""
    from checkpointless.group import side_group
    return lambda: side_group("127.0.0.1", port, gen, rank, world, timeout_s)


def _exchange(rank, port, q):
    rep = ShardReplicas(factor=2)
    for step in (3, 4, 5, 6):
        rep.replicate(step, {"w": torch.full((rank + 2,), float(rank * 10 + step))}, rank, 3,
                      gen=0, connect=_side(port, 0, rank, 3))
    rep.wait()
    src = rep.sources_for(rank, 3)[0]
    from checkpointless.transfer import unflatten_state
    skel, flat = rep.held[src][6]
    got = unflatten_state(skel, flat)["w"]
    q.put((rank, sorted(rep.own), sorted(rep.held[src]), got.tolist()))


def test_replicas_are_exchanged_in_the_background_and_three_versions_kept():
    got = spawn_gloo(_exchange, 3)
    # rank r holds rank r-1's slice (uneven sizes), versions 4, 5 and 6
    assert got[0] == (0, [4, 5, 6], [4, 5, 6], [26.0] * 4)
    assert got[1] == (1, [4, 5, 6], [4, 5, 6], [6.0] * 2)
    assert got[2] == (2, [4, 5, 6], [4, 5, 6], [16.0] * 3)


def test_bad_factor_is_refused():
    with pytest.raises(ValueError):
        ShardReplicas(factor=0)
