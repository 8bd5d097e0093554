"""The benchmark's parts that need no training: settings, the failure schedule and its killer,
figures from step records, taking turns, the goodput model and the tables; and one slow real run
of the plain mode's torch-only loop."""
import json
import math
import signal
import subprocess
import time

import pytest

from launcher.bench.baseline import PLAIN_LOOP, run_torchrun, torchrun_cmd
from launcher.bench.config import BenchConfig, parse
from launcher.bench.failures import Killer, schedule
from launcher.bench.model import scenario, young_interval_s
from launcher.bench.modes import mode_recipe
from launcher.bench.paired import Turns, paired_modes
from launcher.bench.records import read_records, run_digest, steps_in_turns, summarize
from launcher.bench.report import (against_plain, consistency_line, grad_copy_line, overlap_line,
                                   plain_line, table)
from launcher.recipe.load import RecipeError


def test_bench_keys_and_recipe_overrides_are_split_and_typed():
    cfg, overrides = parse(["bench.mtbf_s=30", "bench.steps=50", "optim.lr=1e-3"])
    assert cfg.mtbf_s == 30.0 and cfg.steps == 50 and overrides == ["optim.lr=1e-3"]
    assert isinstance(cfg.steps, int)
    with pytest.raises(RecipeError, match="bench.mtbf_s"):
        parse(["bench.mtbf=30"])
    with pytest.raises(RecipeError, match="expected int"):
        parse(["bench.workers=four"])
    with pytest.raises(RecipeError, match="restrat"):
        parse(["bench.modes=off,restrat"])


def test_default_steps_follow_the_duration_budget_and_cover_the_first_failure():
    assert parse(["bench.duration_s=1200"])[0].steps > parse(["bench.duration_s=600"])[0].steps
    cfg = parse(["bench.duration_s=100", "bench.mtbf_s=60"])[0]
    assert cfg.steps * cfg.step_s_estimate >= 1.5 * 60  # the latest first failure is inside


def test_schedule_is_seeded_and_has_the_asked_mean():
    a = schedule(BenchConfig(mtbf_s=10, seed=1), horizon_s=10000)
    b = schedule(BenchConfig(mtbf_s=10, seed=1), horizon_s=10000)
    assert a == b and 950 < len(a) < 1050  # ~1000 failures in 10000 s at MTBF 10 s
    assert a != schedule(BenchConfig(mtbf_s=10, seed=2), horizon_s=10000)
    gaps = [y[0] - x[0] for x, y in zip(a, a[1:])]
    assert min(gaps) >= 5 and max(gaps) <= 15


def write_records(run_dir, *records):
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_killer_kills_the_drawn_rank_once_its_time_after_the_first_step_comes(tmp_path):
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    try:
        t0 = time.time()
        write_records(tmp_path, {"step": 0, "t_start": t0, "t_end": t0 + 0.1})
        pids = {r: p.pid for r, p in enumerate(procs)}
        killer = Killer(tmp_path, lambda: pids, [(0.3, 0.5)], max_steps=100)
        killer.start()
        killer.join(10)
        assert procs[1].wait(5) == -signal.SIGKILL  # draw 0.5 of ranks [0, 1, 2] is rank 1
        assert procs[0].poll() is None and procs[2].poll() is None
        assert [k["rank"] for k in killer.kills] == [1] and killer.kills[0]["t"] >= t0 + 0.3
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_killer_spares_a_run_about_to_end(tmp_path):
    proc = subprocess.Popen(["sleep", "60"])
    try:
        t0 = time.time()
        write_records(tmp_path, {"step": 97, "t_start": t0, "t_end": t0 + 0.1})
        killer = Killer(tmp_path, lambda: {0: proc.pid}, [(0.1, 0.0)], max_steps=100)
        killer.start()
        killer.join(10)
        assert not killer.is_alive() and killer.kills == [] and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_summary_counts_final_attempts_redone_steps_and_recovery():
    recs = [{"step": 0, "t_start": 0.0, "t_end": 1.0}, {"step": 1, "t_start": 1.0, "t_end": 2.0},
            {"step": 2, "t_start": 2.0, "t_end": 3.0},
            # a kill at t=3.5; restart resumed from a checkpoint at step 1
            {"step": 1, "t_start": 10.0, "t_end": 11.0}, {"step": 2, "t_start": 11.0, "t_end": 12.0}]
    s = summarize(recs, [{"t": 3.5}])
    assert s["steps"] == 3 and s["steps_redone"] == 2
    assert s["wall_s"] == 12.0 and s["goodput"] == pytest.approx(3 / 12, abs=1e-4)
    assert s["recovery_s_median"] == pytest.approx(11.0 - 3.5)


