"""The goodput simulator: against closed forms on cases simple enough to have one, seeded
determinism, spares, and the fallback to restarts."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402

from launcher.bench.goodput_sim import Inputs, main, simulate, sweep, trace  # noqa: E402

HOURS = 20000  # at one failure an hour: 20,000 events per closed-form check


def one_kind(**kw) -> Inputs:
    """One failure an hour of the job, every one a process loss, no steady overhead."""
    base = dict(nodes=1, gpus_per_node=1, failures_per_gpu_hour=1.0, node_share=0.0,
                days=HOURS / 24, step_s=0.0, overhead=0.0, detect_process_s=0.0,
                control_plane_s=0.0, regroup_s=0.0, transfer_s=0.0, save_s=0.0,
                checkpoint_min=math.inf)
    base.update(kw)
    return Inputs(**base).resolved()


def bound(cost_h: float, lam_h: float, hours: float) -> float:
    """Four standard deviations of the wasted fraction: a compound Poisson sum of lam*T costs,
    each at most cost_h, has a standard deviation of at most cost_h * sqrt(lam*T) / T."""
    return 4 * cost_h * math.sqrt(lam_h * hours) / hours


def test_in_process_matches_the_closed_form():
    # Poisson failures at rate lam, each down r, a failure while down starting r again: the
    # job is up exp(-lam*r) of the time (1 - lam*r to first order, 0.0048 off here)
    r_h = 0.1
    inp = one_kind(detect_process_s=r_h * 3600)
    out = simulate(inp, trace(inp, random.Random(1)), spares=0)
    assert out.restarts == 0
    assert out.goodput == pytest.approx(math.exp(-r_h), abs=bound(r_h, 1.0, HOURS))
    assert abs(out.goodput - (1 - r_h)) > bound(r_h, 1.0, HOURS)


def test_checkpoint_restart_matches_the_closed_form():
    # work tau then a save c; a failure loses the work since the last save and costs a restart
    # R (started again by a failure during it). A segment tau + c takes, on average,
    # (exp(lam*(tau+c)) - 1) * exp(lam*R) / lam, so goodput = lam*tau*exp(-lam*R) / (that - 1).
    # First order (1 - c/tau - lam*(R + tau/2)) reads 0.700 here against the exact 0.735.
    tau, c, r = 0.2, 0.02, 0.1
    inp = one_kind(save_s=c * 3600, restart_min=r * 60, restart_interval_s=tau * 3600)
    out = simulate(inp, trace(inp, random.Random(2)), spares=None)
    exact = tau * math.exp(-r) / (math.exp(tau + c) - 1)
    assert out.goodput == pytest.approx(exact, abs=bound(tau + c + r, 1.0, HOURS))
    assert abs(out.goodput - (1 - c / tau - (r + tau / 2))) > bound(tau + c + r, 1.0, HOURS)


def cluster(**kw) -> Inputs:
    base = dict(nodes=64, gpus_per_node=8, failures_per_gpu_hour=1 / (512 * 5), days=200,
                refill_h=48)
    base.update(kw)
    return Inputs(**base)


def test_same_seed_same_figures_and_another_seed_differs():
    a = sweep(cluster(), [0, 2], runs=2, seed=7)
    assert a == sweep(cluster(), [0, 2], runs=2, seed=7)
    assert a != sweep(cluster(), [0, 2], runs=2, seed=8)


def test_more_spares_never_lower_in_process_goodput():
    rows = sweep(cluster(), list(range(0, 8)), runs=3, seed=0)["in_process"]
    g = [r["goodput"] for r in rows]
    restarts = [r["restarts_per_day"] for r in rows]
    assert all(b >= a for a, b in zip(g, g[1:])), g
    assert all(b <= a for a, b in zip(restarts, restarts[1:])), restarts
    assert g[-1] > g[0] + 0.01  # the spares matter at this failure rate and refill time


def test_without_spares_node_failures_fall_back_to_restarts():
    inp = cluster(rack_share=0.3).resolved()
    failures = trace(inp, random.Random(3))
    nodes = sum(1 for f in failures if f.nodes)
    processes = len(failures) - nodes
    assert nodes > 50 and processes > 50
    out = simulate(inp, failures, spares=0)
    # a failure during a restart joins that restart (a process loss too), so both counts can be
    # a little below their failures, never above
    assert 0.95 * processes <= out.in_process <= processes
    assert 0.9 * nodes <= out.restarts <= nodes
    # with spares, only the coordinator's node and too few ready spares fall back
    assert simulate(inp, failures, spares=30).restarts < 0.1 * nodes


def test_a_rack_takes_its_nodes_and_the_coordinator_falls_back():
    inp = cluster(rack_share=1.0, nodes_per_rack=4, node_share=1.0, refill_h=1).resolved()
    failures = trace(inp, random.Random(4))
    assert {f.nodes for f in failures} == {4}
    coord = sum(f.coordinator for f in failures)
    assert 0 < coord < len(failures) / 4  # one rack in 16 holds node 0
    out = simulate(inp, failures, spares=3)  # fewer than a rack: every one falls back
    assert out.in_process == 0
    many = simulate(inp, failures, spares=40)  # never short of spares with a 1 h refill
    assert many.restarts <= coord and many.in_process >= len(failures) - coord
    alone = cluster(rack_share=1.0, nodes_per_rack=4, node_share=1.0, refill_h=1,
                    standalone_coordinator=True).resolved()
    assert not any(f.coordinator for f in trace(alone, random.Random(4)))


def test_command_line_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "sim.json"
    main(["--nodes", "16", "--days", "30", "--runs", "2", "--sweep", "0,1,2",
          "--json", str(out)])
    text = capsys.readouterr().out
    assert "checkpoint-restart" in text and "<- best" in text
    res = json.loads(out.read_text())
    assert [r["spare_nodes"] for r in res["in_process"]] == [0, 1, 2]
    assert res["best_spare_nodes"] in (0, 1, 2) and res["gpus"] == 128
