"""Releasing peers blocked on a process group that is being abandoned.

A gloo collective waits until every peer it talks to sends or closes the connection. A worker
that leaves a broken group for recovery stays alive, and destroying its group object does not
always close the sockets (other objects, FSDP's among them, can keep the group alive), so a peer
blocked on it would wait for the process-group timeout. Shutting the group's TCP connections down
by hand turns that wait into an immediate connection error on the peer's side, the same error a
dead process gives. Only connections to the coordination store are kept.
"""
from __future__ import annotations

import os
import socket


def sever_peer_connections(keep_ports: set[int]) -> int:
    """Shut down every established TCP connection of this process except those to `keep_ports`
    (the store). Returns how many were shut down."""
    n = 0
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    for name in fds:
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                peer_port = s.getpeername()[1]
                local_port = s.getsockname()[1]
            except OSError:
                continue  # a listening socket: no peer
            if peer_port in keep_ports or local_port in keep_ports:
                continue
            s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass
        finally:
            s.close()  # closes our duplicate only; the shutdown applies to the connection
    return n
