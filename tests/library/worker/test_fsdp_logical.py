"""FSDP2 under shrink=exact: the logical-order reduce-scatter (worker/fsdp_logical.py) gives the
same bits on 4, 3 and 2 processes (and on 2 x 2 under HSDP), each process holding FSDP2's dim-0
chunk of every parameter that a reshard cuts (test_reshard_stream.py).

The training runs in one spawn of 4 gloo processes: the 3- and 2-process jobs are subgroups of it
(as in test_logical_ranks.py), so one start-up covers them all."""
import io
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from checkpointless.protocol.placement import Placement  # noqa: E402
from tests.conftest import spawn_gloo  # noqa: E402

L, STEPS, MICRO, CLIP = 4, 3, 2, 0.05
# (the world's ranks that form the job, the processes lost from the identity placement)
JOBS = [((0, 1, 2, 3), []), ((0, 1, 2), [1]), ((0, 1), [1, 3])]


def _chunk(full: torch.Tensor, ways: int, index: int) -> torch.Tensor:
    """FSDP2's chunk `index` of `full` cut `ways` ways (torch.chunk on dim 0, empty past the
    end): what reshard_stream.chunk_rows bounds."""
    chunks = torch.chunk(full, ways, dim=0)
    return chunks[index] if index < len(chunks) else full[:0]


def _model() -> torch.nn.Sequential:
    """Dim 0 of every parameter (13, 37, 3) divides by neither 3 nor 4: uneven chunks, and on 4
    processes the last layer's 3 rows leave one process an empty chunk."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(11, 13), torch.nn.Tanh(), torch.nn.Linear(13, 37),
                               torch.nn.Tanh(), torch.nn.Linear(37, 3))


def _loss(model, step: int, share: int, micro: int) -> torch.Tensor:
    """Logical rank `share`'s loss on micro-batch `micro` of `step`, over MICRO (accumulated)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * share + micro)
    return model(torch.randn(5, 11, generator=g)).pow(2).mean() / MICRO


def _in_order(parts):
    acc = parts[0].clone()
    for p in parts[1:]:
        acc = acc + p
    return acc