def test_goodput_counts_time_lost_when_the_first_steps_themselves_were_redone():
    # a restart that found no checkpoint redoes steps 0 and 1: the first 3 s were still spent
    recs = [{"step": 0, "t_start": 0.0, "t_end": 1.0}, {"step": 1, "t_start": 1.0, "t_end": 2.0},
            {"step": 0, "t_start": 10.0, "t_end": 11.0}, {"step": 1, "t_start": 11.0, "t_end": 12.0},
            {"step": 2, "t_start": 12.0, "t_end": 13.0}]
    assert summarize(recs, [{"t": 2.5}])["goodput"] == pytest.approx(3 / 13, abs=1e-4)
    assert summarize([], [])["goodput"] is None


def test_only_steps_inside_their_own_turns_count():
    windows = [(0, 10.0, 13.0), (1, 13.0, 16.0), (0, 16.0, 19.0)]
    recs = [{"t_start": 10.1, "t_end": 10.6},   # inside job 0's first turn
            {"t_start": 12.8, "t_end": 16.4},   # stopped across job 1's turn: not counted
            {"t_start": 16.4, "t_end": 16.9},   # inside job 0's second turn
            {"t_start": 18.8, "t_end": 19.3}]   # runs past the end of the turn
    assert steps_in_turns(recs, windows, 0) == [pytest.approx(0.5), pytest.approx(0.5)]
    assert steps_in_turns(recs, windows, 1) == []


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]  # "T" when stopped


def test_turns_stop_one_job_while_the_other_runs_and_leave_neither_stopped(tmp_path):
    dirs = [tmp_path / "a", tmp_path / "b"]
    procs = [subprocess.Popen(["sleep", "60"]) for _ in dirs]
    try:
        for d in dirs:
            d.mkdir()
            write_records(d, {"step": 0, "t_start": 0.0, "t_end": 0.1})
        turns = Turns([(d, lambda p=p: [p.pid], lambda: False) for d, p in zip(dirs, procs)],
                      turn_s=0.3)
        turns.start()
        seen = []
        deadline = time.time() + 2.0
        while time.time() < deadline:
            # the two states are read one after the other, and a switch may fall between the
            # reads (job 0 read running, then stopped and job 1 continued, then job 1 read
            # running): job 0 is read again, and counts as running only if both its reads say so
            t, a, b, a_again = (time.time(), *(proc_state(procs[i].pid) == "T"
                                               for i in (0, 1, 0)))
            seen.append((t, (a and a_again, b) if a == a_again else (True, b)))
            time.sleep(0.02)
        turns.stop.set()
        turns.join(5)
        # once turns began, never both running (a switch stops the others before it continues
        # the next, so both may be stopped for an instant, never both running)
        first = turns.windows[0][1]
        assert (False, False) not in {st for t, st in seen if t > first + 0.05}
        assert {(False, True), (True, False)} <= {st for _, st in seen}  # each had turns, alone
        jobs = [j for j, _, _ in turns.windows]
        assert len(jobs) >= 4 and jobs == [i % 2 for i in range(len(jobs))]
        assert all(b - a == pytest.approx(0.3, abs=0.15) for _, a, b in turns.windows[:-1])
        assert [proc_state(p.pid) for p in procs].count("T") == 0
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_young_interval_minimises_save_cost_plus_lost_work():
    c, m = 16.0, 3600.0

    def waste(tau):
        return c / tau + tau / (2 * m)
    tau = young_interval_s(c, m)
    assert waste(tau) < waste(0.9 * tau) and waste(tau) < waste(1.1 * tau)


def run_scenario(mtbf_h=10.0, restart_min=15, overhead=0.0):
    return scenario("s", 70e9, 1024, 8, 4e6, mtbf_h, "src", restart_min, 2.0,
                    detect_s=0.1, overhead=overhead)


def test_model_goodput_moves_as_its_inputs_say():
    base = run_scenario()
    # the same seeded trace: a steady overhead divides checkpointless's goodput by 1 + overhead;
    # a measured speed-up is not credited
    assert run_scenario(overhead=0.02)["goodput_checkpointless"] == \
        pytest.approx(base["goodput_checkpointless"] / 1.02, abs=1e-4)
    assert run_scenario(overhead=-0.02)["goodput_checkpointless"] == base["goodput_checkpointless"]
    # five more restart minutes per failure cost restart about 300 s / MTBF (3,000 simulated
    # failures: within 10%)
    assert base["goodput_restart"] - run_scenario(restart_min=20)["goodput_restart"] == \
        pytest.approx(300 / (10 * 3600), rel=0.1)
    assert run_scenario(mtbf_h=1)["goodput_restart"] < base["goodput_restart"]
    assert base["young_tau_min"] == pytest.approx(
        math.sqrt(2 * base["checkpoint_s"] * 36000) / 60, rel=0.02)


