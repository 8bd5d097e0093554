"""OMP_WAIT_POLICY on an oversubscribed CPU node (launcher/run/launch.py quiet_openmp): set to
PASSIVE when this node's workers and spares outnumber its cores, left alone otherwise."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from launcher.run.launch import quiet_openmp  # noqa: E402
from launcher.recipe.load import load  # noqa: E402


def _cores(monkeypatch, n):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n)))


def test_passive_when_workers_and_spares_outnumber_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    _cores(monkeypatch, 2)
    cfg = load("tiny-llama", ["checkpointless.spares=1"])  # 4 workers + 1 spare on 2 cores
    assert quiet_openmp(cfg) and os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


def test_left_alone_with_cores_enough_or_when_the_user_chose(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    _cores(monkeypatch, 8)
    assert not quiet_openmp(load("tiny-llama", ["checkpointless.spares=1"]))
    assert "OMP_WAIT_POLICY" not in os.environ
    _cores(monkeypatch, 2)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert not quiet_openmp(load("tiny-llama"))
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
