"""Copies at rest are checked: each host copy of a shard (redundancy.py: this rank's own
snapshots, the copies it holds of its peers' slices) keeps the checksum taken when it was made
(audit.checksum: a flipped bit always moves it), and is checked against it before a restore may
use it (when the members say which copies they hold) and, between failures, by a background
scrub. A copy that fails is dropped and said in the log: the restore then takes another copy, or
the durable checkpoint, and never puts a damaged slice into a rank."""
from __future__ import annotations

import sys
import threading

import torch

from .audit import checksum

SCRUB_EVERY_S = 30.0  # how often the background scrub reads every copy again


def of(flat: torch.Tensor) -> int:
    return int(checksum(flat)) if flat.numel() else 0


class CopySums:
    """The checksum of each copy, keyed ("own", step) or (source rank, step)."""

    def __init__(self):
        self.sums: dict[tuple, int] = {}
        self.dropped = 0  # copies found damaged so far
        self._scrub: threading.Thread | None = None

    def note(self, key: tuple, value: int) -> None:
        self.sums[key] = value

    def forget(self, keep: set) -> None:
        self.sums = {k: v for k, v in self.sums.items() if k in keep}

    def damaged(self, versions: dict[tuple, torch.Tensor]) -> list[tuple]:
        """The keys of `versions` ({key: flat bytes}) whose bytes no longer match their sum."""
        bad = [k for k, flat in versions.items() if k in self.sums and of(flat) != self.sums[k]]
        for k in bad:
            self.dropped += 1
            who = "this rank's own snapshot" if k[0] == "own" else f"the copy of rank {k[0]}"
            print(f"[checkpointless] {who} of step {k[1]} no longer matches its checksum "
                  "(host memory damaged): dropped, it will not be restored from",
                  file=sys.stderr, flush=True)
        return bad

    def start_scrub(self, verify, every_s: float = SCRUB_EVERY_S) -> None:
        """Run `verify()` (which checks and drops) every `every_s` in a daemon thread."""
        if self._scrub is not None:
            return
        stop = threading.Event()

        def run():
            while not stop.wait(every_s):
                verify()
        self._scrub = threading.Thread(target=run, daemon=True, name="checkpointless-scrub")
        self._scrub.start()
