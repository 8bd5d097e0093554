"""The background exchange of shard copies (redundancy.py): one thread and one side group per
generation, sending this rank's snapshot to its holders while receiving its sources' slices,
headers first (step, sizes, the payload's checksum), then the payloads."""
from __future__ import annotations

import queue
import threading

import torch

_TAG_HEADER, _TAG_PAYLOAD = 11, 12


class Shipment:
    """One exchange: my message for `step`, to `holders`, while receiving from `sources`."""

    def __init__(self, step, rank, payload, nflat, holders, sources, token):
        self.step, self.rank, self.payload, self.nflat = step, rank, payload, nflat
        self.holders, self.sources, self.token = holders, sources, token
        self.checksum = 0  # of the payload's tensor bytes (scrub.py), for its holders
        self.done = threading.Event()
        self.error: BaseException | None = None


class Exchanger:
    """The background thread of one generation and its side group (built on the first job)."""

    def __init__(self, owner, gen: int, connect):
        self.owner, self.gen, self.connect = owner, gen, connect
        self.broken = False  # after a failure the side group's state is unknown: not reused
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"checkpointless-replicas-{gen}")
        self._thread.start()

    def submit(self, job: Shipment) -> None:
        self._jobs.put(job)

    def stop(self, join_s: float = 0.0) -> None:
        self._jobs.put(None)
        if join_s > 0:
            self._thread.join(join_s)

    def _run(self) -> None:
        group = None
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if group is None:
                    group = self.connect()
                self._exchange(group, job)
            except BaseException as exc:  # noqa: BLE001  handed to the main thread's wait()
                job.error = exc
                self.broken = True
            finally:
                job.done.set()
            if self.broken:
                return

    def _exchange(self, group, job: Shipment) -> None:
        header = torch.tensor([job.step, job.nflat, job.payload.numel() - job.nflat,
                               job.checksum], dtype=torch.int64)
        got = {s: torch.empty(4, dtype=torch.int64) for s in job.sources}
        _wait_all([group.send([header], h, _TAG_HEADER) for h in job.holders] +
                  [group.recv([got[s]], s, _TAG_HEADER) for s in job.sources])
        if self.owner.on_exchange is not None:
            self.owner.on_exchange(job.rank, job.step)
        bufs = self.owner._commit_receive(job, got)
        _wait_all([group.send([job.payload], h, _TAG_PAYLOAD) for h in job.holders] +
                  [group.recv([bufs[s][0]], s, _TAG_PAYLOAD) for s in job.sources])
        self.owner._commit_copies(job, bufs)


def _wait_all(works) -> None:
    for w in works:
        w.wait()

