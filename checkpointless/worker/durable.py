"""Sharded durable checkpoints on torch.distributed.checkpoint (DCP): every rank writes its own
files, in the background, and a checkpoint appears only once all of them are complete.

Layout: `DIR/step-00000010/` is a standard DCP checkpoint (`.metadata` and one `__<rank>_0.distcp`
per rank), loadable by `dcp.load` at any world size and either strategy (DCP reshards: each rank
reads the pieces of the saved chunks its own shards overlap). Replicated state (ddp) is written
once, spread over the ranks by DCP's planner.

Why not `dcp.save`/`dcp.async_save` as they are: their last phase is a collective (the
coordinator gathers every rank's write results to write `.metadata`). In this project a worker
may die at any moment and the survivors' process group is torn down and rebuilt by a recovery, so a
write in flight must not hold or wait on a group. Here only the planning is collective, done in
the caller's thread at a step boundary on the live group (a peer's failure there is one like any
in a step). Every rank then knows the whole plan and metadata, and its thread writes its files
with no communication at all; it records its results in the temporary directory, and whichever
rank finishes last (it finds every rank's results there, and wins an O_EXCL lock) writes
`.metadata` and renames the directory into place. A rank that dies mid-write leaves an
incomplete temporary directory that is never renamed, never listed, and is cleared later; nobody
waits for it.
"""
from __future__ import annotations

import copy
import os
import pickle
import re
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .tensors import is_dtensor, local_part

_DONE = re.compile(r"^step-(\d{8})$")
_PARTIAL = re.compile(r"^\.step-(\d{8})\.g(\d+)\.tmp$")
_OLD_FORMAT = re.compile(r"^step-(\d{8})\.pt$")  # the single-file format before this one
METADATA = ".metadata"  # DCP's file name: present only in a committed checkpoint


def list_checkpoints(directory) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in d.iterdir()
                  if (m := _DONE.match(p.name)) and (p / METADATA).is_file())


def latest(directory) -> tuple[int, Path] | None:
    found = list_checkpoints(directory)
    return found[-1] if found else None


def remove_after(directory, step: int) -> list[int]:
    """Delete the complete checkpoints of steps after `step` (written from a state that was
    found wrong: a later redo of such a step must write it again, not keep it); their steps."""
    gone = []
    for s, p in list_checkpoints(directory):
        if s > step:
            shutil.rmtree(p, ignore_errors=True)
            gone.append(s)
    return gone


def old_format_files(directory) -> list[Path]:
    d = Path(directory)
    return sorted(p for p in d.iterdir() if _OLD_FORMAT.match(p.name)) if d.is_dir() else []


def remove_partial(directory, before_step: int | None = None, same_step_before_gen=None) -> None:
    """Delete temporary directories of writes that can no longer complete: all of them (None:
    at a launch, when no write of this job is in flight), or those of older steps and of older
    generations of `before_step` (a newer generation may be writing that step right now)."""
    d = Path(directory)
    if not d.is_dir():
        return
    for p in d.iterdir():
        m = _PARTIAL.match(p.name)
        if not m:
            continue
        step, gen = int(m.group(1)), int(m.group(2))
        if before_step is None or step < before_step or (
                step == before_step and same_step_before_gen is not None
                and gen < same_step_before_gen):
            shutil.rmtree(p, ignore_errors=True)


def host_copy(value):
    """A copy that training cannot change under the writer: of a tensor, a host copy (of the
    local shard of a DTensor: the only part of it this rank writes); of anything else, a deep
    copy."""
    if isinstance(value, torch.Tensor):
        return local_part(value).detach().to("cpu", copy=True)
    return copy.deepcopy(value)


class _SnapshotPlanner:
    """DCP's default save planner, planned on the live state, writing from host copies.

    The plan needs the live DTensors (their placement says which chunk of the global tensor
    this rank holds); the data must come from copies taken before training resumes. After
    planning, the flattened state is swapped for copies, local shards standing in for DTensors:
    this rank's one chunk of each, which is all its plan asks for."""

    @staticmethod
    def make():
        from torch.distributed.checkpoint import DefaultSavePlanner

        class Planner(DefaultSavePlanner):
            sharded: set = frozenset()

            def swap_in_copies(self) -> None:
                live = self.state_dict
                self.sharded = {k for k, v in live.items() if is_dtensor(v)}
                self.state_dict = {k: host_copy(v) for k, v in live.items()}

            def lookup_object(self, index):
                if index.fqn in self.sharded:
                    return self.state_dict[index.fqn]
                return super().lookup_object(index)

        return Planner()


