"""A reshard's rows moved tensor by tensor (checkpointless/worker/reshard_stream.py), in one
spawn of 4 gloo processes: each member gets exactly torch.chunk's (FSDP2's) chunks it wants of
every cut tensor, what is not cut comes from old slice 0, and no member holds the whole state.

Two exchanges: a shrink's (4 old slices, each member wanting its chunk of 3 and of 2, uneven
and empty chunks included) and a grow's (3 old slices, two of them sent by member 0 as a peer's
copies would be, member 3 a spare holding nothing, each member wanting its chunk of 4)."""
import io
import os
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.conftest import spawn_gloo  # noqa: E402


def _fulls() -> dict:
    g = torch.Generator().manual_seed(0)
    return {0: torch.randn(10, 3, generator=g), 1: torch.randn(3, generator=g),
            2: torch.randn(2, 4, generator=g)}


def _chunk(full: torch.Tensor, ways: int, index: int) -> torch.Tensor:
    chunks = torch.chunk(full, ways, dim=0)
    return chunks[index] if index < len(chunks) else full[:0]


def _slice(ways: int, index: int, module) -> dict:
    """Old slice `index` of `ways`: AdamW's moments cut, its 0-dim step and a plain module's
    entries and a non-tensor value the same in every slice."""
    state = {idx: {"step": torch.tensor(7.0), "exp_avg": _chunk(f, ways, index),
                   "exp_avg_sq": _chunk(f * f, ways, index)} for idx, f in _fulls().items()}
    return {"optim": {"state": state, "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}]},
            "model": module.state_dict(), "other": index}


EXCHANGES = {  # name: (old ways, sender of each old slice, each member's wanted chunks)
    "shrink": (4, [0, 1, 2, 3], [[(3, m % 3), (2, m % 2)] for m in range(4)]),
    "grow": (3, [2, 0, 0], [[(4, m)] for m in range(4)]),
}


def _exchange(rank, port, q):
    from checkpointless.worker import reshard_stream
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4)
    torch.manual_seed(0)
    module = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW([torch.nn.Parameter(f.clone()) for f in _fulls().values()])
    state = SimpleNamespace(objects={"optim": opt, "model": module, "other": object()})
    me = SimpleNamespace(world_size=4, rank=rank)
    out = {}
    for name, (ways, src_of, wants) in EXCHANGES.items():
        payloads = {s: _slice(ways, s, module) for s in range(ways) if src_of[s] == rank}
        out[name] = reshard_stream.stream(state, me, ways, src_of, payloads, wants)
    buf = io.BytesIO()
    torch.save(out, buf)
    q.put((rank, buf.getvalue()))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def exchanged():
    return {rank: torch.load(io.BytesIO(b), weights_only=False)
            for rank, b in spawn_gloo(_exchange, 4, timeout=90)}


@pytest.mark.parametrize("name", sorted(EXCHANGES))
def test_each_member_gets_exactly_its_wanted_chunks(exchanged, name):
    _, _, wants = EXCHANGES[name]
    torch.manual_seed(0)
    module = torch.nn.Linear(2, 2)
    for rank, got in exchanged.items():
        chunks, moved = got[name]
        assert sorted(chunks) == sorted(wants[rank])
        for (ways, index), st in chunks.items():
            for idx, f in _fulls().items():
                for key, whole in (("exp_avg", f), ("exp_avg_sq", f * f)):
                    want = _chunk(whole, ways, index)
                    mine = st["optim"]["state"][idx][key]
                    assert mine.shape == want.shape and torch.equal(mine, want), \
                        (name, rank, ways, index, idx, key)
                assert torch.equal(st["optim"]["state"][idx]["step"], torch.tensor(7.0))
            assert st["optim"]["param_groups"] == [{"lr": 0.1, "params": [0, 1, 2]}]
            assert st["other"] == 0 and torch.equal(st["model"]["weight"], module.weight)
        assert moved > 0 or name == "grow" and rank == 0, (name, rank)
    # an empty chunk: the 2-row tensor cut 3 ways, and the 3-row one cut 4 ways
    assert exchanged[2]["shrink"][0][(3, 2)]["optim"]["state"][2]["exp_avg"].shape == (0, 4)
    assert exchanged[3]["grow"][0][(4, 3)]["optim"]["state"][1]["exp_avg"].shape == (0,)
