"""Logical ranks (issue 40's foundation): where the logical ranks go when processes are lost or
come back, and the logical-order reduction whose bits do not depend on the processes.

The reductions run in one spawn of 4 gloo processes: the 3- and 2-process jobs are subgroups of
it, each with its own placements, so one start-up (the slow part on 2 cores) covers them all."""
import pytest
import torch
import torch.distributed as dist

from checkpointless.worker.logical import (Placement, logical_all_reduce,
                                           logical_all_reduce_grads,
                                           logical_reduce_scatter_replicated)
from tests.conftest import spawn_gloo

L = 4
SHAPE = (17, 59)  # 1,003 elements: no process count here divides them, so chunks are padded
GRAD_SHAPES = [(5, 7), (7,), (3, 5)]


# ---- placement ------------------------------------------------------------------------------

def test_identity_hosts_one_logical_rank_a_process():
    p = Placement.identity(4)
    assert p.hosts == ((0,), (1,), (2,), (3,)) and p.processes == 4 and p.loads() == [1] * 4
    assert p.process_of(2) == 2


def test_shrink_moves_the_lost_ranks_to_the_least_loaded_survivors():
    p = Placement.identity(4)
    one = p.shrink(1)  # survivors 0, 2, 3 renumbered 0, 1, 2; rank 1 to the lowest index
    assert one.hosts == ((0, 1), (2,), (3,))
    assert p.shrink(3).hosts == ((0, 3), (1,), (2,))
    # two lost at once: rank 1 to process 0, then rank 2 to the now least-loaded process 1
    assert p.shrink([1, 2]).hosts == ((0, 1), (2, 3))
    # one after the other: survivors (2,), (3,) take ranks 0 and 1, one each
    assert one.shrink(0).hosts == ((0, 2), (1, 3))
    # least loaded, not lowest index: both of the lost process's ranks go to process 1
    assert Placement(6, ((0, 1, 2), (3,), (4, 5))).shrink(2).hosts == ((0, 1, 2), (3, 4, 5))
    with pytest.raises(ValueError, match="no process survives"):
        Placement.identity(2).shrink([0, 1])
    with pytest.raises(ValueError, match="not among"):
        p.shrink(4)


def test_shrink_respects_each_processs_capacity():
    one = Placement.identity(4).shrink(1)  # ((0, 1), (2,), (3,))
    assert one.shrink(0, capacity=2).hosts == ((0, 2), (1, 3))
    # a per-process capacity steers the placement: process 1 (hosting 2) may take no more
    assert Placement.identity(4).shrink(0, capacity=[1, 1, 2, 2]).hosts == ((1,), (0, 2), (3,))
    with pytest.raises(ValueError) as e:
        one.shrink(0, capacity=1)
    assert "cannot place logical rank 0" in str(e.value) and "capacity" in str(e.value)
    with pytest.raises(ValueError, match="over its capacity"):
        one.shrink(2, capacity=1)
    with pytest.raises(ValueError, match="capacity lists 2 processes"):
        one.shrink(2, capacity=[2, 2])


def test_grow_gives_the_most_loaded_processs_highest_rank_to_the_new_one():
    shrunk = Placement.identity(4).shrink([1, 2])  # ((0, 1), (2, 3))
    assert shrunk.grow().hosts == ((0,), (2, 3), (1,))
    assert shrunk.grow(2).hosts == ((0,), (2,), (1,), (3,))
    assert Placement(5, ((0,), (1, 2, 3), (4,))).grow().hosts == ((0,), (1, 2), (4,), (3,))
    assert shrunk.grow(0) == shrunk
    with pytest.raises(ValueError, match="cannot grow past 4"):
        shrunk.grow(3)


def test_placement_json_round_trip_and_validation():
    p = Placement(5, ((0, 3), (1,), (2, 4)))
    assert Placement.from_json(p.to_json()) == p
    assert Placement.from_json(Placement.identity(3).to_json()) == Placement.identity(3)
    for bad in [((0,), (0,)), ((0, 1),), ((1, 0), (2,)), ((0, 1, 2), ())]:
        with pytest.raises(ValueError):
            Placement(3, bad)


# ---- the logical-order reduction ------------------------------------------------------------

def _contribution(logical: int) -> torch.Tensor:
    """Logical rank `logical`'s values: mixed magnitudes (1e-6 to 1e6), so that the order of
    the adds shows in the last bits."""
    g = torch.Generator().manual_seed(100 + logical)
    scale = 10.0 ** torch.randint(-6, 7, SHAPE, generator=g).float()
    return torch.randn(SHAPE, generator=g) * scale


