"""Peer replicas of sharded state: choosing the step to roll back to and who serves each slice."""
import pytest
import torch

from checkpointless.worker.redundancy import ShardReplicas
from checkpointless.worker.restore import pick_holders, restorable_step
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
    from checkpointless.worker.group import side_group
    return lambda: side_group("127.0.0.1", port, gen, rank, world, timeout_s)


def _exchange(rank, port, q):
    rep = ShardReplicas(factor=2)
    for step in (3, 4, 5, 6):
        rep.replicate(step, {"w": torch.full((rank + 2,), float(rank * 10 + step))}, rank, 3,
                      gen=0, connect=_side(port, 0, rank, 3))
    rep.wait()
    src = rep.sources_for(rank, 3)[0]
    from checkpointless.worker.transfer import unflatten_state
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


class _Done:
    def __init__(self, then=None):
        self.then = then

    def wait(self):
        if self.then is not None:
            self.then()
        return True


class _PeerInProcess:
    """The side group seen from rank 1 of 2: rank 0's messages are prepared by a ShardReplicas of
    its own; the payload of `gated` arrives only when `gate` opens, and half of it then, if
    `cut` is set, before the connection breaks."""

    def __init__(self, peer: ShardReplicas, gated: int, gate, cut: bool):
        self.peer, self.gated, self.gate, self.cut = peer, gated, gate, cut
        self.step = None

    def send(self, tensors, dst, tag):
        if tensors[0].numel() == 4:  # my header: both sides exchange the same step
            self.step = int(tensors[0][0])
        return _Done()

    def recv(self, tensors, src, tag):
        (t,) = tensors
        if t.numel() == 4:  # the header: rank 0's step, sizes and checksum
            skel, flat = self.peer.own[self.step]
            total = self.peer.sums.sums[("own", self.step)]
            t.copy_(torch.tensor([self.step, flat.numel(), len(skel), total]))
            return _Done()
        skel, flat = self.peer.own[self.step]
        message = torch.cat([flat, torch.frombuffer(bytearray(skel), dtype=torch.uint8)])

        def arrive():
            if self.step == self.gated:
                self.gate.wait(30)
                if self.cut:
                    t[:t.numel() // 2].copy_(message[:t.numel() // 2])
                    raise RuntimeError("Connection reset by peer")
            t.copy_(message)
        return _Done(arrive)


@pytest.mark.parametrize("cut", [False, True])
def test_a_version_is_restorable_only_once_every_byte_arrived(cut):
    import threading
    from checkpointless.worker.failures import PeerLost
    from checkpointless.worker.transfer import unflatten_state
    peer, me, gate = ShardReplicas(factor=2), ShardReplicas(factor=2), threading.Event()
    group = _PeerInProcess(peer, gated=7, gate=gate, cut=cut)
    for step in (5, 6, 7):
        peer.snapshot(step, {"w": torch.arange(4.0) + 100 * step})  # rank 0's slice at step
        me.replicate(step, {"w": torch.full((3,), float(step))}, rank=1, world=2,
                     connect=lambda: group)
    assert not me.wait(timeout_s=0.2)  # step 7's copy is still arriving
    # rank 0 is lost now: its slice at 7 is half here, so the newest restorable step is 6
    spare, alive = info(-1, [], {}), {"completed": 7, **me.summary()}
    assert alive["held"] == {"0": [5, 6]} and alive["own"] == [5, 6, 7]
    assert restorable_step([spare, alive]) == 6
    gate.set()
    if cut:
        with pytest.raises(PeerLost, match="step 7"):
            me.wait()
        assert me.summary()["held"] == {"0": [5, 6]}  # the torn copy never counts
    else:
        assert me.wait()
        assert me.summary()["held"] == {"0": [5, 6, 7]}
    skel, flat = me.held[0][6]
    assert torch.equal(unflatten_state(skel, flat)["w"], torch.arange(4.0) + 600)  # bit-exact


def test_an_abandoned_exchange_commits_nothing():
    import threading
    peer, me, gate = ShardReplicas(factor=2), ShardReplicas(factor=2), threading.Event()
    group = _PeerInProcess(peer, gated=2, gate=gate, cut=False)
    for step in (1, 2):
        peer.snapshot(step, {"w": torch.ones(2) * step})
        me.replicate(step, {"w": torch.zeros(2)}, rank=1, world=2, connect=lambda: group)
    me.abandon()  # a recovery begins while step 2's copy is in flight
    gate.set()
    import time
    time.sleep(0.2)
    assert me.summary()["held"] == {"0": [1]}
    assert me.wait()  # nothing in flight belongs to this generation any more


def _first_exchange_of_a_generation(rank, port, q):
    """Generation 0: three ranks exchange, then rank 2 dies in the middle of an exchange (after
    the headers). Generation 1: rank 2's replacement never arrives, so the survivors' new side
    group cannot even form. Neither may hold a survivor longer than the failure takes to be seen;
    the side group's own timeout is 60 s."""
    import os
    import time
    from checkpointless.worker.failures import MembershipMoved, PeerLost
    rep = ShardReplicas(factor=2)
    def die(r, step):
        if step == 2:
            q.put((9, "died"))  # spawn_gloo waits for one message per rank
            q.close()
            q.join_thread()
            os._exit(0)
    if rank == 2:
        rep.on_exchange = die
    state = {"w": torch.full((1 << 18,), float(rank))}  # 1 MB: more than a socket buffer
    for step in (0, 1, 2):
        rep.replicate(step, state, rank, 3, gen=0, connect=_side(port, 0, rank, 3))
    t0 = time.time()
    try:
        rep.wait()
        lost = None
    except PeerLost:
        lost = time.time() - t0
    held = sorted(rep.held.get(rep.sources_for(rank, 3)[0], {}))
    rep.abandon()  # what a recovery does first
    # generation 1, where the supervisor publishes its next plan 1 s after the exchange began
    rep.replicate(3, state, rank, 3, gen=1, connect=_side(port, 1, rank, 3))
    t1 = time.time()
    try:
        rep.replicate(4, state, rank, 3, gen=1, connect=_side(port, 1, rank, 3),
                      moved=lambda: time.time() > t1 + 1.0)
        moved = None
    except MembershipMoved:
        moved = time.time() - t1
    t2 = time.time()
    rep.abandon()
    q.put((rank, lost, held, moved, time.time() - t2))


@pytest.mark.slow
def test_a_peer_lost_in_any_exchange_never_holds_a_survivor_for_the_timeout():
    got = spawn_gloo(_first_exchange_of_a_generation, 3, timeout=90)[:2]  # rank 2 died
    (r0, lost0, held0, moved0, abandon0), (r1, lost1, held1, moved1, abandon1) = got
    # rank 0 receives rank 2's slice: the torn copy of step 2 is not kept, and it knew at once
    assert r0 == 0 and lost0 is not None and lost0 < 5 and held0 == [0, 1]
    # rank 1 sends to rank 2: its exchange fails too (at once) unless the kernel took the whole
    # message; the copy from rank 0 counts only if rank 1's whole exchange finished
    assert r1 == 1 and (lost1 is not None and lost1 < 5 and held1 == [0, 1] or
                        lost1 is None and held1 == [0, 1, 2])
    for moved, abandon in ((moved0, abandon0), (moved1, abandon1)):
        assert moved is not None and 0.9 < moved < 5  # released by the new plan, not a timeout
        assert abandon < 0.5


class _Sliced:
    """The ProtectedState a sharded restore reads: one slice `w`, its replicas, no modules."""

    def __init__(self, replicas: ShardReplicas, w: torch.Tensor):
        self.replicas, self.w = replicas, w

    def state(self):
        return {"w": self.w}

    def load(self, state):
        self.w = state["w"].clone()

    def modules(self):
        return []

    def twins(self, world):
        return None

    def layout_for(self, world, rank):  # as ProtectedState's, for a 1-D cut
        return world, rank, 1

    def zero_grads(self):
        pass


def test_a_roll_back_cut_by_a_lost_receiver_leaves_the_member_counting_the_step_it_is_at(
        monkeypatch):
    """Rank 2 of 3 completed 7 steps; rank 1 is a spare, whose slice exists only as rank 2's
    copy of step 6. The restore picks step 6: rank 2 rolls back to its snapshot of 6, then
    its send of the copy fails (the spare died). Its state is step 6's from the roll-back on,
    so it must count 6, not 7: a next restore at 7 would otherwise keep step 6's state as 7's
    (with no snapshot of 7 to roll back to), and the replicas would silently disagree."""
    from checkpointless.worker import restore as restore_mod
    from checkpointless.worker.failures import PeerLost
    reps = ShardReplicas(factor=2)
    for step in (5, 6):
        reps.snapshot(step, {"w": torch.full((2,), float(step))})
    theirs = ShardReplicas(factor=2)
    theirs.snapshot(6, {"w": torch.full((2,), 60.0)})
    reps.held[1] = {6: theirs.own[6]}  # rank 2 holds rank 1's slice at 6
    said = [info(7, [6, 7], {}), {**info(-1, [], {}), "built": False}, None]

    def gather(out, mine):
        out[:] = said[:2] + [mine]
    monkeypatch.setattr(restore_mod.dist, "all_gather_object", gather)

    def lost(*_, **__):
        raise PeerLost("rank 1 is gone")
    monkeypatch.setattr(restore_mod.transfer, "send_state", lost)
    state, at = _Sliced(reps, torch.full((2,), 7.0)), []
    me = restore_mod.Position(rank=2, world_size=3, completed=7, holds_state=True,
                              grads_kept=False)
    with pytest.raises(PeerLost):
        restore_mod.restore(state, me, loaded=at.append)
    assert at == [6] and torch.equal(state.w, torch.full((2,), 6.0))


def test_a_copy_damaged_at_rest_is_dropped_before_any_restore_can_use_it():
    """A bit flipped in host memory, in a held copy or in an own snapshot (scrub.py): the
    summary the members agree from no longer offers that version; the others stay."""
    import threading
    peer, me = ShardReplicas(factor=2), ShardReplicas(factor=2)
    group = _PeerInProcess(peer, gated=-1, gate=threading.Event(), cut=False)
    for step in (5, 6):
        peer.snapshot(step, {"w": torch.arange(4.0) + 100 * step})
        me.replicate(step, {"w": torch.full((3,), float(step))}, rank=1, world=2,
                     connect=lambda: group)
        assert me.wait()
    assert me.summary() == {"own": [5, 6], "held": {"0": [5, 6]}}
    me.held[0][6][1][3] ^= 4  # one bit of the copy of rank 0's slice at step 6
    me.own[5][1][0] ^= 1  # one bit of this rank's own snapshot of step 5
    assert me.summary() == {"own": [6], "held": {"0": [5]}}
    assert me.sums.dropped == 2
