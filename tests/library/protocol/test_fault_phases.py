"""Faults that strike inside a step's compute, and what a recovery must clear after one.

In-process on plain torch (FSDP in one spawned gloo process): the grammar of the new phases, the
moment `@backward` and `@optimizer` fire, and that a backward cut short leaves gradients in FSDP's
unsharded parameters that a redo would add to, unless the recovery drops them (group.reshard_all).
"""
import pytest
import torch

from checkpointless.worker.injector import FaultInjector, InjectedFault
from checkpointless.protocol.faults import parse_faults
from tests.conftest import spawn_gloo


class _Store:
    """The two store calls the injector makes (claims and fault times), in memory."""

    def __init__(self):
        self.d = {}

    def add(self, key, n):
        self.d[key] = self.d.get(key, 0) + n
        return self.d[key]

    def set(self, key, value):
        self.d[key] = value


def test_phases_parse_with_a_seed_for_random_and_refuse_what_cannot_fire():
    got = parse_faults(["kill:2:5@backward", "raise:1:3@optimizer", "hang:0:9@random:7",
                        {"kind": "kill", "rank": 1, "step": 4, "phase": "random"}])
    assert [(f.kind, f.rank, f.step, f.phase, f.seed) for f in got] == [
        ("kill", 2, 5, "backward", 0), ("raise", 1, 3, "optimizer", 0),
        ("hang", 0, 9, "random", 7), ("kill", 1, 4, "random", 0)]
    with pytest.raises(ValueError, match="cannot strike @random; there, use one of kill, hang"):
        parse_faults(["raise:1:3@random"])
    with pytest.raises(ValueError, match="only @random takes a seed"):
        parse_faults(["kill:1:3@backward:4"])
    with pytest.raises(ValueError, match="phase='forward' is not one of"):
        parse_faults(["kill:1:3@forward"])


class _Net(torch.nn.Module):
    """Four blocks and a head of the model's own (a transformer's lm_head: under FSDP it
    belongs to the root, whose gradients wait unsharded until the end of backward)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(4)])
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        for block in self.layers:
            x = torch.tanh(block(x))
        return self.head(x).square().sum()


def _blocks():
    return _Net()


def _forward(model, x):
    return model(x)


def test_backward_fires_after_the_later_half_has_gradients_and_before_the_earlier_half():
    model = _blocks()
    inj = FaultInjector(parse_faults(["raise:0:3@backward"]), _Store(), worker_id=0)
    inj.where = lambda: (0, 3)
    inj.install(model)
    with pytest.raises(InjectedFault, match="raise at rank 0, step 3 \\(backward\\)"):
        _forward(model, torch.ones(2, 8)).backward()
    layers = model.layers
    assert layers[3].weight.grad is not None and layers[2].weight.grad is None
    assert layers[0].weight.grad is None
    # the claim is the job's: the same fault never fires twice (a replacement redoes the step)
    model.zero_grad()
    _forward(model, torch.ones(2, 8)).backward()
    assert layers[0].weight.grad is not None
    # another rank or another step does not fire it
    inj2 = FaultInjector(parse_faults(["raise:0:3@backward"]), _Store(), worker_id=0)
    inj2.where = lambda: (1, 3)
    inj2.install(model)
    _forward(model, torch.ones(2, 8)).backward()


def test_optimizer_fires_as_step_begins_before_any_update():
    model = _blocks()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    inj = FaultInjector(parse_faults(["raise:0:2@optimizer"]), _Store(), worker_id=0)
    inj.where = lambda: (0, 2)
    inj.install(opt)
    _forward(model, torch.ones(2, 8)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(InjectedFault, match="\\(optimizer\\)"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _interrupted_backward_then_redo(rank, port, q):
    """One rank under FSDP2: a backward cut short in its middle, the recovery's reset, then the
    same step computed again; its gradients against a fresh model's."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from checkpointless.worker.group import reshard_all
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=1)

    def build():
        model = _blocks()
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        return model

    x = torch.linspace(-1, 1, 16).reshape(2, 8)
    clean = build()
    _forward(clean, x).backward()
    want = [p.grad.to_local().clone() for p in clean.parameters()]

    model = build()
    inj = FaultInjector(parse_faults(["raise:0:0@backward"]), _Store(), worker_id=0)
    inj.where = lambda: (0, 0)
    inj.install(model)
    try:
        _forward(model, x).backward()
        raise AssertionError("the fault did not fire")
    except InjectedFault:
        pass
    left = sum(1 for m in model.modules() for fp in getattr(
        getattr(getattr(m, "_get_fsdp_state", lambda: None)(), "_fsdp_param_group", None),
        "fsdp_params", []) if getattr(fp, "_unsharded_param", None) is not None and
        fp._unsharded_param.grad is not None)
    reshard_all([model])
    model.zero_grad(set_to_none=True)
    _forward(model, x).backward()
    got = [p.grad.to_local() for p in model.parameters()]
    q.put((left, all(torch.equal(a, b) for a, b in zip(want, got))))
    dist.destroy_process_group()


def test_a_backward_cut_short_leaves_no_gradient_for_the_redo_to_add_to():
    ((left, same),) = spawn_gloo(_interrupted_backward_then_redo, 1)
    assert left > 0  # the cut pass left the head's gradients unsharded (the trap)
    assert same  # and the redo's gradients are a clean pass's, to the bit


def test_start_up_phases_parse_and_an_init_fault_must_be_at_step_0():
    got = parse_faults(["kill:2:0@init", "hang:1:0@init", "kill:1:6@join", "raise:0:0@join"])
    assert [(f.kind, f.rank, f.step, f.phase) for f in got] == [
        ("kill", 2, 0, "init"), ("hang", 1, 0, "init"), ("kill", 1, 6, "join"),
        ("raise", 0, 0, "join")]
    sent = parse_faults(["kill:0:5@send", "hang:1:5@send"])
    assert [(f.kind, f.phase) for f in sent] == [("kill", "send"), ("hang", "send")]
    with pytest.raises(ValueError, match="cannot strike @send"):
        parse_faults(["corrupt:0:5@send"])
    with pytest.raises(ValueError, match="step=3 with phase=init"):
        parse_faults(["kill:2:3@init"])
    with pytest.raises(ValueError, match="cannot strike @init"):
        parse_faults(["raise:2:0@init"])
