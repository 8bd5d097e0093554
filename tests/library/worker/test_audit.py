"""Audits by replay (checkpointless/worker/audit.py, auditor.py), in-process on plain torch: the
digest, the sampling, the judgment, and a spare's server judging shipped steps over a real store
and a real socket (a wrong gradient found, a right one passed)."""
from __future__ import annotations

import json
import os
import time
from datetime import timedelta

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.distributed as dist

from checkpointless import protocol
from checkpointless.worker.audit import (GradTap, audited, checksum, flip_bit, judge,
                                         rewind_bound)
from checkpointless.worker.auditor import AuditServer
from checkpointless.worker.audit_rank import RankAudits


def test_checksum_sees_every_flipped_bit_and_ignores_order():
    g = torch.randn(64, 32)
    base = int(checksum(g))
    for bit in range(32):
        assert int(checksum(flip_bit(g, bit))) != base, bit
    parts = [g[:10], g[10:40], g[40:]]
    forward = sum(int(checksum(p)) for p in parts)
    assert forward == sum(int(checksum(p)) for p in reversed(parts)) == base
    assert int(checksum(g.to(torch.bfloat16))) != int(checksum(flip_bit(g.to(torch.bfloat16))))


def test_sampling_covers_every_rank_once_a_round_in_an_order_drawn_per_round():
    world, every = 4, 3
    seen = [audited(s, every, world) for s in range(0, every * world * 6)]
    picked = [x for x in seen if x is not None]
    assert len(picked) == 24 and all(s % every == 0 for s, x in enumerate(seen) if x)
    rounds = [sorted(r for r, _ in picked[i:i + world]) for i in range(0, 24, world)]
    assert all(r == [0, 1, 2, 3] for r in rounds)
    assert len({tuple(r for r, _ in picked[i:i + world]) for i in range(0, 24, world)}) > 1
    assert all(w == (r + 1) % world for r, w in picked)
    assert audited(5, 0, 4) is None and audited(3, 1, 1) is None
    # a fault every 4 steps is met by an audit of its rank, whatever its phase
    for phase in range(4):
        assert any(audited(s, 1, 4)[0] == 2 for s in range(phase, 200, 4))


def test_judgment_needs_a_third_computation():
    assert judge(7, 7, None, None) == "ok"
    assert judge(7, 8, None, None) == "undecided"
    assert judge(7, 8, 5, 5) == "audited"  # the witness agrees with the spare: audited is wrong
    assert judge(7, 8, 5, 6) == "auditor"  # neither agrees: the spare doubts itself
    assert rewind_bound(None) == 0 and rewind_bound(-1) == 0 and rewind_bound(10) == 11


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 16),
                               torch.nn.GELU(), torch.nn.Linear(16, 50))


def _step(model, step, rank, micro_batches=2):
    for micro in range(micro_batches):
        torch.manual_seed(1000 * step + 10 * rank + micro)
        x = torch.randint(0, 50, (4, 8))
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 50), x.reshape(-1))
        (loss / micro_batches).backward()


def _tapped(model, step, rank, flip=False, capture=False):
    tap = GradTap(model)
    tap.arm(step, capture=capture, flip=flip)
    _step(model, step, rank)
    out = tap.digests(), dict(tap.params), tap.flipped
    tap.disarm()
    model.zero_grad(set_to_none=True)
    return out


def test_tap_digest_is_a_function_of_state_and_batch_and_sees_a_flip():
    (g1, p1), params, _ = _tapped(_model(), 3, 1, capture=True)
    (g2, p2), _, _ = _tapped(_model(), 3, 1)
    assert (g1, p1) == (g2, p2)
    assert sorted(params) == ["0.weight", "1.bias", "1.weight", "3.bias", "3.weight"]
    (g3, _), _, flipped = _tapped(_model(), 3, 1, flip=True)
    assert flipped is not None and g3 != g1
    (g4, _), _, _ = _tapped(_model(), 3, 2)  # another rank's batch
    assert g4 != g1
    m = _model()
    tap = GradTap(m)
    tap.arm(0)
    tap.disarm()
    _step(m, 0, 0)  # disarmed: no hook left behind on the parameters
    assert tap.digests() is None


class _Replay:
    """What the loop gives a spare: a whole model, and a rank's step on it."""

    def __init__(self, bad_auditor=False, seed=99):
        self.bad, self.seed = bad_auditor, seed

    def model(self):  # seed 99: other values than the job's, which shipped ones must replace
        return _model(seed=self.seed)

    def replay(self, model, step, rank, world):
        hook = next(model.parameters()).register_hook(flip_bit) if self.bad else None
        _step(model, step, rank)  # bad: this spare's own hardware computes wrong
        if hook is not None:
            hook.remove()


@pytest.fixture()
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    yield server
    del server


def _connect(store):
    return lambda: dist.TCPStore("127.0.0.1", store.port, is_master=False,
                                 timeout=timedelta(seconds=30))


