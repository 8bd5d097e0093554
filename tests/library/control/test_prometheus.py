"""The coordinator's Prometheus figures (checkpointless/control/prometheus.py), in one process: a real store
with step records written as rank 0 writes them, a supervisor's failure list, a real HTTP scrape;
and the example Grafana dashboard asks only for what is served. The scrape during a real run with
three failures is in test_train_e2e.py."""
import json
import re
import time
import urllib.request
from types import SimpleNamespace as NS

import pytest
import torch.distributed as dist

from checkpointless import protocol
from checkpointless.control.prometheus import Figures, Snapshot, serve
from checkpointless.control.report import Failure
from tests.conftest import ROOT


def _supervisor(store, port):
    """A supervisor as the scrape sees it: its port and its figures() snapshot."""
    failures = [Failure(wid=1, rank=1, cause="exit", t_fail=0.0, t_detect=0.0, step=3),
                Failure(wid=2, rank=2, cause="hang", t_fail=0.0, t_detect=0.0, step=5)]
    snap = Snapshot(gen=2, world_size=3, nproc=3, failures=failures, spares_ready=1,
                    stragglers=[{"from_step": 6, "action": "evicted", "until_step": 8}],
                    nodes_alive=1, nodes_lost=None, t_start=time.time() - 10)
    return NS(figures=lambda store: snap, port=port)


def _samples(text: str) -> dict:
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines()
                                     if line.startswith("checkpointless_"))}


def test_a_scrape_reads_the_steps_written_since_the_last_and_rewritten_ones():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set(protocol.FIRST_STEP, "0")
    t = 1000.0
    for s in range(10):  # 1 s steps, steps 6 and 7 slowed to 3 s by a straggler
        d = 3.0 if s in (6, 7) else 1.0
        store.set(protocol.step_key(s), f"{t},{t + d}")
        t += d
    sup = _supervisor(store, store.port)
    fig = Figures(sup.figures, sup.port, tokens_per_step=4096)
    got = {m.name: m for m in fig.collect()}
    assert got["checkpointless_steps_completed"].samples[0].value == 10
    # 14 s of steps, 4 s of them lost to slowness (each slowed step 2 s above the healthy 1 s)
    assert got["checkpointless_slow_seconds"].samples[0].value == 4.0
    assert got["checkpointless_goodput_ratio"].samples[0].value == round(10 / 14, 4)
    assert got["checkpointless_tokens_per_second"].samples[0].value == pytest.approx(4096 * 10 / 14)
    failures = {s.labels["cause"]: s.value for s in got["checkpointless_failures"].samples
                if s.name.endswith("_total")}
    assert failures["exit"] == 1 and failures["hang"] == 1 and failures["error"] == 0
    # no recovery record is complete yet (no generation was entered): none counted
    assert all(s.value == 0 for s in got["checkpointless_recoveries"].samples)
    assert got["checkpointless_spares_ready"].samples[0].value == 1
    # step 9 redone after a recovery (its record rewritten) and step 10 added: both read
    store.set(protocol.step_key(9), f"{t - 1},{t - 0.5}")
    store.set(protocol.step_key(10), f"{t},{t + 1}")
    got = {m.name: m for m in fig.collect()}
    assert got["checkpointless_steps_completed"].samples[0].value == 11
    assert fig.steps[9] == (t - 1, t - 0.5)


def test_after_a_takeover_the_steps_count_from_the_launch():
    """A coordinator taking over scrapes its own store's step records (from step 5 on) and the
    ones its predecessors kept (steps 0..4, ledger.py), as its report does."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    store.set(protocol.FIRST_STEP, "5")
    for s in range(5, 10):
        store.set(protocol.step_key(s), f"{1000.0 + 2 * s},{1001.0 + 2 * s}")
    snap = Snapshot(gen=3, world_size=3, nproc=3, failures=[], spares_ready=0, stragglers=[],
                    nodes_alive=2, nodes_lost=1, t_start=time.time(),
                    earlier_steps={s: (1000.0 + 2 * s, 1001.0 + 2 * s) for s in range(5)})
    fig = Figures(lambda store: snap, store.port)
    got = {m.name: m for m in fig.collect()}
    assert got["checkpointless_steps_completed"].samples[0].value == 10
    assert got["checkpointless_goodput_ratio"].samples[0].value == round(10 / 19, 4)


def test_metrics_are_served_over_http_and_the_dashboard_asks_only_for_them():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    sup = _supervisor(store, store.port)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stop = serve(sup, port, tokens_per_step=1, addr="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    finally:
        stop()
    samples = _samples(text)
    assert samples["checkpointless_generation"] == 2 and samples["checkpointless_world_size"] == 3
    assert samples['checkpointless_failures_total{cause="exit"}'] == 1
    assert "process_cpu_seconds_total" in text  # the coordinator's own CPU, for its cost
    # every family is described (# TYPE), also one with no value yet (no step, no recovery)
    served = set()
    for name, kind in re.findall(r"^# TYPE (checkpointless_\w+) (\w+)$", text, re.M):
        served.add(name + "_total" if kind == "counter" and not name.endswith("_total")
                   else name)
    dashboard = json.loads((ROOT / "examples/grafana/checkpointless-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    asked = {m for e in exprs for m in re.findall(r"checkpointless_[a-z_]+", e)}
    assert asked <= served, asked - served
    assert {"checkpointless_goodput_ratio", "checkpointless_recoveries_total"} <= asked