def test_table_pads_columns_and_prints_missing_values_as_dash():
    assert table([["a", None], ["bbb", 12]], ["x", "y"]).splitlines() == [
        "x     y", "---  --", "a     -", "bbb  12"]


# ---- the plain mode: torch's own DDP loop beside the recipe loop ---------------------------------

def test_flat_is_the_recipe_loop_with_one_all_reduce_after_backward(tmp_path):
    cfg = parse([f"bench.output_dir={tmp_path}", "bench.steps=5"])[0]
    rc, _ = mode_recipe(cfg, [], "flat")
    assert rc.distributed.grad_sync == "flat" and not rc.checkpointless.enabled
    assert mode_recipe(cfg, [], "off")[0].distributed.grad_sync == "buckets"
    line = overlap_line({"step_s_median_off": 0.390, "step_s_median_flat": 0.400})
    assert "overlapped buckets 390 ms" in line and "flat all-reduce after backward 400 ms" in line
    assert "x0.975" in line


def test_consistency_cost_is_spread_over_its_interval():
    line = consistency_line({"every_steps": 50, "check_s_median": 0.002, "per_step_s": 0.00004},
                            0.4)
    assert "every 50 steps: 2.00 ms per check" in line and "0.040 ms per step, 0.010%" in line
    assert "end of the run only" in consistency_line({"every_steps": 0}, 0.4)


def test_plain_is_a_mode_run_by_torchrun_with_its_own_worker_script(tmp_path):
    cfg, _ = parse(["bench.modes=off,on,plain", f"bench.output_dir={tmp_path}", "bench.steps=5"])
    assert cfg.modes.split(",") == ["off", "on", "plain"]
    cmd = torchrun_cmd(cfg, tmp_path / "plain", 0, PLAIN_LOOP)
    assert cmd[cmd.index("-m", 3):] == ["-m", "launcher.bench.plain_loop",
                                         str(tmp_path / "plain" / "recipe.yaml")]
    assert "launcher.train.loop" in torchrun_cmd(cfg, tmp_path / "off", 0)  # off keeps the recipe loop
    rc, out = mode_recipe(cfg, [], "plain")  # no supervisor, no spare, nothing injected
    assert not rc.checkpointless.enabled and rc.checkpointless.spares == 0
    assert rc.trainer.max_steps == 5 and (out / "recipe.yaml").exists()


def test_plain_and_flat_take_turns_in_the_paired_run_unless_told_not_to():
    assert paired_modes(parse([])[0]) == ["off", "flat", "plain", "on"]  # the default bench
    assert paired_modes(parse(["bench.paired_plain=false", "bench.paired_flat=false"])[0]) == [
        "off", "on"]
    assert paired_modes(parse(["bench.modes=on", "bench.paired_plain=false"])[0]) == []
    assert paired_modes(parse(["bench.modes=off,plain"])[0]) == ["off", "flat", "plain"]
    assert paired_modes(parse(["bench.modes=off,plain", "bench.paired_steps=0"])[0]) == []
    assert paired_modes(parse(["bench.modes=checkpointless,restart"])[0]) == []
    assert parse(["bench.paired_plain=no"])[0].paired_plain is False
    with pytest.raises(RecipeError, match="expected bool"):
        parse(["bench.paired_plain=maybe"])


def test_recipe_loop_is_compared_with_plain_from_the_paired_run_when_there_is_one():
    seq = {"off": {"step_s_median": 0.42}, "on": {"step_s_median": 0.44},
           "plain": {"step_s_median": 0.40}}
    fig = against_plain(seq, None)
    assert fig["source"] == "sequential" and fig["off_over_plain"] == pytest.approx(1.05)
    assert fig["on_over_plain"] == pytest.approx(1.10) and fig["within_5pct"] is False
    paired = {"step_s_median_off": 0.401, "step_s_median_on": 0.404,
              "step_s_median_plain": 0.400}
    fig = against_plain(seq, paired)  # turns beat runs one after the other on a drifting box
    assert fig["source"] == "paired" and fig["within_5pct"] is True
    assert fig["on_over_plain"] == pytest.approx(1.01)
    assert against_plain({"off": {"step_s_median": 0.4}}, {"step_s_median_off": 0.4}) is None
    line = plain_line(fig)
    assert "plain 400 ms" in line and "off 401 ms (x1.002)" in line
    assert "on 404 ms (x1.010)" in line and "taking turns" in line and "within 5% of plain: yes" \
        in line
    only_off = plain_line(against_plain({"off": seq["off"], "plain": seq["plain"]}, None))
    assert "one after the other" in only_off and " on " not in only_off


