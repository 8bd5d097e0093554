"""This process's own TCP connections, found through /proc/self/fd: shut to release a peer blocked
on them (gloo does not on abort), or to cut one store connection a group is forming on."""
from __future__ import annotations

import os
import socket


def to_ports(ports: set[int]) -> dict[str, int]:
    """This process's TCP connections to `ports` (the stores): {the socket's inode: its
    descriptor}. Inodes, not descriptors, tell connections apart over time: a descriptor
    closed by one thread is reused by the next socket any thread opens."""
    out = {}
    for fd, s, inode in tcp_sockets():
        try:
            if s.getpeername()[1] in ports:
                out[inode] = fd
        except OSError:
            pass
        finally:
            s.close()
    return out


def tcp_sockets():
    """(fd, a duplicate socket object, the socket's inode) for each TCP socket of this process;
    the caller closes each duplicate (which leaves the connection itself open)."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return
    for name in fds:
        fd = int(name)
        try:
            inode = os.readlink(f"/proc/self/fd/{fd}")
            if not inode.startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
            s.close()
            continue
        yield fd, s, inode


def sever_peer_connections(keep_ports: set[int]) -> int:
    """Shut down every established TCP connection of this process except those to `keep_ports`
    (the store). Returns how many were shut down.

    A gloo collective waits until every peer it talks to sends or closes the connection. A worker
    that leaves a broken group for recovery stays alive, and destroying its group object does not
    always close the sockets (other objects, FSDP's among them, can keep the group alive), so a
    peer blocked on it would wait for the process-group timeout. Shutting the group's TCP
    connections down by hand turns that wait into an immediate connection error on the peer's
    side, the same error a dead process gives."""
    n = 0
    for _, s, _ in tcp_sockets():
        try:
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


def shut(fd: int) -> bool:
    """Shut the connection of descriptor `fd` both ways (its users' calls fail at once); the
    descriptor itself stays open for its owner to close."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        s.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        s.close()
