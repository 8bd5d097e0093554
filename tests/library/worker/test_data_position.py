"""A loader's position (checkpointless/worker/data.py): resuming mid-epoch draws the same batches as the
uninterrupted epoch, a redone step gets its batch again, unsupported loaders are refused."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from torch.utils.data import (DataLoader, DistributedSampler, IterableDataset, RandomSampler,
                              TensorDataset)

from checkpointless import protocol
from checkpointless.worker.data import END, Cursor, check_loader, iterate_from
from checkpointless.worker.state import ProtectedState

DATA = TensorDataset(torch.arange(203).float().unsqueeze(1), torch.arange(203))


def _loader(workers=0, rank=1, **kw):
    sampler = DistributedSampler(DATA, num_replicas=3, rank=rank, seed=7, shuffle=True)
    sampler.set_epoch(4)
    kw.setdefault("batch_size", 8)
    return DataLoader(DATA, sampler=sampler, num_workers=workers, **kw)


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            assert torch.equal(u, v)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kw", [{}, {"drop_last": True}, {"batch_size": None}])
def test_resuming_mid_epoch_yields_the_rest_of_the_same_epoch(workers, kw):
    loader = _loader(workers, **kw)
    full = list(loader)
    for skip in (0, 1, 5, len(full) - 1, len(full)):
        _same(list(iterate_from(loader, skip)), full[skip:])


def test_the_order_is_the_epochs_and_the_ranks():
    a, b = _loader(rank=0), _loader(rank=1)
    assert not torch.equal(next(iter(a))[1], next(iter(b))[1])
    a.sampler.set_epoch(5)
    assert not torch.equal(next(iter(a))[1], next(iter(_loader(rank=0)))[1])


def test_the_cursor_redoes_skips_and_ends():
    loader = _loader()
    full = list(loader)
    c = Cursor(loader)
    first = c.batch(0)
    again = c.batch(0)  # a step redone after a recovery trains on the very same batch: its
    assert again is not first and all(a is b for a, b in zip(again, first))  # own list of them
    _same([c.batch(1), c.batch(3)], [full[1], full[3]])  # moved on one step by a peer's state
    _same([c.batch(7)], [full[7]])  # far ahead: a fresh iterator past the skipped batches
    assert c.batch(len(full)) is END
    _same([Cursor(loader).batch(len(full) - 1)], [full[-1]])  # a replacement's first batch


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(10))


@pytest.mark.parametrize("loader, says", [
    (DataLoader(DATA, sampler=RandomSampler(DATA)), "RandomSampler"),
    (DataLoader(_Stream()), "IterableDataset"),
    ([1, 2, 3], "DataLoader"),
])
def test_a_loader_whose_position_cannot_be_rebuilt_is_refused(loader, says):
    with pytest.raises(TypeError, match=says):
        check_loader(loader)
    with pytest.raises(TypeError, match=says):
        ProtectedState(protocol.Spec()).protect(loader=loader)


def test_the_protected_state_holds_the_position_not_the_loader():
    st = ProtectedState(protocol.Spec())
    st.protect(loader=_loader())
    assert st.state() == {"loader": {"epoch": 0, "epoch_start": 0}}
    st.load({"loader": {"epoch": 2, "epoch_start": 19}})
    assert st.objects["loader"].epoch == 2 and st.objects["loader"].epoch_start == 19


def test_torchdatas_stateful_dataloader_is_supported_like_a_dataloader():
    from torchdata.stateful_dataloader import StatefulDataLoader
    sampler = DistributedSampler(DATA, num_replicas=2, rank=0, seed=1)
    sampler.set_epoch(3)
    loader = StatefulDataLoader(DATA, batch_size=4, sampler=sampler, num_workers=2)
    check_loader(loader)
    _same(list(iterate_from(loader, 5)), list(loader)[5:])
