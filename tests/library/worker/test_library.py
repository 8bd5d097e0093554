"""checkpointless building blocks, on plain torch (no transformers): fast, real gloo where it counts."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from checkpointless.control import detection, report
from checkpointless.worker import failures, restore, transfer
from checkpointless.protocol import faults, membership
from checkpointless.worker import injector
from checkpointless import protocol
from checkpointless.worker.grads import all_reduce_grads
from checkpointless.worker.seeding import step_seed
from tests.conftest import spawn_gloo


def _state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 2)).to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 7,
            "rng": torch.get_rng_state()}


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_flatten_roundtrip_keeps_every_bit_and_dtype():
    s = _state()
    skeleton, flat = transfer.flatten_state(s)
    assert _equal(transfer.unflatten_state(skeleton, flat), s)


FLIPS = (None, False, True)


def _pair(rank, port, q):
    """One pair of processes for the three cases, one after the other over the same group (a
    case's three messages are all received before its check, so the next starts in step)."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    try:
        got = {}
        for flip in FLIPS:
            if rank == 0:
                if flip is None:
                    transfer.send_state(_state(), 1)
                    continue
                # what send_state sends, with the true digest, and then (flip) one bit of the
                # payload changed in flight: only the digest check can catch it
                skel, payload = transfer.flatten_state(_state(), tail=32)
                flat = payload[:-32]
                payload[-32:] = torch.frombuffer(bytearray(transfer._digest(skel, flat)),
                                                 dtype=torch.uint8)
                if flip:
                    flat[len(flat) // 2] ^= 1 << 3
                dist.send(torch.tensor([len(skel), flat.numel()]), 1)
                dist.send(torch.frombuffer(bytearray(skel), dtype=torch.uint8), 1)
                dist.send(payload, 1)
            else:
                try:
                    state, n = transfer.recv_state(0)
                    got[flip] = ("ok", _equal(state, _state()), n)
                except transfer.IntegrityError as exc:
                    got[flip] = ("integrity", str(exc), 0)
        q.put(None if rank == 0 else got)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def transfers():
    """What rank 1 received in each case (only the receiver reports)."""
    (got,) = [x for x in spawn_gloo(_pair, 2) if x is not None]
    return got


@pytest.mark.parametrize("flip", FLIPS)
def test_state_transfer_over_gloo_is_exact_and_a_flipped_bit_is_refused(flip, transfers):
    kind, value, n = transfers[flip]
    if flip:
        assert kind == "integrity" and "SHA-256" in value
    else:  # send_state itself, and the hand-built message with its true digest, are accepted
        assert kind == "ok" and value is True and n > 0


def _start(rank, port, q):
    """Each rank builds its model unseeded (a different init per process), then the launch's
    first restore; then again with rank 0 a spare holding nothing (one that took a rank lost
    during that restore)."""
    from checkpointless.protocol import Spec
    from checkpointless.worker.state import ProtectedState
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
    try:
        for spare_rank in (None, 0):
            torch.manual_seed(1000 * (spare_rank or 7) + rank)
            state = ProtectedState(Spec())
            model = torch.nn.Linear(3, 2)
            state.protect(model=model)
            holds = rank != spare_rank
            out = restore.restore(state, restore.Position(rank, 3, 5 if holds else -1, holds,
                                                          False, agreed=False))
            q.put((spare_rank is None, rank, out.resumed_step,
                   out.info.get("start_broadcast_from"),
                   [round(float(v), 6) for v in model.weight.reshape(-1)]))
    finally:
        dist.destroy_process_group()


def test_the_launchs_first_restore_gives_every_rank_one_state_like_torchs_ddp():
    """An unseeded script's ranks start from different models; the first restore broadcasts one
    of them (rank 0's, or the lowest holder's when rank 0 is a spare) to every member."""
    import torch.multiprocessing as mp
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_start, args=(r, store.port, q)) for r in range(3)]
    for p in procs:
        p.start()
    got = [q.get(timeout=60) for _ in range(6)]
    for p in procs:
        p.join(timeout=30)
    for all_hold, src in ((True, 0), (False, 1)):
        mine = [g for g in got if g[0] is all_hold]
        assert {(step, by) for _, _, step, by, _ in mine} == {(5, src)}
        assert len({tuple(w) for *_, w in mine}) == 1  # one state everywhere


def test_sources_are_load_balanced():
    pairs = restore.assign_sources([1, 3, 5, 6], [0, 2])
    assert sorted(pairs) == [1, 3, 5, 6]
    assert sorted(pairs.values()) == [0, 0, 2, 2]
    with pytest.raises(RuntimeError, match="no healthy worker"):
        restore.assign_sources([1], [])


