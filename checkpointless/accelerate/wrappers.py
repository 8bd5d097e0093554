"""What the drop-in Accelerator puts around accelerate's own objects: the loader check, an epoch's
cursor over a prepared loader, and the loader, optimizer and scheduler that stand still in a void
pass (the rest of a body after a peer's failure, see docs/accelerate.md)."""
from __future__ import annotations

from accelerate.data_loader import DataLoaderShard, SeedableRandomSampler, skip_first_batches
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler
from torch.utils.data import DistributedSampler, IterableDataset, SequentialSampler

from ..worker.data import Cursor

# samplers whose order is a function of (seed, epoch), which a replacement can draw again
ORDERED = (SeedableRandomSampler, SequentialSampler, DistributedSampler)


def check_loader(loader, what: str = "batches") -> None:
    """Refuse, in `batches()`, a loader whose batches a replacement could not find again."""
    if not isinstance(loader, DataLoaderShard):
        raise TypeError(f"accelerator.{what}(): got {type(loader).__name__}; pass a DataLoader "
                        "returned by accelerator.prepare()")
    if isinstance(loader.dataset, IterableDataset):
        raise TypeError(f"accelerator.{what}(): the loader reads an IterableDataset, which has "
                        "no index a replacement could resume at; use a map-style dataset")
    sampler = loader.batch_sampler
    while hasattr(sampler, "batch_sampler"):
        sampler = sampler.batch_sampler
    sampler = getattr(sampler, "sampler", None)
    if not isinstance(sampler, ORDERED):
        raise TypeError(f"accelerator.{what}(): the loader's order comes from a "
                        f"{type(sampler).__name__}, which a replacement cannot draw again; use "
                        "shuffle=True / False, or a DistributedSampler")


class ShardCursor(Cursor):
    """data.Cursor over a prepared loader: batches are skipped with accelerate's own
    `skip_first_batches` (never loaded), and the loader leaves accelerate's stack of active
    loaders when the cursor closes."""

    def __init__(self, loader: DataLoaderShard, epoch: int):
        super().__init__(loader)
        self.epoch = epoch
        self.owner = None

    def _open(self, skip: int):
        self.loader.set_epoch(self.epoch)  # the sampler's epoch, shared with a skipping copy
        self.owner = self.loader if skip == 0 else skip_first_batches(self.loader, skip)
        self.owner.iteration = self.epoch
        return DataLoaderShard.__iter__(self.owner)

    def close(self) -> None:
        if self.it is not None:
            self.it.close()
            self.owner.end()  # off accelerate's stack of active loaders (a no-op when it ended)
        self.it = self.owner = None


def rebrand(obj, cls, accel):
    """Make accelerate's wrapper `obj` one of our subclasses `cls` (same object, same state), so
    that code holding it keeps it; `cls` asks `accel` whether the body is void."""
    obj.__class__ = cls
    obj._checkpointless = accel
    return obj


def void_aware_loader(loader: DataLoaderShard, accel) -> "VoidAwareLoader":
    """The same prepared loader (a copy of its attributes) as a VoidAwareLoader."""
    copy = VoidAwareLoader.__new__(VoidAwareLoader)
    copy.__dict__.update(loader.__dict__)
    copy._checkpointless = accel
    return copy


class VoidAwareLoader(DataLoaderShard):
    """A prepared loader whose plain iteration (an evaluation loop) ends after the batch in hand
    once the body is void, instead of running every remaining batch for nothing."""

    _checkpointless = None

    def __iter__(self):
        it = DataLoaderShard.__iter__(self)
        finished = False
        try:
            for batch in it:
                yield batch
                if self._checkpointless.recovering:
                    return
            finished = True
        finally:
            if not finished:
                it.close()
                self.end()

    def __reduce__(self):
        return DataLoaderShard.__reduce__(self)


class VoidAwareOptimizer(AcceleratedOptimizer):
    """accelerate's optimizer wrapper; no update in a void pass (its gradients were not summed)."""

    _checkpointless = None

    def step(self, closure=None):
        if self._checkpointless.recovering:
            return None
        return super().step(closure)


class VoidAwareScheduler(AcceleratedScheduler):
    """accelerate's scheduler wrapper; it moves only with an update that was applied."""

    _checkpointless = None

    def step(self, *args, **kwargs):
        accel = self._checkpointless
        if accel.recovering and not accel.job.steploop.update_applied:
            return None
        return super().step(*args, **kwargs)