def _grads(logical: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(200 + logical)
    return [torch.randn(s, generator=g) * 10.0 ** torch.randint(-4, 5, s, generator=g).float()
            for s in GRAD_SHAPES]


def _in_order(parts):
    acc = parts[0].clone()
    for p in parts[1:]:
        acc = acc + p
    return acc


# (the world's ranks that form the job, its placements): 4, 3 and 2 processes
JOBS = [((0, 1, 2, 3), [Placement.identity(L)]),
        ((0, 1, 2), [Placement.identity(L).shrink(3)]),
        ((0, 2, 3), [Placement.identity(L).shrink(1)]),
        ((1, 3), [Placement.identity(L).shrink([0, 2]), Placement(L, ((0, 1, 2), (3,))),
                  Placement.identity(L).shrink(3).shrink(2)])]


def _reduce_on_subgroups(rank, port, q):
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4)
    torch.set_num_threads(1)
    out = {}
    for ranks, placements in JOBS:
        group = dist.new_group(list(ranks))  # every process makes every group, in one order
        if rank not in ranks:
            continue
        me = ranks.index(rank)
        for placement in placements:
            hosted = placement.hosted(me)
            summed = logical_all_reduce({r: _contribution(r) for r in hosted}, placement, group)
            targets = [torch.empty(s) for s in GRAD_SHAPES]
            avg = logical_all_reduce_grads({r: _grads(r) for r in hosted}, placement, group,
                                           out=targets)
            written = torch.equal(torch.cat([t.reshape(-1) for t in targets]), avg)
            out[placement.to_json()] = (summed.numpy(), avg.numpy(), written)
    # HSDP: the 4 processes as 2 replica groups of 2; contributions of 14 x 59 = 826 elements,
    # 2 chunks of 413, each cut into 2 parts of 207 (the last padded)
    twins = [dist.new_group(r) for r in ((0, 2), (1, 3))]
    for placement in (Placement.identity(L), Placement(L, ((3,), (2,), (0,), (1,)))):
        got = logical_reduce_scatter_replicated(
            {r: _contribution(r)[:14] for r in placement.hosted(rank)}, placement,
            twins[rank % 2])
        out[("hsdp", placement.to_json())] = got.numpy()
    q.put((rank, out))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reduced():
    """{(world rank, placement json): (sum, averaged grads, out written)} of every job."""
    return {(rank, key): v for rank, out in spawn_gloo(_reduce_on_subgroups, 4, timeout=90)
            for key, v in out.items()}


def test_the_summation_order_shows_in_the_bits():
    """The check below can fail: other orders of the same four adds give other bits."""
    parts = [_contribution(r) for r in range(L)]
    ref = _in_order(parts)
    assert not torch.equal(ref, _in_order(parts[::-1]))
    assert not torch.equal(ref, (parts[0] + parts[1]) + (parts[2] + parts[3]))
    assert not torch.equal(ref, _in_order([parts[0], parts[3], parts[1], parts[2]]))


def test_one_process_hosting_every_rank_needs_no_group():
    parts = {r: _contribution(r) for r in range(L)}
    alone = Placement(L, (tuple(range(L)),))
    assert torch.equal(logical_all_reduce(parts, alone), _in_order([parts[r] for r in range(L)]))


def test_hsdp_chunks_are_the_logical_order_sum_the_same_in_twins(reduced):
    """Each process of 2 x 2 gets chunk rank % 2 of ((c0 + c1) + c2) + c3, whoever hosts
    which logical rank."""
    ref = _in_order([_contribution(r)[:14] for r in range(L)]).reshape(-1)
    got = {k: v for k, v in reduced.items() if isinstance(k[1], tuple)}
    assert len(got) == 8
    for (rank, _), chunk in got.items():
        assert torch.equal(torch.from_numpy(chunk), ref[413 * (rank % 2):][:413]), rank


def test_same_bits_on_4_3_and_2_processes(reduced):
    reduced = {k: v for k, v in reduced.items() if isinstance(k[1], str)}
    ref = _in_order([_contribution(r) for r in range(L)])
    want = {(rank, p.to_json()) for ranks, ps in JOBS for p in ps for rank in ranks}
    assert set(reduced) == want  # every process of every job answered
    for key, (summed, _, _) in reduced.items():
        assert torch.equal(torch.from_numpy(summed), ref), key
    assert {len(Placement.from_json(k).hosts) for _, k in reduced} == {4, 3, 2}


def test_averaged_gradients_are_the_same_on_4_3_and_2_processes(reduced):
    reduced = {k: v for k, v in reduced.items() if isinstance(k[1], str)}
    per_rank = [torch.cat([g.reshape(-1) for g in _grads(r)]) for r in range(L)]
    ref = _in_order(per_rank) / L
    for key, (_, avg, written) in reduced.items():
        assert torch.equal(torch.from_numpy(avg), ref), key
        assert written, key  # `out` received the same numbers


def test_contributions_must_match_the_hosted_ranks():
    alone = Placement(2, ((0, 1),))
    with pytest.raises(ValueError, match="hosts logical ranks"):
        logical_all_reduce({0: torch.ones(3)}, alone)
    with pytest.raises(ValueError, match="contribution is"):
        logical_all_reduce({0: torch.ones(3), 1: torch.ones(4)}, alone)
    with pytest.raises(ValueError, match="`out` holds"):
        logical_all_reduce_grads({0: [torch.ones(3)], 1: [torch.ones(3)]}, alone,
                                 out=[torch.empty(2)])