def _run_audit(store, step, sdc_rank=None, bad_auditor=False, last_pass=None, gen=0,
               order=range(4), late=None):
    """Ranks 0..3 of a job at `step` (their audited rank and witness tap, publish, ship, in
    `order`), and a spare's server judging; returns once it judged."""
    store.set(protocol.FIRST_STEP, "5")  # a launch resumed at step 5: no burn-in
    server = AuditServer(_connect(store), "127.0.0.1", store.port, 9, _Replay(bad_auditor))
    server.start()
    if last_pass is not None:
        store.set(protocol.audit_pass_key(audited(step, 1, 4)[0]), str(last_pass))
    try:
        state = _model().state_dict()
        for rank in order:
            model = _model()
            model.load_state_dict(state)
            ranks = RankAudits(store, 100 + rank, 1, _connect(store), log=lambda *a, **k: None)
            ranks.install([model], protocol.parse_faults([] if sdc_rank is None else ["sdc:0:0"]))
            ranks.open(step, rank, 4, sdc=rank == sdc_rank)
            _step(model, step, rank)
            if rank == late:
                time.sleep(1.0)
            ranks.close(step, rank, 4, gen=gen, committed=True)
        deadline = time.time() + 30
        while not store.check([protocol.AUDIT_DONE]) or \
                int(store.get(protocol.AUDIT_DONE)) < step:
            assert time.time() < deadline, "the spare did not judge the step"
            time.sleep(0.05)
    finally:
        server.stop()


STEP = 6
RANK = audited(STEP, 1, 4)[0]  # the rank audited at STEP (its witness: the next one)


def test_a_right_step_passes(store):
    _run_audit(store, STEP)
    assert int(store.get(protocol.audit_pass_key(RANK))) == STEP
    assert store.add(protocol.SDC, 0) == 0


def test_a_wrong_gradient_is_found_and_judged_by_the_witness(store):
    _run_audit(store, STEP, sdc_rank=RANK, last_pass=2)
    assert store.add(protocol.SDC, 1) == 2
    finding = json.loads(store.get(protocol.sdc_key(100 + RANK)))
    assert finding["rank"] == RANK and finding["step"] == STEP
    assert finding["last_passed"] == 2 and finding["rewind_to"] == 3


def test_a_step_redone_after_a_rewind_is_judged_against_its_own_digest(store):
    """After a rewind the job redoes steps: the audited rank's key still holds its digest of
    the step from before the rewind (other parameters, other gradients) when the witness ships
    the redone step. The spare waits for the redone step's digest and passes it; judged against
    the old one, a healthy rank was accused (seen in CI)."""
    old = {"grads": 1, "params": 2, "wid": 100 + RANK, "gen": 0, "world": 4}  # other state
    store.set(protocol.audit_digest_key(STEP, RANK), json.dumps(old))
    witness_first = [r for r in range(4) if r != RANK] + [RANK]  # it publishes a second late
    _run_audit(store, STEP, gen=1, order=witness_first, late=RANK)
    assert int(store.get(protocol.audit_pass_key(RANK))) == STEP
    assert store.add(protocol.SDC, 0) == 0


def test_an_auditor_agreeing_with_nobody_accuses_nobody(store):
    _run_audit(store, STEP, bad_auditor=True)
    assert store.add(protocol.SDC, 0) == 0
    record = json.loads(store.get(protocol.health_key(9)))
    assert not record["ok"] and "agrees with neither" in record["problems"][0]
    assert store.get(protocol.auditor_key(0)) == b""


def test_the_sdc_fault_parses_and_refuses_what_it_cannot_be():
    from checkpointless.protocol import Fault, parse_fault
    assert parse_fault("sdc:2:12") == Fault("sdc", 2, 12)
    assert parse_fault("sdc:2:12:3").every == 3
    with pytest.raises(ValueError, match="every=0 must be >= 1"):
        parse_fault("sdc:2:12:0")
    with pytest.raises(ValueError, match="cannot strike @backward"):
        parse_fault("sdc:2:12@backward")
    with pytest.raises(ValueError, match="for kind=sdc only"):
        Fault("kill", 1, 2, every=2)


@pytest.mark.parametrize("override,says", [
    ("checkpointless.spares=0", "replayed by idle spares"),
    ("checkpoint.interval=0", "durable checkpoint known clean"),
    ("distributed.strategy=fsdp trainer.precision=bf16", "bit for bit"),
])
def test_audits_are_refused_before_launch_where_they_cannot_work(override, says):
    from launcher.recipe.load import RecipeError, load
    base = ["checkpointless.audit.every=1", "checkpoint.interval=5"]
    with pytest.raises(RecipeError, match=says) as err:
        load("tiny-llama", base + override.split())
    assert "checkpointless.audit.every=1" in str(err.value)
    assert load("tiny-llama", base).checkpointless.audit.every == 1


