"""The step boundary's own cost, in one process: one rank on gloo, a Linear(8, 8), `job.steps()`
with `with job.step()`; the median step of all but the first 50.

    python -m launcher.bench.boundary [STEPS]

The training work is a few microseconds, so the figure is what the loop API itself costs per step
(heartbeat, step records, commit), to compare commits taking turns on one machine; the time from
one body's end to the next one's start (the step boundary) is given apart, mean, median and p99."""
from __future__ import annotations

import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

from checkpointless.protocol import membership
from checkpointless import protocol
from checkpointless.worker.job import Job


def main(steps: int = 1500) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    spec = protocol.Spec()
    store.set(protocol.SPEC, spec.to_json())
    job = Job(membership.connect("127.0.0.1", port), 0, spec, "127.0.0.1", port)
    membership.publish(store, membership.Plan(gen=0, world_size=1, ranks={0: 0}))
    job.take_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    job.protect(model=model, optimizer=opt)
    x = torch.randn(4, 8)
    laps, gaps, t = [], [], time.perf_counter()
    body_end = None
    for _ in job.steps(steps):
        body_start = time.perf_counter()
        if body_end is not None:  # from one body's end to the next one's start: the boundary
            gaps.append(body_start - body_end)
        with job.step():
            opt.zero_grad()
            model(x).sum().backward()
            job.all_reduce_grads(model.parameters())
            opt.step()
            body_end = time.perf_counter()
        now = time.perf_counter()
        laps.append(now - t)
        t = now
    job.finish()
    membership.publish(store, membership.Plan(gen=1, world_size=1, ranks={0: 0}))  # wakes the watch
    median = statistics.median(laps[50:])
    g = sorted(gaps[50:])
    print(f"median step {median * 1e3:.3f} ms over {len(laps) - 50} steps; between bodies: mean "
          f"{statistics.mean(g) * 1e3:.3f} ms, median {g[len(g) // 2] * 1e3:.3f} ms, p99 "
          f"{g[int(0.99 * len(g))] * 1e3:.3f} ms")
    return median


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 1500)
