"""checkpointless.accelerate.Accelerator, the drop-in for accelerate scripts: real processes, real
kills, same bits.

examples/accelerate_checkpointless.py (accelerate_plain.py with three lines changed) runs under the
supervisor with 2 workers and a hot spare; a worker is SIGKILLed mid-epoch, at an epoch's first
step, or inside an evaluation's gather_for_metrics, and every run must end with the parameters of
the failure-free run and print each epoch's accuracy once, with the failure-free figures. That a
replacement makes no collective call before it receives the state is proven by these runs not
deadlocking (accelerate's barriers and random-state broadcasts would meet nobody).
"""
import difflib
import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT, assert_replayed, assert_same_bits, final_digest, supervised

PLAIN = ROOT / "examples/accelerate_plain.py"
DROPIN = ROOT / "examples/accelerate_checkpointless.py"
EVAL_KILL = ROOT / "tests/support/scripts/accelerate_eval_kill.py"
ENV = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
STEPS = 36  # 3 epochs of 12 steps (192 examples, batches of 8 on 2 ranks)


def _env(**extra):
    return dict(os.environ, **ENV, **extra)


def _code(path):
    lines = path.read_text().splitlines()
    return lines[lines.index('"""', 1) + 1:]  # past the module docstring


def _epochs(stdout: str) -> dict:
    """{epoch: metrics} from the lines `accelerator.print` wrote; each epoch must appear once."""
    found = re.findall(r"epoch (\d+): (\{[^}]*\})", stdout)
    epochs = [int(e) for e, _ in found]
    assert sorted(epochs) == sorted(set(epochs)), f"an epoch's figures were printed twice: {found}"
    return {int(e): json.loads(m) for e, m in found}


def _losses(stdout: str) -> list:
    """The (epoch, batch, loss) lines logged every 5 batches, after a reduce across the ranks;
    each must appear once (a void pass logs nothing), at the batch's true index in its epoch."""
    found = re.findall(r"epoch (\d+) batch (\d+): loss (\S+)", stdout)
    assert len(found) == len(set(found)), f"a batch's loss was logged twice: {found}"
    return sorted((int(e), int(b), l) for e, b, l in found)


def test_the_dropin_changes_three_lines_and_reindents_none():
    changed = [l for l in difflib.unified_diff(_code(PLAIN), _code(DROPIN), lineterm="", n=0)
               if l[:1] in "+-" and l[:3] not in ("+++", "---")]
    assert changed == [
        "-from accelerate import Accelerator",
        "+from checkpointless.accelerate import Accelerator",
        "-    for epoch in range(num_epochs):",
        "+    for epoch in accelerator.epochs(num_epochs):",
        "-        for step, batch in enumerate(train_dataloader):",
        "+        for step, batch in accelerator.enumerate(train_dataloader):",
    ], changed


def test_the_core_library_does_not_import_accelerate_or_transformers():
    r = subprocess.run([sys.executable, "-c", "import sys, checkpointless, checkpointless.worker.job, "
                        "checkpointless.control.supervisor; "
                        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
                        "('accelerate', 'transformers')))"],
                       capture_output=True, text=True, timeout=60, env=_env(), cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])


def test_gradient_accumulation_is_refused_before_joining():
    from checkpointless.accelerate import Accelerator
    with pytest.raises(NotImplementedError, match="gradient accumulation"):
        Accelerator(cpu=True, gradient_accumulation_steps=2)


def _supervised(tmp_path, name, *args, script=(DROPIN,), **extra_env):
    rep = supervised(tmp_path, name, [*script, "--cpu"], *args, nproc=2,
                     env=dict(ENV, **extra_env))
    assert rep["steps_completed"] == STEPS
    return dict(rep, digest=final_digest(rep))


@pytest.fixture(scope="module")
def clean(references):
    """The failure-free run under the supervisor (trained once per session)."""
    rep = references.supervised([DROPIN, "--cpu"], nproc=2, env=ENV)
    assert rep["steps_completed"] == STEPS
    assert_replayed(rep)  # the drop-in's loop passes its own rehearsal
    epochs = _epochs(rep["stdout"])
    assert sorted(epochs) == [0, 1, 2] and epochs[2]["accuracy"] > 0.9  # it learned
    assert [(e, b) for e, b, _ in _losses(rep["stdout"])] == [
        (e, b) for e in range(3) for b in (0, 5, 10)]
    return dict(rep, digest=final_digest(rep))