@pytest.mark.parametrize("bad", [False, True])
def test_a_spare_burns_in_on_step_0_before_it_audits(store, bad):
    """Rank 0's step 0 of the launch, replayed on the spare's own build: a spare that computes
    it wrong is marked unhealthy (never promoted) and never offers to audit."""
    store.set(protocol.FIRST_STEP, "0")
    ranks = RankAudits(store, 100, 1, _connect(store), log=lambda *a, **k: None)
    model = _model()
    ranks.install([model], [])
    ranks.open(0, 0, 4, sdc=False)
    _step(model, 0, 0)
    ranks.close(0, 0, 4, gen=0, committed=True)
    server = AuditServer(_connect(store), "127.0.0.1", store.port, 9, _Replay(bad, seed=0))
    server.start()
    try:
        deadline = time.time() + 30
        while store.get(protocol.auditor_key(0)) == b"" and \
                not store.check([protocol.health_key(9)]):
            assert time.time() < deadline
            time.sleep(0.05)
        if bad:
            assert "burn-in" in json.loads(store.get(protocol.health_key(9)))["problems"][0]
            assert store.get(protocol.auditor_key(0)) == b""
        else:
            assert json.loads(store.get(protocol.auditor_key(0)))["wid"] == 9
    finally:
        server.stop()


def _rewind(rank, port, q):
    """Three members, one a spare holding nothing, agree on the newest checkpoint at or before
    the bound (rank 2's disk lacks step 8), load it, and drop the ones written after it."""
    from checkpointless.protocol import Spec
    from checkpointless.worker import restore
    from checkpointless.worker.state import ProtectedState
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=3)
    try:
        disk = {0: [4, 8, 12], 1: [4, 8, 12], 2: [4, 12]}[rank]
        model = torch.nn.Linear(2, 2)
        state, loaded, dropped = ProtectedState(Spec()), [], []
        state.protect(model=model)

        def newest(at_most=None):
            ok = [s for s in disk if at_most is None or s <= at_most]
            return ok[-1] if ok else None

        def load(step):
            with torch.no_grad():
                model.weight.fill_(step)
            loaded.append(step)
        state.fallback = (newest, load, dropped.append)
        me = restore.Position(rank, 3, 14 if rank else -1, holds_state=rank != 0,
                              grads_kept=False)
        out = restore.restore(state, me, rewind_to=9)
        try:
            restore.restore(state, me, rewind_to=3)
            refused = None
        except RuntimeError as exc:
            refused = str(exc)
        q.put((rank, out.resumed_step, out.info["restored_from"], out.info["steps_redone"],
               loaded, dropped, float(model.weight[0, 0]), refused))
    finally:
        dist.destroy_process_group()


def test_a_rewind_loads_the_newest_checkpoint_every_member_has_at_or_before_the_bound():
    from tests.conftest import spawn_gloo
    got = spawn_gloo(_rewind, 3)
    for rank, step, how, redone, loaded, dropped, value, refused in got:
        assert (step, how, redone, loaded, dropped, value) == \
            (4, "durable_checkpoint", 10, [4], [4], 4.0), rank
        assert "no durable checkpoint that old" in refused


class _Pool:
    def __init__(self):
        self.killed = []

    def kill(self, w):
        self.killed.append(w.wid)


def test_the_supervisor_evicts_the_accused_and_carries_the_rewind_until_a_step_commits(store):
    """The supervisor's loss finder (control/losses.py) over a real store: accused() and
    issue_rewind()."""
    from types import SimpleNamespace
    from checkpointless.control.job_state import JobState
    from checkpointless.control.losses import LossFinder
    pool = _Pool()
    pool.workers = {7: SimpleNamespace(wid=7), 8: SimpleNamespace(wid=8)}
    state = JobState(nproc=2, store=store, gen=3, ranks={7: 2, 8: 3})
    sup = LossFinder(SimpleNamespace(audit_every=1), state, pool, None, None, None)
    accused, issue = sup.accused, sup.issue_rewind
    assert accused([]) == []  # nothing found: one counter read, nothing done
    store.set(protocol.sdc_key(7), json.dumps({"wid": 7, "rank": 2, "step": 14,
                                               "last_passed": 8, "rewind_to": 9, "auditor": 4}))
    store.add(protocol.SDC, 1)
    (lost,) = accused([])
    assert lost[0].wid == 7 and sup.pool.killed == [7]
    assert "wrong gradient at step 14" in json.loads(store.get(protocol.error_key(7)))["error"]
    state.gen = 4
    issue()
    assert json.loads(store.get(protocol.rewind_key(4)))["at_most"] == 9
    state.gen = 5  # generation 4 failed before committing a step: the rewind goes on to 5
    issue()
    assert json.loads(store.get(protocol.rewind_key(5)))["at_most"] == 9
    store.set(protocol.first_commit_key(5, 0), "1")
    state.gen = 6  # generation 5 carried it out and committed: nothing for 6
    issue()
    assert sup.rewind_pending is None and not store.check([protocol.rewind_key(6)])