class ShardedCheckpoints:
    """One rank's writer: `save()` plans with its peers and returns; a thread writes."""

    def __init__(self, directory, keep: int = 2):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = max(1, keep)
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_plan_s = 0.0  # what the caller was blocked for (copy + planning)
        self.last_write_s = 0.0  # the background write, commit included

    def save(self, step: int, state: dict, gen: int = 0) -> None:
        """Collective over the current group: every rank calls it with the same step. Waits for
        this rank's previous write first (one in flight at a time)."""
        from torch.distributed.checkpoint import FileSystemWriter
        t0 = time.time()
        self.wait()
        rank, world = dist.get_rank(), dist.get_world_size()
        tmp = self.dir / f".step-{step:08d}.g{gen}.tmp"
        planner, writer = _SnapshotPlanner.make(), FileSystemWriter(tmp, sync_files=True)
        planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(),
                               is_coordinator=rank == 0)
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        local = writer.prepare_local_plan(planner.create_local_plan())  # creates `tmp`
        plans = [None] * world
        dist.all_gather_object(plans, local)
        # every rank builds the same global plan and metadata from the same inputs, so any of
        # them can write `.metadata` later without asking the others
        plans, metadata = planner.create_global_plan(plans)
        plans = writer.prepare_global_plan(plans)
        mine = planner.finish_plan(plans[rank])
        planner.swap_in_copies()  # from here on training may change the live state
        self.last_plan_s = time.time() - t0
        self._thread = threading.Thread(
            target=self._write, args=(step, gen, tmp, planner, writer, mine, metadata, rank, world),
            name=f"checkpoint-step-{step}", daemon=True)
        self._thread.start()

    def _write(self, step, gen, tmp, planner, writer, plan, metadata, rank, world) -> None:
        t0 = time.time()
        try:
            results = writer.write_data(plan, planner).value()  # fsynced by the writer
            _write_atomic(tmp / f".results-{rank}", pickle.dumps(results))
            if all((tmp / f".results-{r}").is_file() for r in range(world)) and _lock(tmp):
                self._commit(step, gen, tmp, writer, metadata, world)
        except BaseException as exc:  # surfaced by wait(): a failed save is never silent
            self.error = exc
        self.last_write_s = time.time() - t0

    def _commit(self, step, gen, tmp, writer, metadata, world) -> None:
        results = [pickle.loads((tmp / f".results-{r}").read_bytes()) for r in range(world)]
        writer.finish(metadata, results)  # `.metadata`, written to a temporary name and renamed
        final = self.dir / f"step-{step:08d}"
        try:
            os.rename(tmp, final)
        except OSError:  # another generation committed this very step (the same bits): keep it
            if not (final / METADATA).is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return
        for p in final.iterdir():  # the bookkeeping: what is left is a plain DCP checkpoint
            if p.name.startswith(".results-") or p.name == ".commit":
                p.unlink(missing_ok=True)
        _fsync_dir(self.dir)
        for _, old in list_checkpoints(self.dir)[:-self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        remove_partial(self.dir, before_step=step, same_step_before_gen=gen)

    def wait(self) -> None:
        """Until this rank's write in flight (and its commit, if it was the last) is done."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            err, self.error = self.error, None
            raise RuntimeError(f"checkpoint write to {self.dir} failed: {err}") from err


def load(path, state: dict) -> dict:
    """Load checkpoint `path` into `state` in place (collective over the current group): tensors
    are filled whatever their sharding here, other values replaced. Returns `state`."""
    import torch.distributed.checkpoint as dcp
    dcp.load(state, checkpoint_id=str(path))
    return state


def saved_shapes(path) -> dict[str, tuple | None]:
    """Flattened key -> global shape (None for a non-tensor value) of a checkpoint, from its
    metadata alone (no tensor is read)."""
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(str(path)).read_metadata()
    return {k: tuple(v.size) if hasattr(v, "size") else None
            for k, v in md.state_dict_metadata.items()}


def _lock(tmp: Path) -> bool:
    """True for the one rank that gets to commit (several may find every result at once)."""
    try:
        os.close(os.open(tmp / ".commit", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except (FileExistsError, FileNotFoundError):  # taken, or already committed and renamed
        return False


def _write_atomic(path: Path, data: bytes) -> None:
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, path)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