def _raise_inside_torch_distributed():
    try:
        dist.all_reduce(torch.zeros(1))  # no process group: torch.distributed itself raises
    except Exception as exc:
        return exc
    raise AssertionError("expected torch.distributed to raise")


def test_a_peer_failure_is_a_recorded_loss_never_words_in_the_message():
    mine = RuntimeError("timed out reading shard 7 of my own dataset: connection reset by peer")
    t0 = time.time()
    assert not failures.is_peer_failure(mine, lambda: False, confirm_s=5.0)
    assert time.time() - t0 < 1.0  # not held back for confirm_s (5 s): at once, even on a loaded machine
    assert failures.is_peer_failure(mine, lambda: True, confirm_s=5.0)  # a loss was recorded
    assert not failures.is_peer_failure(KeyboardInterrupt(), lambda: True, confirm_s=5.0)

    # an error of torch.distributed's own (or of this library's calls to peers) waits for the
    # supervisor's record, which may come a little after the survivors' error
    comm = _raise_inside_torch_distributed()
    assert failures.raised_in_torch_distributed(comm)
    assert not failures.raised_in_torch_distributed(mine)
    t0 = time.time()
    assert failures.is_peer_failure(comm, lambda: time.time() - t0 > 0.1, confirm_s=5.0)
    t0 = time.time()
    assert not failures.is_peer_failure(comm, lambda: False, confirm_s=0.3)  # never confirmed
    assert 0.3 <= time.time() - t0 < 1.0


def test_this_librarys_own_calls_to_peers_raise_a_typed_failure():
    with pytest.raises(failures.PeerLost) as info:
        with failures.communicating("the gradient all-reduce"):
            raise RuntimeError("Connection closed by peer")
    assert isinstance(info.value, failures.PeerFailure)
    assert "the gradient all-reduce" in str(info.value)
    with pytest.raises(ValueError):  # not a communication failure: passes through untouched
        with failures.communicating("x"):
            raise ValueError("bad shape")


def test_hung_worker_is_the_silent_one_behind_not_its_blocked_peers():
    now = 100.0
    beats = {0: {"t": 95.0, "step": 8}, 1: {"t": 90.0, "step": 7}, 2: {"t": 95.0, "step": 8},
             3: None}
    assert detection.find_hung(beats, {}, timeout_s=3.0, now=now) == [1]
    # a step longer than the timeout: the rank a beat behind is not hung while others beat
    slow = {0: {"t": 99.0, "step": 8}, 1: {"t": 90.0, "step": 7}}
    assert detection.find_hung(slow, {}, timeout_s=3.0, now=now) == []
    # all silent at the same step: nobody is declared hung on heartbeats alone
    same = {0: {"t": 90.0, "step": 8}, 1: {"t": 90.0, "step": 8}}
    assert detection.find_hung(same, {}, timeout_s=3.0, now=now) == []
    # recent beats: nobody
    assert detection.find_hung({0: {"t": 99.0, "step": 1}, 1: {"t": 99.5, "step": 2}}, {},
                               timeout_s=3.0, now=now) == []


def test_a_stopped_process_is_seen_as_stopped():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not detection.process_stopped(p.pid)
        os.kill(p.pid, signal.SIGSTOP)
        time.sleep(0.2)
        assert detection.process_stopped(p.pid)
        beats = {0: {"t": 0.0, "step": 8}, 1: {"t": 0.0, "step": 8}}
        assert detection.find_hung(beats, {1: p.pid}, timeout_s=3.0, now=10.0) == [1]
    finally:
        p.kill()
        p.wait()


def test_step_seed_depends_on_step_and_rank_only():
    assert step_seed(0, 5, 2) == step_seed(0, 5, 2)
    assert len({step_seed(0, s, r) for s in range(10) for r in range(4)}) == 40
    assert step_seed(1, 5, 2) != step_seed(0, 5, 2)


def test_goodput_counts_committed_step_time_over_span():
    steps = {0: (0.0, 1.0), 1: (1.0, 2.0), 2: (5.0, 6.0)}  # 3 s of failure between 1 and 2
    assert report.goodput_from_steps(steps) == pytest.approx(0.5)
    assert report.goodput_from_steps({}) is None