def _job(group, placement: Placement, replicate=None) -> dict:
    """STEPS steps of FSDP2 with LogicalFSDP: each step's gathered gradients, norm and gathered
    parameters after AdamW, and this process's final local shards. `replicate`: HSDP, the
    model sharded over `group` and its chunks' twins in `replicate`."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from checkpointless.worker.fsdp_logical import LogicalFSDP, exact_clip_grad_norm_
    me, model = dist.get_rank(group if replicate is None else None), _model()
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    lf, opt = LogicalFSDP(model, L), torch.optim.AdamW(params, lr=1e-2)
    steps = []
    for step in range(STEPS):
        lf.begin_step(placement, placement.processes < L, replicate)
        hosted = placement.hosted(me)
        for micro in range(MICRO):  # each micro-batch reduced, the sharded gradients add them
            for i, share in enumerate(hosted):
                lf.begin_pass(share, i == len(hosted) - 1)
                _loss(model, step, share, micro).backward()
        lf.end_step()
        grads = [p.grad.full_tensor() for p in params]
        norm = exact_clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append((grads, norm, [p.detach().full_tensor() for p in params]))
    return {"steps": steps, "local": [p.detach().to_local().clone() for p in params]}


def _by_hand() -> list:
    """The same training in one process on an unsharded model: each micro-batch's gradients
    summed ((g0 + g1) + g2) + g3 and divided by L, the first micro-batch's sum then the second's
    added (as FSDP accumulates the sharded gradients)."""
    from checkpointless.worker.fsdp_logical import exact_clip_grad_norm_
    model = _model()
    params = list(model.parameters())
    opt, steps = torch.optim.AdamW(params, lr=1e-2), []
    for step in range(STEPS):
        total = None
        for micro in range(MICRO):
            per_rank = []
            for share in range(L):
                model.zero_grad(set_to_none=True)
                _loss(model, step, share, micro).backward()
                per_rank.append([p.grad.clone() for p in params])
            summed = [_in_order([g[i] for g in per_rank]) / L for i in range(len(params))]
            total = summed if total is None else [a + b for a, b in zip(total, summed)]
        for p, g in zip(params, total):
            p.grad = g
        grads = [p.grad.clone() for p in params]
        norm = exact_clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append((grads, norm, [p.detach().clone() for p in params]))
    return steps


def _train(rank, port, q):
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4)
    torch.set_num_threads(1)
    out = {}
    for ranks, lost in JOBS:
        group = dist.new_group(list(ranks))  # every process makes every group, in one order
        if rank in ranks:
            placement = Placement.identity(L).shrink(lost) if lost else Placement.identity(L)
            out[len(ranks)] = _job(group, placement)
    # HSDP: 2 replica groups of 2, shard groups (0, 1) and (2, 3), twins (0, 2) and (1, 3)
    shards = [dist.new_group(r) for r in ((0, 1), (2, 3))]
    twins = [dist.new_group(r) for r in ((0, 2), (1, 3))]
    out["hsdp"] = _job(shards[rank // 2], Placement.identity(L), twins[rank % 2])
    if rank == 0:
        out["hand"] = _by_hand()  # with the workers' thread count: one thread
    buf = io.BytesIO()
    torch.save(out, buf)  # by value: the sender exits before the test reads the tensors
    q.put((rank, buf.getvalue()))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def trained():
    """{world rank: {processes: that job's results, "hand": the one-process reference}}."""
    return {rank: torch.load(io.BytesIO(out))
            for rank, out in spawn_gloo(_train, 4, timeout=120)}


def _equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_gradients_norm_and_adamw_params_are_the_same_on_4_3_and_2_processes(trained):
    ref = trained[0][4]["steps"]
    for procs in (3, 2):
        for step, (grads, norm, params) in enumerate(trained[0][procs]["steps"]):
            assert _equal(grads, ref[step][0]), (procs, step, "gradients")
            assert torch.equal(norm, ref[step][1]), (procs, step, "norm")
            assert _equal(params, ref[step][2]), (procs, step, "parameters after AdamW")
    # the training moved: the steps' gradients differ (the comparison is not of constants)
    assert not _equal(ref[0][0], ref[1][0])


def test_hsdp_gives_the_bits_of_fsdp_and_twins_hold_the_same_chunks(trained):
    """Under HSDP (2 x 2) the logical reduce-scatter over the world gives every step the fsdp
    job's gradients, norm and parameters; each process's local shard is chunk s of 2 of the
    whole, the same bits as its twin's."""
    ref = trained[0][4]["steps"]
    for step, (grads, norm, params) in enumerate(trained[0]["hsdp"]["steps"]):
        assert _equal(grads, ref[step][0]), (step, "gradients")
        assert torch.equal(norm, ref[step][1]), (step, "norm")
        assert _equal(params, ref[step][2]), (step, "parameters after AdamW")
    full = ref[-1][2]
    for rank in range(4):
        want = [_chunk(f, 2, rank % 2) for f in full]
        assert _equal(trained[rank]["hsdp"]["local"], want), rank


def test_4_process_result_is_the_hand_made_logical_order_sum(trained):
    """The 4-process gradients are ((g0 + g1) + g2) + g3 over L, bit for bit, computed on one
    unsharded model; the norm and AdamW's parameters follow with the same bits."""
    hand = trained[0]["hand"]
    for step, (grads, norm, params) in enumerate(trained[0][4]["steps"]):
        assert _equal(grads, hand[step][0]), (step, "gradients")
        assert torch.equal(norm, hand[step][1]), (step, "norm")
        assert _equal(params, hand[step][2]), (step, "parameters after AdamW")


def test_the_summation_order_shows_in_the_bits():
    """The comparisons above can fail: plain FSDP2's ring or tree orders sum the same logical
    gradients into other bits, e.g. (g0 + g1) + (g2 + g3) or the reverse order."""
    model = _model()
    per_rank = []
    for share in range(L):
        model.zero_grad(set_to_none=True)
        for micro in range(MICRO):
            _loss(model, 0, share, micro).backward()
        per_rank.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    ref = _in_order(per_rank)
    assert not torch.equal(ref, (per_rank[0] + per_rank[1]) + (per_rank[2] + per_rank[3]))
    assert not torch.equal(ref, _in_order(per_rank[::-1]))


def test_fsdp2_shards_are_reshard_chunks(trained):
    """Each process's local shard is torch.chunk's of the whole parameter for its job's size,
    empty chunk included (3 rows on 4 processes)."""
    for procs, ranks in ((4, (0, 1, 2, 3)), (3, (0, 1, 2)), (2, (0, 1))):
        full = trained[0][procs]["steps"][-1][2]
        for me, rank in enumerate(ranks):
            want = [_chunk(f, procs, me) for f in full]
            assert _equal(trained[rank][procs]["local"], want), (procs, me)
    assert trained[3][4]["local"][-1].shape == (0,)  # the last bias: 3 rows, no 4th chunk
