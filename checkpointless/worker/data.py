"""Where a loop stands in its DataLoader, so a replacement resumes at the exact batch.

    job.protect(model=model, optimizer=opt, loader=loader)
    for epoch in job.epochs(num_epochs):       # resumes at the agreed epoch
        sampler.set_epoch(epoch)
        for xb, yb in job.batches(loader):     # resumes at the agreed batch of that epoch
            with job.step():
                ...

The position is two integers, the same on every rank: the epoch and the committed step at which
it began (the batch within the epoch is the committed steps since then). A replacement receives them
from a peer with the rest of the state; its own loader differs from the peer's only in the
sampler's rank, which the script built from `job.rank`. It then starts the epoch's iterator past the
batches already trained, cutting the sampler's index lists, so skipped batches are never loaded.

Supported: a `torch.utils.data.DataLoader` (torchdata's `StatefulDataLoader` is one) over a
map-style dataset whose order is a function of the epoch: a `DistributedSampler` (shuffled or not,
any subclass) or a `SequentialSampler`. Refused, at `protect()`: an `IterableDataset` (it has no
index to resume at) and any other sampler, a `RandomSampler` first (its order comes from a random
seed drawn when each epoch starts, which a replacement cannot draw again).
"""
from __future__ import annotations

import copy
from collections import UserDict

from torch.utils.data import (BatchSampler, DataLoader, DistributedSampler, IterableDataset,
                              SequentialSampler)

ORDERED = (DistributedSampler, SequentialSampler)
END = object()  # what Cursor.batch returns past the epoch's last batch


class Position:
    """Where a loop stands: `epoch` and `epoch_start` (committed steps when the epoch began). A
    state_dict object, so it travels with the model and optimizer.

    A move to the next epoch may wait in `pending` until that epoch's first step commits (the
    drop-in Accelerator does: an evaluation cut short by a failure is then run again)."""

    def __init__(self):
        self.epoch = 0
        self.epoch_start = 0
        self.pending: tuple[int, int] | None = None

    def current(self) -> tuple[int, int]:
        return self.pending or (self.epoch, self.epoch_start)

    def commit(self) -> None:
        if self.pending is not None:
            (self.epoch, self.epoch_start), self.pending = self.pending, None

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "epoch_start": self.epoch_start}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.epoch_start = int(state["epoch"]), int(state["epoch_start"])
        self.pending = None


class LoaderPosition(Position):
    """The protected position of one DataLoader, checked when it is protected."""

    def __init__(self, loader):
        check_loader(loader)
        super().__init__()
        self.loader = loader


def check_loader(loader) -> None:
    """Refuse a loader whose position a replacement could not reconstruct, saying why."""
    if not isinstance(loader, DataLoader):
        raise TypeError(f"protect(loader=...): got {type(loader).__name__}; a loader's position "
                        "can be protected for a torch.utils.data.DataLoader (or torchdata's "
                        "StatefulDataLoader) over a map-style dataset. For another iterable, "
                        "make each step's batch a function of the step number instead")
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError("protect(loader=...): the loader reads an IterableDataset, which has no "
                        "index a replacement could resume at. Use a map-style dataset with a "
                        "DistributedSampler, or make each step's batch a function of the step")
    sampler = _sampler(loader)
    if not isinstance(sampler, ORDERED):
        raise TypeError(
            f"protect(loader=...): the loader's sampler is a {type(sampler).__name__}; a "
            "replacement can only rebuild the order of a DistributedSampler (shuffle=True "
            "shuffles by seed and epoch) or a SequentialSampler. A RandomSampler draws a fresh "
            "seed at each epoch, which a replacement cannot draw again: use "
            "DistributedSampler(dataset, num_replicas=job.world_size, rank=job.rank, seed=...)")


def _sampler(loader: DataLoader):
    """The sampler that decides the order: the batch sampler's, when one was given."""
    batch_sampler = loader.batch_sampler
    if batch_sampler is not None and not isinstance(batch_sampler, BatchSampler):
        return getattr(batch_sampler, "sampler", batch_sampler)
    return loader.sampler


class _SkipBatches:
    """A batch sampler that yields the loader's index lists past the first `skip`."""

    def __init__(self, batch_sampler, skip: int):
        self.batch_sampler, self.skip = batch_sampler, skip

    def __iter__(self):
        for i, indices in enumerate(self.batch_sampler):
            if i >= self.skip:
                yield indices

    def __len__(self):
        return max(0, len(self.batch_sampler) - self.skip)


def iterate_from(loader: DataLoader, skip: int):
    """An iterator over `loader`'s batches of the current epoch, from batch `skip` on.

    The index lists of skipped batches are drawn (cheap) but their samples never loaded."""
    if skip == 0:
        return iter(loader)
    if loader.batch_sampler is None:  # no automatic batching: one sample per "batch"
        batch_sampler = BatchSampler(loader.sampler, 1, False)
        collate = lambda one: loader.collate_fn(one[0])  # noqa: E731
    else:
        batch_sampler, collate = loader.batch_sampler, loader.collate_fn
    extra = {}
    if loader.num_workers > 0:
        extra = {"prefetch_factor": loader.prefetch_factor,
                 "persistent_workers": False, "multiprocessing_context":
                 loader.multiprocessing_context, "worker_init_fn": loader.worker_init_fn}
    resumed = DataLoader(loader.dataset, batch_sampler=_SkipBatches(batch_sampler, skip),
                         num_workers=loader.num_workers, collate_fn=collate,
                         pin_memory=loader.pin_memory, timeout=loader.timeout,
                         generator=loader.generator, **extra)
    return iter(resumed)


class Cursor:
    """One epoch's iterator over a loader, asked for batches by index: the next one, the same
    one again (a step redone after a recovery gets the very batch it had), or one further on (a
    survivor moved forward by its peers' state, a replacement starting mid-epoch)."""

    def __init__(self, loader: DataLoader):
        self.loader = loader
        self.it = None
        self.taken = 0  # batches drawn from `it` (counted from the epoch's start)
        self.last = END

    def batch(self, index: int):
        """The epoch's batch `index`. Each call hands out its own container (a dict's or list's
        shallow copy): a body that takes from its batch (`labels = batch.pop("labels")`) finds
        it whole again when the step is run again (a redo, the replay rehearsal)."""
        got = self._batch(index)
        return copy.copy(got) if isinstance(got, (dict, list, UserDict)) else got

    def _batch(self, index: int):
        if index == self.taken - 1 and self.last is not END:
            return self.last
        if self.it is None or not 0 <= index - self.taken <= 2:
            self.close()
            self.it, self.taken = self._open(index), index
        while self.taken < index:  # a step or two ahead: drawing is cheaper than a new iterator
            next(self.it, None)
            self.taken += 1
        self.last = next(self.it, END)
        self.taken += 1
        return self.last

    def _open(self, skip: int):
        """A fresh iterator over the epoch's batches from batch `skip` on."""
        return iterate_from(self.loader, skip)

    def close(self) -> None:
        self.it = None
