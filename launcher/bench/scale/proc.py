"""What the scale harness reads about its processes from /proc: CPU time, open sockets, the
coordinator's store connections; and the ports it starts them on."""
from __future__ import annotations

import os
import socket
import time


def cpu_s(pid: int, tid: int | None = None) -> float:
    """A process's CPU time so far (user and system; its threads' included), or with `tid` one
    of its threads', in nanoseconds where the kernel keeps them (schedstat; a process's own
    schedstat is its first thread's alone). A thread's `stat` counts whole clock ticks (10 ms):
    summed over a shard's few hundred threads, each of which runs a few ms in a recovery, it
    lost seconds and showed the plan relays' and node stores' threads at zero."""
    if tid is not None:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                return int(f.read().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):  # gone, or a kernel without schedstats
            pass
    task = f"/proc/{pid}" if tid is None else f"/proc/{pid}/task/{tid}"
    with open(f"{task}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tcp_segments() -> int:
    """TCP segments sent so far in this network namespace (every process of the harness shares
    it: the coordinator, the shards, their loopback connections): what a recovery costs in
    messages, each of which costs a send, a wake-up and a receive in the kernel."""
    with open("/proc/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith("Tcp:")]
    return int(rows[1][rows[0].index("OutSegs")])


def coordinator_connections(pid: int, port: int) -> dict:
    """The connections process `pid` holds, read from /proc: those its store server accepted on
    `port` (ESTABLISHED, local port `port`, a socket among its open files), and every socket."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # the process is gone
        return {"store": -1, "sockets": -1}
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    store = 0
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                store += (cols[3] == "01" and int(cols[1].rsplit(":", 1)[1], 16) == port
                          and cols[9] in inodes)
    return {"store": store, "sockets": len(inodes)}


def sockets(pid: int) -> int:
    """How many sockets process `pid` holds open (-1 if it is gone)."""
    return coordinator_connections(pid, 0)["sockets"]


def fd_limit() -> int:
    import resource
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout_s: float = 60.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"the coordinator never listened on port {port}")