def test_fault_specs_parse_and_reject():
    f = faults.parse_faults(["kill:2:5", {"kind": "hang", "rank": 0, "step": 1}])
    assert f == [faults.Fault("kill", 2, 5), faults.Fault("hang", 0, 1)]
    with pytest.raises(ValueError, match="explode"):
        faults.parse_faults(["explode:1:1"])
    with pytest.raises(ValueError, match="kind:rank:step"):
        faults.parse_faults(["kill:1"])


def test_a_fault_fires_once_even_when_the_step_is_redone():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    inj = injector.FaultInjector([faults.Fault("raise", 1, 3)], store, worker_id=0)
    inj.raise_due(0, 3)  # other rank: nothing
    with pytest.raises(injector.InjectedFault):
        inj.raise_due(1, 3)
    replacement = injector.FaultInjector([faults.Fault("raise", 1, 3)], store, worker_id=5)
    replacement.raise_due(1, 3)  # the spare redoing step 3 does not fail again
    assert json.loads(store.get(protocol.fault_time_key(0)))["kind"] == "raise"


def test_plans_are_read_by_node_as_changes_and_the_barrier_gives_way_to_a_newer_one():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    gen0 = membership.Plan(gen=0, world_size=4, ranks={10: 0, 11: 1, 12: 2, 13: 3},
                           nodes={10: 0, 11: 0, 12: 1, 13: 1})
    membership.publish(store, gen0)
    seat = membership.follow(store, 12, 1, -1, -1, 0)
    assert (seat.rank, seat.world_size, seat.members_here, seat.nodes) == (2, 4, 2, 2)
    assert membership.follow(store, 14, 2, -1, -1, 0) is None  # a spare on node 2: not yet
    # worker 11 is lost; spare 14 on node 2 takes rank 1: node 0's part lists only the change
    gen1 = membership.Plan(gen=1, world_size=4, ranks={10: 0, 14: 1, 12: 2, 13: 3},
                           nodes={10: 0, 14: 2, 12: 1, 13: 1})
    membership.publish(store, gen1, gen0)
    part = json.loads(store.get(protocol.plan_node_key(1, 0)))
    assert {k: part[k] for k in ("joined", "left", "members")} == \
        {"joined": {}, "left": [11], "members": 1}
    assert (part["world_size"], part["nodes"], part["gen"]) == (4, 3, 1)  # the head, carried

    # a recovery's read is one round trip (a get is two: torch's client waits first), and a
    # peek at a missing key neither waits nor sets it
    class Counted:
        def __init__(self):
            self.calls = []

        def __getattr__(self, name):
            self.calls.append(name)
            return getattr(store, name)
    counted = Counted()
    assert membership.follow(counted, 14, 2, 0, 0, 1).rank == 1 and counted.calls == \
        ["compare_set"]
    assert membership.peek(store, "never/set") is None and not store.check(["never/set"])
    assert json.loads(store.get(protocol.plan_node_key(1, 1)))["joined"] == {}
    assert membership.follow(store, 14, 2, -1, -1, 1).rank == 1  # read both generations
    assert membership.follow(store, 10, 0, 0, 0, 1).members_here == 1
    assert membership.follow(store, 11, 0, 1, 0, 1) is None  # dropped
    # generation 0's barrier was still open: gen 1 marked it stale, so nobody waits for it
    assert membership.barrier(store, store, seat) is False
    # every member of gen 1 arrives: each node's last adds once, the job's last opens it
    seats = [membership.follow(store, w, n, r, 0, 1) for w, n, r in
             [(10, 0, 0), (12, 1, 2), (13, 1, 3)]] + [membership.follow(store, 14, 2, -1, -1, 1)]
    got = []

    def arrive(seat):  # each member on a connection of its own, as workers are
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
        got.append(membership.barrier(client, client, seat))

    threads = [threading.Thread(target=arrive, args=(s,)) for s in seats]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert got == [True] * 4 and int(store.get(protocol.barrier_key(1))) == 3


