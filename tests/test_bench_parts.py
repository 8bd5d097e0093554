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


def test_default_steps_follow_the_duration_budget_and_cover_the_first_failure():
    assert parse(["bench.duration_s=1200"])[0].steps > parse(["bench.duration_s=600"])[0].steps
    cfg = parse(["bench.duration_s=100", "bench.mtbf_s=60"])[0]
    assert cfg.steps * cfg.step_s_estimate >= 1.5 * 60  # the latest first failure is inside


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



def test_only_steps_inside_their_own_turns_count():
    from launcher.bench import steps_in_turns
    windows = [(0, 10.0, 13.0), (1, 13.0, 16.0), (0, 16.0, 19.0)]
    recs = [{"t_start": 10.1, "t_end": 10.6},   # inside job 0's first turn
            {"t_start": 12.8, "t_end": 16.4},   # stopped across job 1's turn: not counted
            {"t_start": 16.4, "t_end": 16.9},   # inside job 0's second turn
            {"t_start": 18.8, "t_end": 19.3}]   # runs past the end of the turn
    assert steps_in_turns(recs, windows, 0) == [pytest.approx(0.5), pytest.approx(0.5)]
    assert steps_in_turns(recs, windows, 1) == []
