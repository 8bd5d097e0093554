"""The benchmark's arithmetic: parsing, the failure schedule, figures from step records."""
import pytest

from launcher.bench import parse, schedule, summarize
from launcher.goodput_model import model_table
from launcher.recipes import RecipeError


def test_bench_keys_and_recipe_overrides_are_split():
    cfg, overrides = parse(["bench.mtbf_s=30", "bench.steps=50", "optim.lr=1e-3"])
    assert cfg.mtbf_s == 30.0 and cfg.steps == 50 and overrides == ["optim.lr=1e-3"]
    with pytest.raises(RecipeError, match="bench.mtbf_s"):
        parse(["bench.mtbf=30"])


def test_default_steps_follow_the_duration_budget():
    assert parse(["bench.duration_s=600"])[0].steps > parse(["bench.duration_s=300"])[0].steps


def test_schedule_is_seeded_and_has_the_asked_mean():
    from launcher.bench import BenchConfig
    a = schedule(BenchConfig(mtbf_s=10, seed=1), horizon_s=10000)
    b = schedule(BenchConfig(mtbf_s=10, seed=1), horizon_s=10000)
    assert a == b and 950 < len(a) < 1050  # ~1000 failures in 10000 s at MTBF 10 s
    gaps = [y[0] - x[0] for x, y in zip(a, a[1:])]
    assert min(gaps) >= 5 and max(gaps) <= 15


def test_summary_counts_final_attempts_redone_steps_and_recovery():
    recs = [{"step": 0, "t_start": 0.0, "t_end": 1.0}, {"step": 1, "t_start": 1.0, "t_end": 2.0},
            {"step": 2, "t_start": 2.0, "t_end": 3.0},
            # a kill at t=3.5; restart resumed from a checkpoint at step 1
            {"step": 1, "t_start": 10.0, "t_end": 11.0}, {"step": 2, "t_start": 11.0, "t_end": 12.0}]
    s = summarize(recs, [{"t": 3.5}])
    assert s["steps"] == 3 and s["steps_redone"] == 2
    assert s["wall_s"] == 12.0 and s["goodput"] == pytest.approx(3 / 12)
    assert s["recovery_s_median"] == pytest.approx(11.0 - 3.5)


def test_goodput_model_favours_checkpointless_at_scale_and_shows_inputs():
    rows, text = model_table({"checkpointless": {"recovery_s_median": 1.0}}, 0.01, 0.05)
    assert "not a measurement" in text and "MTBF sources" in text
    big = rows[-1]
    assert big["goodput_checkpointless"] > big["goodput_restart"]


def test_overhead_pairs_in_abba_order_cancel_a_steady_drift():
    from launcher.bench import overhead_abba
    # the machine slows 2% per run; on is truly 1% slower than off. Run order: off, on, ..., on-2,
    # off-2 (runs 0, 1, 4, 5)
    speed = [1.0 + 0.02 * i for i in range(6)]
    s = {"off": {"step_s_median": 0.5 * speed[0]}, "on": {"step_s_median": 0.505 * speed[1]},
         "on-2": {"step_s_median": 0.505 * speed[4]}, "off-2": {"step_s_median": 0.5 * speed[5]}}
    mean, pairs = overhead_abba(s)
    assert pairs[0] > 0.025 and pairs[1] < -0.005  # each pair alone is off by the drift
    assert mean == pytest.approx(0.01, abs=0.002)
    assert overhead_abba({"off": s["off"], "on": s["on"]})[1] == [pairs[0]]
