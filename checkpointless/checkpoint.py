"""Single-file checkpoints: the whole state in one `step-<n>.pt`, written by one process.

The recipe loop's durable checkpoints are sharded (durable.py: every rank writes its own part);
this writer remains for what needs one file of the whole state, such as the benchmark timing a
synchronous save of a recipe's state to size the restart baseline's checkpoint interval.

Written asynchronously (the state is snapshotted to host memory, then a background thread writes
it), atomically (a temporary file renamed into place: a crash mid-write leaves the previous
checkpoint intact) and rotated (the newest `keep` are kept). The file holds the full, unsharded
state keyed by parameter names, so it reloads with any number of workers and either strategy.
"""
from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import torch

_NAME = re.compile(r"^step-(\d{8})\.pt$")


def snapshot(obj):
    """A host-memory copy of a nested state, safe to write while training goes on."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(snapshot(v) for v in obj)
    return obj


def list_checkpoints(directory) -> list[tuple[int, Path]]:
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), d / p.name) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def latest(directory) -> tuple[int, Path] | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def load(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


class CheckpointWriter:
    """Writes `{"step": n, ...state}` as `step-<n>.pt`; one write in flight at a time."""

    def __init__(self, directory, keep: int = 2):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = max(1, keep)
        self._thread: threading.Thread | None = None
        self.last_save_s = 0.0  # time the caller was blocked (snapshot), for cost accounting
        self.last_write_s = 0.0  # time the background write took
        self.error: BaseException | None = None

    def save(self, step: int, state: dict, blocking: bool = False) -> None:
        t0 = time.time()
        self.wait()
        snap = snapshot(state)
        snap["step"] = step
        self.last_save_s = time.time() - t0
        self._thread = threading.Thread(target=self._write, args=(step, snap), daemon=True)
        self._thread.start()
        if blocking:
            self.wait()

    def _write(self, step: int, snap: dict) -> None:
        t0 = time.time()
        final = self.dir / f"step-{step:08d}.pt"
        tmp = self.dir / f".step-{step:08d}.pt.tmp{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                torch.save(snap, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            for _, old in list_checkpoints(self.dir)[:-self.keep]:
                old.unlink(missing_ok=True)
        except BaseException as exc:  # surfaced by wait(): a failed save is never silent
            self.error = exc
            tmp.unlink(missing_ok=True)
        self.last_write_s = time.time() - t0

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"checkpoint write to {self.dir} failed: {err}") from err
