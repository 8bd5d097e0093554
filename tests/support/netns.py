"""Nodes as Linux network namespaces for the multi-node tests: each node its own network stack, an
address on a bridge that exists only inside the namespaces (the host gets none), all removed by
`close()`. A node's link can be cut (its bridge port down: packets are dropped, nothing is reset,
as a failed switch port does) and healed.

Needs root and iproute2; `available()` says why not where it cannot be made."""
from __future__ import annotations

import os
import signal
import subprocess


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    try:
        probe = f"clprobe{os.getpid() % 10000}"
        _ip("netns", "add", probe)
        _ip("netns", "del", probe)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"cannot make a network namespace here: {getattr(exc, 'stderr', exc)}"
    return None


class Nodes:
    def __init__(self, n: int):
        tag = os.getpid() % 10000
        self.subnet = f"10.{80 + tag % 40}.{tag % 250}"
        self.bridge = f"clb{tag}"
        self.names = [f"cl{tag}n{i}" for i in range(n)]
        self.ports = [f"cl{tag}v{i}" for i in range(n)]  # the bridge side of each node's link
        self.addrs = [f"{self.subnet}.{i + 1}" for i in range(n)]
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for ns, port, addr in zip(self.names, self.ports, self.addrs):
                _ip("netns", "add", ns)
                _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("link", "set", port, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except Exception:
            self.close()
            raise

    def popen(self, i: int, cmd: list[str], **kw) -> subprocess.Popen:
        """`cmd` inside node i's namespace, in a session of its own (killed as a whole)."""
        return subprocess.Popen(["ip", "netns", "exec", self.names[i], *cmd],
                                start_new_session=True, **kw)

    def cut(self, i: int) -> None:
        _ip("link", "set", self.ports[i], "down")

    def heal(self, i: int) -> None:
        _ip("link", "set", self.ports[i], "up")

    def pids(self, i: int) -> list[int]:
        out = _ip("netns", "pids", self.names[i], check=False).stdout.split()
        return [int(p) for p in out]

    def close(self) -> None:
        for i, ns in enumerate(self.names):
            for pid in self.pids(i):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", ns, check=False)
        for port in self.ports:
            _ip("link", "del", port, check=False)
        _ip("link", "del", self.bridge, check=False)
