"""Workers forked from a server that imported their libraries once (checkpointless/forkserver.py):
real processes, in-process on plain Python; no torch."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from checkpointless import forkserver, processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CMD = [sys.executable, "-m", "tests.scripts.fork_target"]


def _env(**extra):
    return dict(os.environ, PYTHONPATH=ROOT, **dict({"BASE_VAR": "a", forkserver.ENV_PRELOAD:
                                                     "tests.scripts.fork_target:preload"},
                                                    **extra))


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
        a = servers.start(CMD + [str(tmp_path / "a"), "0"], _env(CL_WORKER_ID="1"), 0, False)
        b = servers.start(CMD + [str(tmp_path / "b"), "3"], _env(CL_WORKER_ID="2"), 5, False)
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
        c = servers.start(CMD + [str(tmp_path / "c"), "0"], _env(BASE_VAR="b"), 0, False)
        assert c.wait(20) == 0
        rc = _read(tmp_path / "c")
        assert rc["base"] == "b" and rc["preloaded_by"] != ra["preloaded_by"]
        assert len(servers._servers) == 2
    finally:
        servers.close()


def test_a_killed_worker_reports_its_signal_and_its_group_dies_with_it(tmp_path):
    servers = forkserver.ForkServers(per_worker_prefix="CL_")
    try:
        w = servers.start(CMD + [str(tmp_path / "w"), "0", "60"], _env(), 0, True)
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


def test_workers_die_with_a_killed_server(tmp_path):
    servers = forkserver.ForkServers(per_worker_prefix="CL_")
    try:
        w = servers.start(CMD + [str(tmp_path / "w"), "0", "60"], _env(), 0, False)
        _read(tmp_path / "w")
        (server,) = servers._servers.values()
        server.proc.kill()
        assert w.wait(10) == -signal.SIGKILL
        deadline = time.time() + 10
        while os.path.exists(f"/proc/{w.pid}") and time.time() < deadline:
            time.sleep(0.05)  # its death signal; reaped by init
        st = open(f"/proc/{w.pid}/stat").read().split()[2] if os.path.exists(
            f"/proc/{w.pid}") else "gone"
        assert st in ("gone", "Z")
    finally:
        servers.close()


def test_start_process_forks_only_the_named_module_and_only_when_asked(tmp_path):
    p = processes.start_process(CMD + [str(tmp_path / "f"), "0"], _env())
    assert isinstance(p, forkserver.Forked) and p.wait(20) == 0
    for i, env in enumerate((_env(CHECKPOINTLESS_FORKSERVER="0"),
                             _env(CHECKPOINTLESS_FORKSERVER="launcher.loop:preload"))):
        p = processes.start_process(CMD + [str(tmp_path / f"s{i}"), "4"], env)
        assert isinstance(p, subprocess.Popen) and p.wait(20) == 4
        assert _read(tmp_path / f"s{i}")["preloaded_by"] is None
