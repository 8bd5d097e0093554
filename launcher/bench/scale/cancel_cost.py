"""What one call through a node's door costs the coordinator's store as nodes grow, with the
agents' command waits on a key per node (before 2026-12-07) or on a bell per 64 nodes (now).

`python -m launcher.bench.scale.cancel_cost [--nodes 512,2048,4096] [--calls 2000]`

N connections each hold what a node's door holds at the coordinator in steady state: a wait for
the next plan (one key, shared) and a wait for the node's next command (a key of its own, or its
group's bell). One of them then makes `--calls` calls as its door does: a CANCEL_WAIT, a GET of a
300-byte record, and both waits armed again, one round trip each. torch's server forgets a
connection's waits by walking every waited key of every connection, so with a key per node
each call walks N entries; with bells N/64. The figure is the round trip's wall time (client and
server on this machine), printed side by side for the two layouts at each size.
"""
from __future__ import annotations

import argparse
import os
import struct
import time
from datetime import timedelta

os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # see docs/scale.md: the resolver

import torch.distributed as dist  # noqa: E402

from checkpointless import protocol  # noqa: E402
from checkpointless.control import store_wire as w  # noqa: E402


def _key(k: str) -> bytes:
    k = ("/" + k).encode()  # torch's client puts "/" before every key
    return struct.pack("<Q", len(k)) + k


def _command_key(node: int, bells: bool) -> str:
    return protocol.bell_key(node // protocol.NODES_PER_BELL, 0) if bells else \
        protocol.node_cmd_key(node, 0)


def per_call_us(nodes: int, calls: int, bells: bool) -> float:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True,
                           wait_for_workers=False, timeout=timedelta(seconds=60))
    plan = _key(protocol.plan_key(1))
    socks = []
    try:
        for node in range(nodes):
            s = w.dial(("127.0.0.1", server.port), 30.0)
            s.sendall(w.one_key(w.WAIT, plan) + w.one_key(w.WAIT, _key(_command_key(node, bells))))
            socks.append(s)
        server.set("rec", "x" * 300)
        door = socks[0]
        call = (bytes([w.CANCEL_WAIT, w.GET]) + _key("rec") + w.one_key(w.WAIT, plan)
                + w.one_key(w.WAIT, _key(_command_key(0, bells))))
        answer = 1 + 8 + 300  # the cancel's byte, then the record
        time.sleep(0.5)  # every wait armed
        t0 = time.perf_counter()
        for _ in range(calls):
            door.sendall(call)
            got = 0
            while got < answer:
                got += len(door.recv(answer - got))
        return (time.perf_counter() - t0) / calls * 1e6
    finally:
        for s in socks:
            s.close()
        del server


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m launcher.bench.scale.cancel_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="512,2048,4096")
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args(argv)
    for n in map(int, a.nodes.split(",")):
        key, bell = per_call_us(n, a.calls, False), per_call_us(n, a.calls, True)
        print(f"{n:>6} nodes: {key:7.1f} us a call with a key per node, {bell:7.1f} us with a "
              f"bell per {protocol.NODES_PER_BELL} nodes ({key / bell:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