@pytest.fixture(scope="module")
def killed_twice(tmp_path_factory, clean):
    """One run: rank 1 killed at step 12 (an epoch's first step), then its replacement at step
    17 (mid-epoch), a warm spare ready for each."""
    rep = _supervised(tmp_path_factory.mktemp("kill"), "kill", "--spares", "2",
                      "--fault", "kill:1:12", "--fault", "kill:1:17")
    assert [(r["failed_rank"], r["resumed_step"]) for r in rep["recoveries"]] == [(1, 12),
                                                                                 (1, 17)]
    assert [f["rank"] for f in rep["failures"]] == [1, 1]  # rank 0 never left its process
    assert rep["pids_at_start"]["0"] == rep["pids_at_end"]["0"]
    return rep


@pytest.mark.slow
@pytest.mark.parametrize("step", [17, 12], ids=["mid-epoch", "first-step-of-an-epoch"])
def test_a_worker_killed_in_a_training_step_is_replaced_with_the_same_bits(killed_twice, clean,
                                                                          step):
    rep = killed_twice
    assert_same_bits(rep, clean)
    (rec,) = [r for r in rep["recoveries"] if r["failed_at_step"] == step]
    assert rec["failed_rank"] == 1 and rec["cause"] == "exit" and rec["resumed_step"] == step
    assert "a peer was lost during backward" in rep["stderr"]
    # every epoch's evaluation printed once, with the failure-free figures: at an epoch's first
    # step the survivors had finished the evaluation before it, and it is not run again
    assert _epochs(rep["stdout"]) == _epochs(clean["stdout"])
    assert _losses(rep["stdout"]) == _losses(clean["stdout"])


@pytest.mark.slow
def test_a_worker_killed_during_an_evaluation_is_replaced_with_the_same_bits(tmp_path, clean):
    """Rank 0 (the one that prints) dies inside its 6th gather_for_metrics: the 2nd batch of
    epoch 1's evaluation, after that epoch's last step. The survivor's gather fails, the rest of
    its evaluation is void; the spare takes rank 0 and the evaluation runs again on both."""
    rep = _supervised(tmp_path, "eval", "--spares", "1", script=(EVAL_KILL, DROPIN),
                      EVAL_KILL="0:6", EVAL_KILL_MARKER=str(tmp_path / "fired"))
    assert "[eval-kill] SIGKILL to rank 0 in gather_for_metrics call 6" in rep["stdout"]
    assert_same_bits(rep, clean)
    (rec,) = rep["recoveries"]
    assert rec["failed_rank"] == 0 and rec["resumed_step"] == 24  # epoch 1's steps were done
    assert "rank 1: a peer was lost during gather" in rep["stderr"]
    assert _epochs(rep["stdout"]) == _epochs(clean["stdout"])


@pytest.mark.slow
def test_under_torchrun_the_dropin_runs_without_the_supervisor(clean):
    """checkpointless.join() returns a PlainJob under torchrun: the same script trains the same
    bits as under the supervisor (the digest the example prints)."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node", "2", str(DROPIN), "--cpu"],
                       capture_output=True, text=True, timeout=180, env=_env(), cwd=ROOT)
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-3000:])
    pattern = r'"params_sha256": "([0-9a-f]{64})"'
    printed = set(re.findall(pattern, r.stdout))
    assert len(re.findall(pattern, r.stdout)) == 2 and len(printed) == 1, r.stdout
    assert printed == set(re.findall(pattern, clean["stdout"])) - {clean["digest"]}
    assert _epochs(r.stdout) == _epochs(clean["stdout"])


@pytest.mark.slow
def test_rank_0_killed_mid_epoch_in_a_script_without_end_training(tmp_path, clean):
    """Rank 0 dies at step 22 (batch 10 of epoch 1, where the loss is reduced across the ranks).
    Python's enumerate over batches() would have the survivor at 11 and the replacement at 0 on
    the redone step, one reducing and the other not: `accelerator.enumerate()` gives both 10. The
    script's call to end_training() is switched off, as in the many accelerate scripts that never
    make it: the end of `epochs()` leaves the job at the worker's exit, and the run is ok."""
    rep = _supervised(tmp_path, "rank0", "--spares", "1", "--fault", "kill:0:22",
                      script=(EVAL_KILL, DROPIN), SKIP_END_TRAINING="1")
    assert rep["status"] == "ok"
    assert_same_bits(rep, clean)
    (rec,) = rep["recoveries"]
    assert rec["failed_rank"] == 0 and rec["resumed_step"] == 22
    assert _epochs(rep["stdout"]) == _epochs(clean["stdout"])
    assert _losses(rep["stdout"]) == _losses(clean["stdout"])
