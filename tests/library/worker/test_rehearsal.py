"""The replay rehearsal and the redo check (checkpointless/worker/rehearsal.py), in one process on
the step-boundary harness of test_steploop.py: a real store, a real one-rank gloo group, the
supervisor's part played by the test.

A loop whose step is a function of the protected state and the step passes and keeps its bits; a
loop that draws its next batch inside the step (a prefetch), or keeps an unprotected scheduler,
is caught with what differed; strict stops; a failure during the rehearsal leaves the bits
alone; a survivor that recomputes a step after a recovery compares it with what it had."""
from __future__ import annotations

import json

import pytest
import torch

from checkpointless import protocol
from checkpointless.protocol.replay import judge, say
from checkpointless.worker import grads as grads_mod
from checkpointless.worker.ddp import DistributedDataParallel
from checkpointless.worker.failures import PeerLost
from checkpointless.worker.rehearsal import ReplayMismatch
from tests.library.worker.test_steploop import JOBS, Supervisor, _bits, _job, _same, sup  # noqa: F401


def _loop(job, steps: int, prefetch=False, scheduler=False, fail=None, ddp=False):
    """A tiny model trained `steps` steps. prefetch: the batch of the next step is drawn inside
    this one (the most-copied GPT scripts' shape). scheduler: a StepLR stepped every step and not
    protected. fail(job, step, where): may break a step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = DistributedDataParallel(model) if ddp else model
    job.protect(model=wrapped, optimizer=opt)
    # a warm-up schedule by its own counter, as transformers' get_*_schedule_with_warmup build
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1 / (1 + n)) if scheduler else None
    x = torch.randn(8, 4)
    for step in job.steps(steps):
        with job.step():
            if not prefetch:
                x = torch.randn(8, 4)  # seeded per step: a redone step draws the same batch
            loss = wrapped(x).pow(2).mean()
            if prefetch:
                x = torch.randn(8, 4)  # the next step's batch, drawn in this one
            opt.zero_grad()
            loss.backward()
            if fail:
                fail(job, step, "reduce")
            if not ddp:
                job.all_reduce_grads(model.parameters())
            opt.step()
            if sched:
                sched.step()
    return model


def _run(sup, **kw):
    spec = {k: kw.pop(k) for k in ("replay_check",) if k in kw}
    job = _job(sup, **spec)
    model = _loop(job, 5, **kw)
    verdict = protocol.read_json(sup.store, protocol.REPLAY)
    job.finish()
    return job, _bits(model), verdict


def test_a_replayable_step_passes_the_rehearsal_and_keeps_its_bits(sup):
    job, bits, verdict = _run(sup)
    assert verdict["replayable"] is True and verdict["checked_at_step"] == 1
    assert verdict["mismatches"] == []
    assert job.replay["replayable"] is True
    s2 = Supervisor()
    try:
        _, off, none = _run(s2, replay_check="off")
    finally:
        JOBS.clear()
    assert none is None  # off: nothing rehearsed, nothing said
    assert _same(bits, off)  # the rehearsal leaves a replayable run's bits as they were


def test_the_ddp_wrapper_passes_the_rehearsal(sup):
    _, _, verdict = _run(sup, ddp=True)
    assert verdict["replayable"] is True


def test_a_prefetching_loop_is_caught_with_what_differed(sup, capsys):
    job, _, verdict = _run(sup, prefetch=True)
    assert verdict["replayable"] is False
    whats = {m["what"] for m in verdict["mismatches"]}
    assert "params" not in whats and {"output", "grads", "state"} <= whats
    assert "prefetch" in verdict["reason"]
    assert job.completed_steps == 5  # warn: the run goes on
    err = capsys.readouterr().err
    assert err.count("replay check FAILED at step 1") == 1 and "model's output" in err


def test_an_unprotected_scheduler_is_caught_as_state_outside_protect(sup):
    _, _, verdict = _run(sup, scheduler=True)
    assert verdict["replayable"] is False
    assert [m["what"] for m in verdict["mismatches"]] == ["state"]  # same output, same grads
    assert verdict["objects"] == ["optimizer"]  # its learning rate, set by the scheduler
    assert "scheduler" in verdict["reason"]


def test_strict_stops_the_run_at_the_rehearsed_step(sup):
    job = _job(sup, replay_check="strict")
    with pytest.raises(ReplayMismatch, match="replay_check=strict"):
        _loop(job, 5, prefetch=True)
    assert job.completed_steps == 2  # the rehearsed step committed, nothing after it
    assert sup.store.check([protocol.REPLAY_STOP])
    assert protocol.read_json(sup.store, protocol.REPLAY)["replayable"] is False


@pytest.mark.parametrize("attempt", [1, 2])
def test_a_failure_during_the_rehearsal_ends_it_unchecked_and_the_bits_stay(sup, attempt):
    """A peer lost in either attempt of the rehearsed step, before the update: the recovery
    redoes the step as always, the rehearsal is over (not checked), the bits are those of the
    run without the failure."""
    s2 = Supervisor()
    try:
        _, clean, _ = _run(s2, replay_check="off")
    finally:
        JOBS.clear()
    seen = []

    def fail(job, step, where):
        if step == 1 and len(seen) < attempt:
            seen.append(job.rehearsing)
            if len(seen) == attempt:
                sup.lose_a_worker()
                raise PeerLost("a peer died in the all-reduce")

    job = _job(sup)
    model = _loop(job, 5, fail=fail)
    assert seen[0] is True and (attempt == 1 or seen[1] is False)
    assert job.gen == 1 and job.completed_steps == 5
    assert _same(_bits(model), clean)
    finding = protocol.read_json(sup.store, protocol.replay_rank_key(0))
    assert finding["differs"] is None and "cut" in finding["why"]
    assert not sup.store.check([protocol.REPLAY])
    job.finish()


def test_the_redo_check_sees_a_recomputed_step_differ_from_the_one_before_the_failure(
        sup, monkeypatch, capsys):
    """A survivor whose reduction a peer's failure cut short kept its gradients; its loop (a
    prefetching one, which recomputes) redoes the step on another batch: said and recorded."""
    real, cut = grads_mod.all_reduce_grads, []

    def reduce(params, world, extra=None, group=None):
        if job.completed_steps == 3 and not cut:
            cut.append(3)
            sup.lose_a_worker()
            raise PeerLost("a peer died in the all-reduce")
        return real(params, world, extra, group)

    monkeypatch.setattr(grads_mod, "all_reduce_grads", reduce)
    job = _job(sup, replay_check="off")  # the rehearsal would have caught it first
    _loop(job, 5, prefetch=True)
    assert cut == [3] and job.gen == 1
    assert sup.store.add(protocol.REPLAY_REDO, 0) == 1
    redo = json.loads(sup.store.get(protocol.replay_redo_key(1)))
    assert redo == {"step": 3, "rank": 0, "what": "gradients"}
    assert "redid step 3 after a recovery" in capsys.readouterr().err
    job.finish()


def test_the_redo_check_is_silent_when_the_redone_step_is_the_same(sup, monkeypatch):
    real, cut = grads_mod.all_reduce_grads, []

    def reduce(params, world, extra=None, group=None):
        if job.completed_steps == 3 and not cut:
            cut.append(3)
            sup.lose_a_worker()
            raise PeerLost("a peer died in the all-reduce")
        return real(params, world, extra, group)

    monkeypatch.setattr(grads_mod, "all_reduce_grads", reduce)
    job = _job(sup)
    _loop(job, 5)
    assert cut == [3] and sup.store.add(protocol.REPLAY_REDO, 0) == 0
    job.finish()


def test_the_verdict_says_what_was_not_checked_and_why():
    found = [{"step": 1, "rank": 0, "differs": [], "objects": []},
             {"step": 1, "rank": 1, "differs": None, "why": "a failure cut it short"}]
    v = judge(found, 2, "warn")
    assert v["replayable"] is None and "cut it short" in v["reason"]
    assert judge(found[:1], 2, "warn")["replayable"] is None  # a rank missing: not checked
    bad = judge([{"step": 1, "rank": 1, "differs": ["grads", "state"], "objects": ["model"]}],
                1, "strict")
    text = say(bad)
    assert "rank(s) 1" in text and "nondeterministic" in text and "run stops here" in text


def test_a_loop_whose_steps_never_open_is_said_unchecked_not_passed(sup):
    """`job.steps()` without `with job.step()`: nothing is kept before the body, so nothing can
    be run again; the report must not say the step was checked."""
    job = _job(sup)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    job.protect(model=model, optimizer=opt)
    for _ in job.steps(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        job.all_reduce_grads(model.parameters())
        opt.step()
    finding = protocol.read_json(sup.store, protocol.replay_rank_key(0))
    assert finding["differs"] is None and "do not open" in finding["why"]
    from checkpointless.protocol.replay import replay_report
    assert replay_report(sup.store, 1, "warn")["replayable"] is None
    job.finish()


def test_a_failure_between_the_two_attempts_ends_the_rehearsal_everywhere(sup):
    """The first attempt ended cleanly and a peer was lost before the second opened: the
    rehearsal is over (unchecked, its copy freed) and `rehearsing` is False from then on, as on
    a replacement that never rehearsed (a loop that skips a checkpoint while it is True must not
    skip it on some ranks only)."""
    job = _job(sup)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    job.protect(model=model, optimizer=opt)
    loop, seen, lost = job.steploop, [], []
    loop.start()
    while (step := loop.next()) < 4:
        if not loop.ready(step):
            continue
        loop.open(step)
        seen.append((step, job.rehearsing))
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        job.all_reduce_grads(model.parameters())
        opt.step()
        if not loop.close() and step == 1 and not lost:  # the first attempt ended cleanly
            lost.append(step)
            sup.lose_a_worker()  # lost before the second attempt opens
    assert lost == [1] and loop.generation == 1
    assert seen[:2] == [(0, False), (1, True)] and all(not r for _, r in seen[2:]), seen
    finding = protocol.read_json(sup.store, protocol.replay_rank_key(0))
    assert finding["differs"] is None and "between" in finding["why"]
    assert loop.rehearsal._snapshot is None
    job.finish()


def test_a_body_that_takes_from_its_batch_finds_it_whole_when_run_again():
    """job.batches(): each attempt of a step gets its own dict (a `batch.pop("labels")` in the
    first does not take the labels from the second)."""
    from torch.utils.data import DataLoader
    from checkpointless.worker.data import Cursor
    loader = DataLoader([{"x": torch.tensor(float(i)), "labels": torch.tensor(i)}
                         for i in range(4)], batch_size=2)
    cur = Cursor(loader)
    first = cur.batch(0)
    first.pop("labels")
    again = cur.batch(0)
    assert set(again) == {"x", "labels"} and torch.equal(again["x"], torch.tensor([0.0, 1.0]))


def test_the_put_back_keeps_a_loops_pending_move_and_a_state_too_big_is_not_copied():
    """The drop-in's move to the next epoch waits in its position's `pending` (not part of its
    state) until that epoch's first step commits: putting the state back keeps it. A state
    whose copy would not fit in the node's free memory is not copied: said unchecked."""
    from checkpointless.worker.data import Position
    from checkpointless.worker.grads import KeptGrads
    from checkpointless.worker.rehearsal import Rehearsal, _host_short
    from checkpointless.worker.state import ProtectedState

    class Store:
        def __init__(self):
            self.kv = {}

        def set(self, k, v):
            self.kv[k] = v

    state, pos = ProtectedState(protocol.Spec()), Position()
    state.protect(loop=pos)
    r = Rehearsal("warn", state, KeptGrads(), Store())
    r.plan(0, 0)
    pos.pending = (1, 1)  # epoch 0 ended at step 1's start: epoch 1 waits for its first commit
    r.open(1, 0)
    assert r.rehearsing
    assert r.close(1, 0, failed=False, applied=True) == "redo"
    assert pos.pending == (1, 1) and not r.rehearsing
    assert _host_short({"w": torch.zeros(1000)}, workers_per_node=1) is None
    assert "would not fit" in _host_short({"w": torch.zeros(1000)}, workers_per_node=10 ** 12)