def test_copy_saved_is_the_gradient_bytes_of_one_step():
    line = grad_copy_line({"trainable_params": 1_394_048, "bytes_per_step": 5_576_192,
                           "copy_s_median": 0.0003}, 0.4)
    assert "1,394,048 trainable params x 4 B = 5.6 MB per worker per step" in line
    assert "0.30 ms" in line and "0.07% of off's step" in line


def test_three_jobs_take_turns_in_rotation_each_alone(tmp_path):
    dirs = [tmp_path / n for n in "abc"]
    procs = [subprocess.Popen(["sleep", "60"]) for _ in dirs]
    try:
        for d in dirs:
            d.mkdir()
            write_records(d, {"step": 0, "t_start": 0.0, "t_end": 0.1})
        turns = Turns([(d, lambda p=p: [p.pid], lambda: False) for d, p in zip(dirs, procs)],
                      turn_s=0.2)
        turns.start()
        samples = []  # (when, which of the three are running)
        deadline = time.time() + 1.6
        while time.time() < deadline:
            t = time.time()
            samples.append((t, tuple(proc_state(p.pid) != "T" for p in procs)))
            time.sleep(0.02)
        turns.stop.set()
        turns.join(5)
        # from the first turn on: never two at once (a turn waits until the others are seen
        # stopped before its job goes on, so a handover may show none running, briefly)
        seen = {state for t, state in samples if t > turns.windows[0][1]}
        assert not any(sum(state) > 1 for state in seen), seen
        assert {(True, False, False), (False, True, False), (False, False, True)} <= seen
        jobs = [j for j, _, _ in turns.windows]
        assert len(jobs) >= 6 and jobs == [i % 3 for i in range(len(jobs))]
        assert [proc_state(p.pid) for p in procs].count("T") == 0
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.slow
@pytest.mark.extended  # in make test-scale, not make test (its time budget)
def test_plain_loop_trains_the_recipe_loops_bits_with_torch_ddp(tmp_path):
    """2 workers, 3 steps of 2 micro-batches, a 1-layer tiny Llama: the plain loop writes the
    records the bench reads and every rank ends with the same parameters; the recipe loop (off)
    ends with the same bits, since with two ranks each gradient sum has two terms and halving is
    exact, in any order. A plain loop that reduced every micro-batch (torch's no_sync around the
    backward only) would end with other bits."""
    cfg, overrides = parse(["bench.workers=2", "bench.steps=3", f"bench.output_dir={tmp_path}",
                            "model.config.num_hidden_layers=1", "trainer.grad_accum_steps=2"])
    cfg.mode_timeout_s = 120
    digests = {}
    for mode, module in (("plain", PLAIN_LOOP), ("off", "launcher.train.loop")):
        _, out = mode_recipe(cfg, overrides, mode)
        rc, _, _ = run_torchrun(cfg, out, None, cfg.steps, module=module)
        assert rc == 0, (out / "torchrun.log").read_text()[-3000:]
        digests[mode] = run_digest(out)
        if mode == "plain":
            recs = read_records(out)
            assert [r["step"] for r in recs] == [0, 1, 2]
            assert all(r["t_end"] > r["t_start"] and r["loss"] > 0 for r in recs)
            assert summarize(recs, [])["step_s_median"] > 0
    assert digests["plain"] not in (None, "DISAGREE")  # both ranks reported, and agree
    assert digests["plain"] == digests["off"]


def test_regroup_is_timed_as_the_workers_do_it():
    from launcher.bench.regroup import measure
    r = measure(2, 2)
    assert r["processes"] == 2 and len(r["regroup_s_all"]) == 2
    assert 0 < r["regroup_s_median"] < 30


# ---- the slow modes: a straggler evicted or only reported, beside on ---------------------------

