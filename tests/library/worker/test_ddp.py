"""checkpointless.DistributedDataParallel on real gloo: overlapped buckets, fixed layout, exact."""
import torch
import torch.distributed as dist

from checkpointless import DistributedDataParallel
from tests.conftest import spawn_gloo

CAP_MB = 1100 * 4 / 2 ** 20  # 1,100 float32 gradients per bucket


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _loss(model, x):
    return model(x).pow(2).sum()


def _run(rank, port, q):
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))

    ref = _model()  # the reference: each gradient all-reduced on its own after backward
    _loss(ref, x).backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad /= 2
    ref_grads = [p.grad for p in ref.parameters()]

    model = _model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=CAP_MB)
    from checkpointless.worker import ddp as ddp_module
    first_layer_done_at_launch = []
    real = ddp_module._Sender.put

    def spy(self, t, what):  # when each bucket is handed to the sending thread
        first_layer_done_at_launch.append(model[0].weight.grad is not None)
        return real(self, t, what)

    ddp_module._Sender.put = spy
    try:
        _loss(ddp, x).backward()
    finally:
        ddp_module._Sender.put = real
    exact = all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), ref_grads))
    views = all(p.grad._base is not None for p in model.parameters())  # no copy back

    # no_sync: the first micro-batch accumulates locally, the second reduces both
    acc_model = _model()
    acc = DistributedDataParallel(acc_model, bucket_cap_mb=CAP_MB)
    with acc.no_sync():
        _loss(acc, x).backward()
    local = [p.grad.clone() for p in acc_model.parameters()]
    _loss(acc, x).backward()
    accumulated = all(torch.allclose(p.grad, 2 * r) for p, r in
                      zip(acc_model.parameters(), ref_grads))
    stayed_local = not all(torch.allclose(g, r) for g, r in zip(local, ref_grads))

    # a survivor redoing a step from the local gradients it kept: same buckets, same bits
    redo_model = _model()
    redo = DistributedDataParallel(redo_model, bucket_cap_mb=CAP_MB)
    with redo.no_sync():
        _loss(redo, x).backward()
    redo.reduce_now()
    redo_exact = all(torch.equal(p.grad, q_.grad) for p, q_ in
                     zip(redo_model.parameters(), model.parameters()))
    q.put((rank, exact, views, [len(b) for b in ddp.buckets], first_layer_done_at_launch,
           accumulated, stayed_local, redo_exact))
    dist.destroy_process_group()


def test_buckets_overlap_backward_and_average_exactly():
    for rank, exact, views, sizes, done_at_launch, acc, local, redo in spawn_gloo(_run, 2):
        assert exact  # two ranks: every element is a + b, bit-equal to per-tensor sums
        assert views  # the sums became .grad in place of a copy back
        assert sizes == [3, 2, 1]  # reverse registration order, cut at the cap: the model alone
        # the last layers' bucket was on the wire before the first layer's gradient existed
        assert done_at_launch == [False, False, True]
        assert acc and local
        assert redo


def test_torch_process_group_argument_is_refused():
    import pytest
    with pytest.raises(ValueError, match="process_group"):
        DistributedDataParallel(_model(), process_group=object())
