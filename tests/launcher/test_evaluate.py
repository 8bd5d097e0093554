"""Validation loss is the same figure whatever the world size: each row's loss lands in its own
slot and the slots are summed in row order (launcher/train/evaluate.py). Plain torch and gloo."""
import math
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from launcher.train.evaluate import evaluate

ROWS, SEQ, VOCAB = 27, 16, 11


class TinyLM(torch.nn.Module):
    """Takes the model kwargs batch_of gives (input_ids, use_cache, ...) and returns .logits."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(VOCAB, 24)
        self.mix = torch.nn.Linear(24, 24)
        self.head = torch.nn.Linear(24, VOCAB)

    def forward(self, input_ids, **_):
        h = torch.tanh(self.mix(self.emb(input_ids)))
        return types.SimpleNamespace(logits=self.head(h.cumsum(dim=1) / 4))


class Rows:
    """The slice of a dataset that evaluate reads: ds[list_of_rows] -> dict of tensors."""

    def __init__(self):
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
        self.labels = self.ids.clone()
        self.labels[:, : SEQ // 3] = -100  # prompt tokens carry no loss
        self.labels[::4, -3:] = -100  # padding

    def __getitem__(self, rows):
        return {"input_ids": self.ids[rows], "labels": self.labels[rows]}


def _worker(rank, world, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                           world_size=world)
    torch.set_num_threads(1)
    result = evaluate(TinyLM(), Rows(), list(range(2, ROWS)), rank, world, 4,
                      torch.device("cpu"), torch.autocast("cpu", enabled=False))
    out.put((rank, result))
    dist.destroy_process_group()


def _run(world):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(world, port, out), nprocs=world, start_method="spawn")
    got = dict(out.get() for _ in range(world))
    assert all(r == got[0] for r in got.values())  # every rank holds the same figure
    return got[0]


@pytest.mark.slow  # processes of 4 workers: in make test, not make test-fast
def test_validation_loss_is_the_same_with_1_2_and_4_workers():
    one, two, four = _run(1), _run(2), _run(4)
    assert one["eval_tokens"] == two["eval_tokens"] == four["eval_tokens"]
    assert one["eval_tokens"] == int((Rows().labels[2:, 1:] != -100).sum())
    for other in (two, four):
        assert other["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-6)
    assert math.isclose(one["eval_ppl"], math.exp(one["eval_loss"]))
    assert 1.0 < one["eval_loss"] < 2 * math.log(VOCAB)