def test_slow_modes_inject_a_straggler_and_evict_it_or_only_report_it(tmp_path):
    cfg = parse([f"bench.output_dir={tmp_path}", "bench.steps=40", "bench.slow_step=12"])[0]
    assert {"slow-evict", "slow-report"} <= set(cfg.modes.split(","))  # in make bench
    for mode, action in (("slow-evict", "evict"), ("slow-report", "report")):
        rc, _ = mode_recipe(cfg, [], mode)
        assert rc.checkpointless.straggler.action == action and rc.checkpointless.spares == 1
        assert [(f.kind, f.rank, f.step, f.factor) for f in rc.faults] == [("slow", 1, 12, 3.0)]
    assert list(mode_recipe(cfg, [], "on")[0].faults) == []
    with pytest.raises(RecipeError, match="bench.slow_rank=4"):
        parse(["bench.slow_rank=4"])


def test_the_straggler_table_puts_goodput_step_times_and_bits_side_by_side():
    from launcher.bench.report import straggler_table
    on = {"goodput": 0.99, "step_s_median": 0.25, "params_sha256": "ab"}
    s = {"on": on,
         "slow-report": dict(on, goodput=0.55, slow_s=20.0, straggler_action="reported",
                             straggler_from_step=20, step_s_median=0.5),
         "slow-evict": dict(on, goodput=0.9, slow_s=2.5, straggler_action="evicted",
                            straggler_from_step=20, straggler_until_step=30,
                            step_s_median_after=0.26, params_sha256="cd")}
    lines = straggler_table(s).splitlines()
    assert lines[3].split()[:2] == ["on", "99.0%"]
    assert lines[4].split()[:4] == ["slow-report", "55.0%", "20.0", "reported"]
    assert lines[5].split() == ["slow-evict", "90.0%", "2.5", "evicted", "20", "30", "250",
                                "260", "DIFFER"]


def test_without_matplotlib_the_plot_is_skipped_in_one_line_said_up_front(monkeypatch):
    from launcher.run import preflight
    from launcher.bench.plot import plot_skipped
    assert plot_skipped() is None  # installed here (the bench extra)
    monkeypatch.setattr(preflight, "installed", lambda module: module != "matplotlib")
    note = plot_skipped()
    assert note.startswith("[bench] matplotlib is not installed: timeline.png will not be drawn")
    assert "pip install matplotlib" in note and "\n" not in note


def test_a_schedule_whose_failures_fall_after_the_training_gets_one_in_its_middle(tmp_path):
    """bench.mtbf_s longer than the run: the first failure moves to the middle of the steps
    (measured from the first ones), so every killed mode measures a recovery."""
    t0 = time.time() - 5
    write_records(tmp_path, *({"step": i, "t_start": t0 + 0.1 * i, "t_end": t0 + 0.1 * (i + 1)}
                              for i in range(4)))
    killer = Killer(tmp_path, lambda: {}, [(100.0, 0.25), (180.0, 0.5)], max_steps=24)
    assert killer.inside_training(killer.plan, t0) == [(pytest.approx(1.0, abs=1e-3), 0.25)]  # 20 x 0.1 / 2
    early = [(0.5, 0.1), (1.5, 0.2), (100.0, 0.3)]
    assert killer.inside_training(early, t0) == early[:2]  # those inside stay where they were


def test_fsdp_exact_is_fsdp_replicated_reducing_by_logical_rank_and_read_beside_it(tmp_path):
    """bench.modes=fsdp-replicated,fsdp-exact: the same fsdp recipe with peer copies, one under
    shrink=exact; its failure-free step is read against fsdp-replicated's, side by side."""
    from launcher.bench.report import fsdp_exact_line
    cfg = parse([f"bench.output_dir={tmp_path}", "bench.steps=5"])[0]
    exact, rep = (mode_recipe(cfg, [], m)[0] for m in ("fsdp-exact", "fsdp-replicated"))
    assert exact.distributed.strategy == rep.distributed.strategy == "fsdp"
    assert exact.checkpointless.shrink == "exact" and rep.checkpointless.shrink == "off"
    assert exact.checkpointless.replication.factor == rep.checkpointless.replication.factor > 1
    s = {"fsdp-exact": {"goodput": 0.98}, "fsdp-replicated": {}}
    line = fsdp_exact_line(s, {"step_s_median_fsdp-exact": 0.515,
                               "step_s_median_fsdp-replicated": 0.500})
    assert "515.0 ms vs fsdp-replicated 500.0 ms (+3.0%, the runs taking turns" in line
    assert s["fsdp-exact"]["step_vs_fsdp_replicated"] == 0.03 and "98.0%" in line
