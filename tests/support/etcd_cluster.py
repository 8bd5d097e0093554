"""A real etcd cluster of three members on loopback ports, for the tests that need one; skipped,
saying why, where Debian's etcd-server package is not installed (.ci/run installs it)."""
import os
import socket
import tempfile

import pytest

from checkpointless.ha import member as etcd_member
from checkpointless.ha.member import MemberSpec


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Cluster:
    def __init__(self, size: int = 3):
        if etcd_member.binary() is None:
            pytest.skip("no etcd binary (Debian's etcd-server package; .ci/run installs it)")
        ports = _free_ports(2 * size)
        self.members = [MemberSpec(f"m{i}", "127.0.0.1", ports[2 * i], ports[2 * i + 1])
                        for i in range(size)]
        self.dir = tempfile.mkdtemp(prefix="etcd-test-")
        self.procs = [etcd_member.start(m, self.members, os.path.join(self.dir, m.name),
                                        token=os.path.basename(self.dir),
                                        log_path=os.path.join(self.dir, m.name + ".log"))
                      for m in self.members]
        etcd_member.wait_healthy(self.endpoints)

    @property
    def endpoints(self) -> list[str]:
        return [m.client_url for m in self.members]

    def kill(self, i: int) -> None:
        self.procs[i].kill()
        self.procs[i].wait()

    def close(self) -> None:
        import shutil
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
