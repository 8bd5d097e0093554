"""Workers forked from a server that imported their libraries once (checkpointless/control/forkserver.py):
real processes, in-process on plain Python; no torch."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from checkpointless.control import forkserver, processes

from tests.conftest import ROOT as _ROOT  # noqa: E402
ROOT = str(_ROOT)
CMD = [sys.executable, "-m", "tests.support.scripts.fork_target"]


def _env(**extra):
    return dict(os.environ, PYTHONPATH=ROOT, **dict({"BASE_VAR": "a", forkserver.ENV_PRELOAD:
                                                     "tests.support.scripts.fork_target:preload"},
                                                    **extra))


def _start(servers, cmd, env, nice=0, ignore_term=False):
    assert servers.server(cmd, env).ready.wait(30), "the server never finished preloading"
    return servers.start(cmd, env, nice, ignore_term)


def _read(path, within_s=20.0):
    deadline = time.time() + within_s
    while not (os.path.exists(path) and os.path.getsize(path)):
        assert time.time() < deadline, f"{path} never written"
        time.sleep(0.02)
    time.sleep(0.05)
    return json.loads(open(path).read())


def test_workers_are_forked_from_one_preloaded_server_with_their_own_environment(tmp_path):
    servers = forkserver.ForkServers(per_worker_prefix="CL_")
    try:
        a = _start(servers, CMD + [str(tmp_path / "a"), "0"], _env(CL_WORKER_ID="1"))
        b = _start(servers, CMD + [str(tmp_path / "b"), "3"], _env(CL_WORKER_ID="2"), nice=5)
        assert a.wait(20) == 0 and b.wait(20) == 3
        ra, rb = _read(tmp_path / "a"), _read(tmp_path / "b")
        # one server ran preload, and both children are its forks
        assert ra["preloaded_by"] == rb["preloaded_by"] not in (None, ra["pid"], rb["pid"])
        assert (ra["wid"], rb["wid"]) == ("1", "2") and ra["base"] == "a"
        assert ra["argv"][1:] == [str(tmp_path / "a"), "0"]
        assert ra["pgid"] == ra["pid"] and rb["pgid"] == rb["pid"]  # their own groups
        assert ra["stdin"] == "/dev/null"  # not the server's request pipe
        assert ra["random"] != rb["random"]  # reseeded, as a fresh process is
        assert len(servers._servers) == 1

        # another base environment (read by imports) gets a server of its own
        c = _start(servers, CMD + [str(tmp_path / "c"), "0"], _env(BASE_VAR="b"))
        assert c.wait(20) == 0
        rc = _read(tmp_path / "c")
        assert rc["base"] == "b" and rc["preloaded_by"] != ra["preloaded_by"]
        assert len(servers._servers) == 2
    finally:
        servers.close()


def test_a_killed_worker_reports_its_signal_and_its_group_dies_with_it(tmp_path):
    servers = forkserver.ForkServers(per_worker_prefix="CL_")
    try:
        w = _start(servers, CMD + [str(tmp_path / "w"), "0", "60"], _env(), ignore_term=True)
        info = _read(tmp_path / "w")
        assert w.pid == info["pid"] and w.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            w.wait(0.2)
        fd = processes.open_pidfd(w.pid)  # a pidfd works for a process that is not our child
        processes.kill_tree(w)
        assert w.wait(10) == -signal.SIGKILL and w.returncode == -signal.SIGKILL
        os.close(fd)
    finally:
        servers.close()


@pytest.mark.slow  # make test-fast keeps the two above (each server imports torch: seconds)
def test_workers_die_with_a_killed_server(tmp_path):
    servers = forkserver.ForkServers(per_worker_prefix="CL_")
    try:
        w = _start(servers, CMD + [str(tmp_path / "w"), "0", "60"], _env())
        _read(tmp_path / "w")
        (server,) = servers._servers.values()
        server.proc.kill()
        # asked for a worker at once: no exception, None (the caller starts it fresh)
        assert servers.start(CMD + [str(tmp_path / "x"), "0"], _env(), 0, False) is None
        assert w.wait(10) == -signal.SIGKILL
        deadline = time.time() + 10
        while os.path.exists(f"/proc/{w.pid}") and time.time() < deadline:
            time.sleep(0.05)  # its death signal; reaped by init
        st = open(f"/proc/{w.pid}/stat").read().split()[2] if os.path.exists(
            f"/proc/{w.pid}") else "gone"
        assert st in ("gone", "Z")
    finally:
        servers.close()


@pytest.mark.slow
@pytest.mark.skipif(forkserver.gpu_host(), reason="no fork server on a GPU host (forkserver.py)")
def test_start_process_forks_only_the_named_module_once_its_server_is_warm(tmp_path):
    # while the server preloads, a worker starts as a fresh process: no caller waits on it
    env = _env(PRELOAD_S="3")
    p = processes.start_process(CMD + [str(tmp_path / "early"), "0"], env)
    assert isinstance(p, subprocess.Popen) and p.wait(20) == 0
    assert processes.warm_server(CMD, env, 30)
    p = processes.start_process(CMD + [str(tmp_path / "f"), "0", "1"], dict(env, CL_WORKER_ID="7"))
    assert isinstance(p, forkserver.Forked)
    _read(tmp_path / "f")
    # its environment and command line in /proc are the server's; its name says who it is
    assert open(f"/proc/{p.pid}/comm").read().strip() == "cl-worker-7"
    assert p.wait(20) == 0
    assert _read(tmp_path / "f")["preloaded_by"] is not None
    for i, other in enumerate((_env(CHECKPOINTLESS_FORKSERVER="0"),
                               _env(CHECKPOINTLESS_FORKSERVER="launcher.train.loop:preload"))):
        assert not processes.warm_server(CMD, other, 1)
        p = processes.start_process(CMD + [str(tmp_path / f"s{i}"), "4"], other)
        assert isinstance(p, subprocess.Popen) and p.wait(20) == 4
        assert _read(tmp_path / f"s{i}")["preloaded_by"] is None


def test_a_workers_environment_keys_the_server_the_launcher_warmed_before_it(monkeypatch):
    """The launcher warms the server with its base environment before any worker exists; each
    worker's environment adds its own keys. What torch reads at import (TORCH_CPP_LOG_LEVEL)
    must be in both, or the first workers find no ready server and start fresh (about 10 s more
    per start on 2 cores: seen when that default was added to the workers' keys alone)."""
    import sys
    from types import SimpleNamespace
    from checkpointless.control import forkserver
    from checkpointless.protocol import keys
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    made = []  # the environments servers were started with (none really started here)
    monkeypatch.setattr(forkserver, "_Server", lambda module, env, args: made.append(env) or
                        SimpleNamespace(proc=SimpleNamespace(poll=lambda: None)))
    servers = forkserver.ForkServers(per_worker_prefix=keys.ENV_PREFIX)
    cmd = [sys.executable, "-m", "launcher.train.loop", "recipe.yaml"]
    base = {"PATH": "/usr/bin", "HF_HUB_OFFLINE": "1"}
    first = servers.server(cmd, base)  # warmed before the first generation
    for wid in range(3):
        worker = dict(base, **keys.worker_env("127.0.0.1", 29400, wid, wid, False))
        assert servers.server(cmd, worker) is first
    assert len(made) == 1 and made[0]["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "WARNING")  # the launcher's own choice wins
    assert "TORCH_CPP_LOG_LEVEL" not in keys.worker_env("127.0.0.1", 29400, 3, 3, False)


def test_a_worker_whose_exit_the_server_never_reports_is_counted_dead(monkeypatch):
    """A report lost (or a server that stopped reaping) must not leave a dead worker counted
    alive: its peers would wait on it for ever."""
    from types import SimpleNamespace
    from checkpointless.control import forkserver
    monkeypatch.setattr(forkserver, "REPORT_GRACE_S", 0.2)
    child = subprocess.Popen(["sleep", "30"])
    forked = forkserver.Forked(child.pid, SimpleNamespace(codes={}))
    assert forked.poll() is None  # running
    child.kill()
    child.wait()  # reaped here, as the server would, and no report sent
    assert forked.poll() is None  # within the grace its report may still come
    time.sleep(0.3)
    assert forked.poll() == -signal.SIGKILL