def test_a_nodes_agent_relays_each_plan_and_its_barrier_outcome_into_the_node_store():
    # the ranks of node 1 wait and read in their node's store only: the job's store wakes one
    # waiter per node (the relay), not one per rank
    main = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    node = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    relayed = []

    def relay():  # the agent's thread, on connections of its own
        m = dist.TCPStore("127.0.0.1", main.port, is_master=False)
        n = dist.TCPStore("127.0.0.1", node.port, is_master=False)
        for g in range(2):
            membership.relay(m, n, 1, g)
            relayed.append(g)

    threading.Thread(target=relay, daemon=True).start()
    gen0 = membership.Plan(gen=0, world_size=2, ranks={10: 0, 12: 1}, nodes={10: 0, 12: 1})
    membership.publish(main, gen0)
    rank_conn = dist.TCPStore("127.0.0.1", node.port, is_master=False)
    rank_conn.wait([protocol.plan_key(0)], timedelta(seconds=10))  # woken by the relay
    seat = membership.follow(rank_conn, 12, 1, -1, -1, 0)
    assert (seat.rank, seat.members_here, seat.nodes) == (1, 1, 2)
    assert membership.current_gen(rank_conn) == 0
    # node 0's member arrives in the job's store (its node store is the job's), node 1's in
    # its own; both learn "go", node 1's from the relay
    seat0 = membership.follow(main, 10, 0, -1, -1, 0)
    got = []
    t = threading.Thread(target=lambda: got.append(membership.barrier(
        dist.TCPStore("127.0.0.1", main.port, is_master=False),
        dist.TCPStore("127.0.0.1", main.port, is_master=False), seat0)))
    t.start()
    got.append(membership.barrier(dist.TCPStore("127.0.0.1", main.port, is_master=False),
                                  rank_conn, seat))
    t.join(10)
    assert got == [True, True]
    # generation 1 replaces a barrier that never completes: the relay carries "stale" across
    gen1 = membership.Plan(gen=1, world_size=2, ranks={10: 0, 12: 1}, nodes={10: 0, 12: 1})
    membership.publish(main, gen1, gen0)
    rank_conn.wait([protocol.plan_key(1)], timedelta(seconds=10))
    seat1 = membership.follow(rank_conn, 12, 1, 1, 0, 1)
    gen2 = membership.Plan(gen=2, world_size=2, ranks={10: 0, 12: 1}, nodes={10: 0, 12: 1})
    membership.publish(main, gen2, gen1)
    assert membership.barrier(dist.TCPStore("127.0.0.1", main.port, is_master=False),
                              rank_conn, seat1) is False
    deadline = time.time() + 10
    while relayed != [0, 1] and time.time() < deadline:
        time.sleep(0.01)
    assert relayed == [0, 1]


def test_a_relay_whose_connection_breaks_connects_again_and_misses_no_generation():
    """The agent's relay thread loses its connection to the job's store in the middle of a
    generation (after its wait, before its read): it connects again, copies that generation
    again, and its node's ranks see every plan and barrier outcome."""
    from checkpointless.control.agent import NodeAgent
    main = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    broken, said = [], []

    class Breaks:  # the first connection to the job's store fails on its first read
        def __init__(self, store):
            self.store = store

        def __getattr__(self, name):
            attr = getattr(self.store, name)
            if name == "compare_set" and not broken:  # the relay reads by compare_set (peek)
                def fail(*a):
                    broken.append(1)
                    raise RuntimeError("connection reset by peer")
                return fail
            return attr

    def connect(host, port):
        store = membership.connect(host, port, 10.0)
        return Breaks(store) if port == main.port else store

    agent = NodeAgent(membership.connect("127.0.0.1", main.port), 1, ["true"], {}, "127.0.0.1",
                      main.port, 3.0, log=said.append, connect=connect)
    threading.Thread(target=agent._relay_plans, daemon=True).start()
    gen0 = membership.Plan(gen=0, world_size=1, ranks={5: 0}, nodes={5: 1})
    membership.publish(main, gen0)
    rank_conn = dist.TCPStore("127.0.0.1", agent.node_server.port, is_master=False)
    rank_conn.wait([protocol.plan_key(0)], timedelta(seconds=10))
    seat = membership.follow(rank_conn, 5, 1, -1, -1, 0)
    assert seat.rank == 0 and broken == [1]
    assert membership.barrier(membership.connect("127.0.0.1", main.port), rank_conn, seat)
    gen1 = membership.Plan(gen=1, world_size=1, ranks={5: 0}, nodes={5: 1})
    membership.publish(main, gen1, gen0)
    rank_conn.wait([protocol.plan_key(1)], timedelta(seconds=10))
    assert membership.current_gen(rank_conn) == 1
    assert any("relay broke at generation 0" in m for m in said), said


def _reduce(rank, port, q):
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    torch.manual_seed(rank)
    ps = [torch.nn.Parameter(torch.zeros(3, 4)), torch.nn.Parameter(torch.zeros(5))]
    for p in ps:
        p.grad = torch.randn_like(p)
    expect = [p.grad.clone() for p in ps]
    for e in expect:
        dist.all_reduce(e)
        e /= 2
    extra = all_reduce_grads(ps, 2, extra=torch.tensor([float(rank + 1)]))
    q.put((rank, all(torch.allclose(p.grad, e) for p, e in zip(ps, expect)), float(extra)))
    dist.destroy_process_group()


def test_flat_gradient_average_matches_per_tensor_and_carries_the_loss():
    assert spawn_gloo(_reduce, 2) == [(0, True, 3.0), (1, True, 3.0)]


def test_watch_thread_asks_for_an_abort_at_once_when_membership_moves():
    """The NCCL release path: a survivor stuck in a collective is freed by aborting its
    communicator as soon as the supervisor publishes a new generation (no NCCL here, so the
    call that asks for the abort is observed; whether to abort is the worker's, see
    test_steploop)."""
    from checkpointless.worker.group import Watch
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set(protocol.GEN, "0")
    calls = []
    watch = Watch("127.0.0.1", store.port, lambda: 0, lambda g: calls.append((g, time.time())))
    watch.start()
    time.sleep(0.3)
    assert calls == [] and not watch.moved(0)
    t0 = time.time()
    membership.publish(store, membership.Plan(gen=1, world_size=1, ranks={0: 0}))
    deadline = time.time() + 3
    while not calls and time.time() < deadline:
        time.sleep(0.01)
    assert watch.moved(0) and [g for g, _ in calls] == [1]
    assert calls[0][1] - t0 < 0.2  # at once, not at a poll or a timeout
    membership.publish(store, membership.Plan(gen=2, world_size=1, ranks={0: 0}))
    while len(calls) < 2 and time.time() < deadline + 3:
        time.sleep(0.01)
    watch.stop()
    assert [g for g, _ in calls] == [1, 2]


def test_unflatten_without_copy_views_aligned_tensors_and_copies_misaligned_ones():
    s = {"a": torch.arange(3, dtype=torch.int8), "b": torch.randn(5), "c": torch.arange(4.0)}
    skeleton, flat = transfer.flatten_state(s)
    got = transfer.unflatten_state(skeleton, flat, copy=False)
    assert _equal(got, s)
    assert got["a"].data_ptr() == flat.data_ptr()  # a view: no copy of a received buffer
    assert got["b"].data_ptr() != flat.data_ptr() + 3  # float32 at byte 3 cannot be a view
    assert _equal(transfer.unflatten_state(skeleton, flat), s)


def test_protecting_a_model_in_torchs_ddp_wrapper_is_refused_with_the_fix():
    from checkpointless.protocol import Spec
    from checkpointless.worker.state import ProtectedState
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        with pytest.raises(TypeError, match="job.all_reduce_grads"):
            ProtectedState(Spec()).protect(model=ddp)
        outer = torch.nn.Sequential(ddp)  # found inside a protected model too
        with pytest.raises(TypeError, match="DistributedDataParallel"):
            ProtectedState(Spec()).protect(model=outer)
        ProtectedState(Spec()).protect(model=torch.nn.Linear(4, 4))  # the bare model is fine
    finally:
        dist.destroy_process_group()


def test_the_params_checksum_sees_one_flipped_bit_and_the_odd_rank_is_named():
    from checkpointless.worker import consistency
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2).to(torch.bfloat16))
    before = consistency.params_checksum([model])
    consistency.flip_a_bit([model])
    assert consistency.params_checksum([model]) != before
    assert consistency.judge([5, 5, 5], 0, 3) == []
    assert consistency.judge([5, 7, 5], 0, 3) == [1]
    with pytest.raises(consistency.Diverged, match="rank 1's parameters differ"):
        consistency.judge([5, 7, 5], 1, 3)
    with pytest.raises(consistency.NoMajority):
        consistency.judge([5, 7], 0, 3)


def test_frozen_parameters_are_not_sent_when_every_worker_rebuilds_them():
    from checkpointless import protocol
    from checkpointless.worker.state import ProtectedState

    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        m[0].requires_grad_(False)  # a frozen base
        return m

    src, dst = model(), model()
    with torch.no_grad():
        src[1].weight.add_(1.0)
    sent = ProtectedState(protocol.Spec())
    sent.send_frozen = False
    sent.protect(model=src)
    state = sent.state()
    assert sorted(state["model"]) == ["1.bias", "1.weight"]  # the trainable part only
    got = ProtectedState(protocol.Spec())
    got.send_frozen = False
    got.protect(model=dst)
    got.load(state)
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(),
                                                 dst.state_dict().values()))
    del state["model"]["1.bias"]
    with pytest.raises(RuntimeError, match="lacks"):
        got.load(state)
