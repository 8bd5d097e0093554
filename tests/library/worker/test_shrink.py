"""checkpointless.shrink in-process: the keys refused where a shrink is not built, a plan's
placement read back by each worker, and a hosting process's step by logical rank against the
processes it replaces (the model-level bits: the same gradients and loss)."""
import os
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from checkpointless.protocol import membership  # noqa: E402
from checkpointless.worker.hosting import LogicalRanks  # noqa: E402
from checkpointless.worker.logical import Placement  # noqa: E402
from launcher.recipe.load import RecipeError, load  # noqa: E402


@pytest.mark.parametrize("overrides,key", [
    (["checkpointless.shrink=fast", "distributed.strategy=hsdp", "distributed.shard_size=2"],
     "checkpointless.shrink='fast': under hsdp is built as exact only"),
    (["checkpointless.shrink=exact", "distributed.strategy=fsdp", "distributed.tp_size=2"],
     "checkpointless.shrink='exact': needs one process per data-parallel rank"),
    (["checkpointless.shrink=fast", "distributed.strategy=fsdp"],
     "checkpointless.shrink='fast': under fsdp is built as exact only"),
    (["checkpointless.shrink=exact", "distributed.strategy=fsdp", "distributed.num_processes=2"],
     "checkpointless.shrink='exact': under fsdp needs distributed.num_processes >= 3"),
    (["checkpointless.shrink=fast", "distributed.pp_size=2"],
     "checkpointless.shrink='fast': needs one process per data-parallel rank"),
    (["checkpointless.shrink=off", "checkpointless.shrink_max_hosted=2"],
     "checkpointless.shrink_max_hosted=2: applies with"),
    (["checkpointless.shrink=half"], "checkpointless.shrink"),
])
def test_shrink_keys_that_cannot_apply_are_refused_before_launch(overrides, key):
    with pytest.raises(RecipeError) as exc:
        load("tiny-llama", overrides)
    assert key in str(exc.value), str(exc.value)


def test_auto_is_exact_where_a_shrink_is_built_else_off():
    assert load("tiny-llama").checkpointless.shrink == "exact"
    assert load("tiny-llama", ["checkpointless.enabled=false"]).checkpointless.shrink == "exact"
    audits = ["checkpointless.audit.every=2", "checkpoint.interval=4"]  # exact's numerics; the
    assert load("tiny-llama", audits).checkpointless.shrink == "exact"  # supervisor then waits
    assert load("tiny-llama", ["distributed.strategy=fsdp"]).checkpointless.shrink == "exact"
    hsdp = ["distributed.strategy=hsdp", "distributed.shard_size=2"]
    assert load("tiny-llama", hsdp).checkpointless.shrink == "exact"
    for other in (["distributed.strategy=fsdp", "distributed.num_processes=2"],
                  [*hsdp, "distributed.tp_size=2", "distributed.num_processes=8"],
                  ["distributed.pp_size=2"], ["distributed.strategy=fsdp", "peft.method=lora"]):
        assert load("tiny-llama", other).checkpointless.shrink == "off", other
    assert load("tiny-llama", ["checkpointless.shrink=fast"]).checkpointless.shrink == "fast"
    # a bare `off` is a YAML boolean: the word is what a choice key means by it
    off = load("tiny-llama", ["checkpointless.shrink=off", "checkpointless.straggler.action=off"])
    assert off.checkpointless.shrink == "off" and off.checkpointless.straggler.action == "off"


def test_a_shrunk_plan_gives_each_worker_its_logical_ranks_and_the_whole_placement():
    store = {}

    class Store:  # what publish and follow call of a TCPStore
        def multi_set(self, keys, values):
            store.update(zip(keys, values))

        def set(self, k, v):
            store[k] = v

        def compare_set(self, k, expected, new):
            return store[k].encode() if k in store else expected.encode()

    before = membership.Plan(gen=0, world_size=4, ranks={0: 0, 1: 1, 2: 2, 3: 3})
    shrunk = Placement.identity(4).shrink(1)  # survivors 0, 2, 3 renumbered 0, 1, 2
    plan = membership.Plan(gen=1, world_size=3, ranks={0: 0, 2: 1, 3: 2}, logical_world=4,
                           hosts={0: [0, 1], 2: [2], 3: [3]})
    membership.publish(Store(), plan, before)
    seats = {w: membership.follow(Store(), w, 0, before.ranks[w], 0, 1) for w in (0, 2, 3)}
    assert membership.follow(Store(), 1, 0, 1, 0, 1) is None  # the lost worker holds nothing
    assert {w: s.rank for w, s in seats.items()} == {0: 0, 2: 1, 3: 2}
    assert {w: s.logical_ranks for w, s in seats.items()} == {0: (0, 1), 2: (2,), 3: (3,)}
    assert all(s.logical_size == 4 and s.world_size == 3 for s in seats.values())
    assert Placement(4, seats[0].placement) == shrunk
    # identity placements publish none: a worker's logical rank is its rank
    plain = membership.Plan(gen=2, world_size=4, ranks={0: 0, 2: 1, 3: 2, 9: 3})
    membership.publish(Store(), plain, plan)
    seat = membership.follow(Store(), 9, 0, -1, 1, 2)
    assert seat.logical_ranks == (3,) and seat.logical_size == 4 and seat.placement == ()


class _Host(LogicalRanks):
    """A Job's logical side on one process (no process group: it hosts every rank)."""

    def __init__(self, placement):
        self.rank, self.world_size = 0, 1
        self._rec = SimpleNamespace(plan=membership.Seat(
            gen=1, world_size=1, rank=0, node=0, members_here=1, nodes=1, lost=0,
            t_published=0.0, logical_world=placement.logical_world,
            placement=placement.hosts))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _contribution(host, model, share):
    g = torch.Generator().manual_seed(share)
    x, y = torch.randn(4, 8, generator=g) * 10 ** share, torch.randn(4, 1, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    return host.flat_grads(model.parameters(), extra=loss.detach().reshape(1))


@pytest.mark.parametrize("shrink", ["exact", "fast"])
def test_one_process_hosting_four_logical_ranks_averages_them_in_logical_order(shrink):
    """What four processes would average, by one process: its `.grad`s are the logical ranks'
    gradients summed in order 0..3 and divided by 4; the extra (the loss) summed."""
    model = _model()
    host = _Host(Placement(4, ((0, 1, 2, 3),)))
    assert host.logical_ranks == (0, 1, 2, 3) and host.logical_world == 4 and host.shrunk
    contributions = {r: _contribution(host, model, r) for r in host.logical_ranks}
    assert all(p.grad is None for p in model.parameters())  # kept apart, not accumulated
    loss = host.reduce_logical(model.parameters(), contributions, exact=shrink == "exact")
    total = contributions[0].clone()
    for r in (1, 2, 3):
        total += contributions[r]
    n = sum(p.numel() for p in model.parameters())
    got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert torch.equal(got, total[:n] / 4) and torch.equal(loss, total[n:])
    reverse = contributions[3] + contributions[2] + contributions[1] + contributions[0]
    assert not torch.equal(reverse[:n] / 4, got)  # the order shows: the check above can fail


def test_a_redone_step_reuses_the_contributions_kept_until_the_state_moves():
    """A step a peer's failure cut short is redone on the same state: each hosted rank's
    contribution computed before is reused; a commit or a restore (drop) ends that."""
    from checkpointless.worker.grads import KeptGrads
    model, host = _model(), _Host(Placement.identity(4).shrink(3))
    host._kept = KeptGrads()
    model(torch.ones(2, 8)).sum().backward()
    flat = host.flat_grads(model.parameters(), keep=(5, 2))
    assert host.kept_contribution(5, 2) is flat
    assert host.kept_contribution(5, 1) is None and host.kept_contribution(6, 2) is None
    host._kept.drop()  # committed, or the state restored: nothing is reused
    assert host.kept_contribution(5, 2) is None


def test_one_call_reduces_by_logical_rank_and_a_redo_computes_only_what_was_not_kept():
    """`reduce_by_logical_rank` gives what the explicit calls give (the gradients and the loss
    bit for bit); redoing the same step after a peer's failure computes no hosted rank again."""
    from checkpointless.worker.grads import KeptGrads
    model, host = _model(), _Host(Placement(4, ((0, 1, 2, 3),)))
    host._kept = KeptGrads()
    by_hand = {r: _contribution(host, model, r) for r in host.logical_ranks}
    want_loss = host.reduce_logical(model.parameters(), by_hand)
    want = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    computed = []

    def compute(share):
        computed.append(share)
        g = torch.Generator().manual_seed(share)
        x, y = torch.randn(4, 8, generator=g) * 10 ** share, torch.randn(4, 1, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss.detach().reshape(1)

    for _ in range(2):  # the step, then its redo on the same state
        loss = host.reduce_by_logical_rank(model.parameters(), 7, compute)
        got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        assert torch.equal(got, want) and torch.equal(loss, want_loss)
    assert computed == [0, 1, 2, 3]


def test_the_memory_plan_counts_the_logical_reduction_and_bounds_the_hosted_ranks():
    """Under shrink=exact a ddp rank keeps its contribution and the sum (fp32) to the step's
    end; each logical rank hosted after a shrink keeps one more: the launcher bounds them by
    what the plan leaves free on the device (checkpointless.shrink_max_hosted unset)."""
    from launcher.run.supervise import shrink_max_hosted
    from launcher.plan.fit import max_hosted, plan
    exact, off = plan(load("gpt2")), plan(load("gpt2", ["checkpointless.shrink=off"]))
    row = [i for i in exact.items if i.name == "logical reduction"]
    assert row and row[0].device["optimizer step"] == 2 * exact.trainable * 4
    assert not [i for i in off.items if i.name == "logical reduction"]
    room = max_hosted(exact)
    assert room == 1 + (exact.budget - exact.peak) // (exact.trainable * 4) and room >= 2
    tight = plan(load("gpt2", [f"distributed.device_memory_gb={exact.peak / 1e9 * 1.001}"]))
    assert max_hosted(tight) == 1  # no room for a second: a shrink onto it is refused
    assert shrink_max_hosted(load("gpt2")) == room
    assert shrink_max_hosted(load("gpt2", ["checkpointless.shrink_max_hosted=3"])) == 3
    assert shrink_max_hosted(load("tiny-llama")) == 0  # cpu: no plan, no limit


def test_under_fsdp_the_plan_counts_the_gathered_model_of_a_shrunk_step():
    """Under fsdp with shrink=exact a shrunk process keeps the whole model gathered for the
    step, then one fp32 contribution per extra hosted rank: the hosted ranks are bounded by
    both. A failure-free step holds what fsdp holds (each micro-batch reduce-scattered)."""
    from launcher.plan.fit import max_hosted, plan
    over = ["distributed.strategy=fsdp", "checkpointless.shrink=exact", "distributed.device=cuda"]
    cfg = load("llama3.2-1b", over + ["trainer.grad_accum_steps=2"])
    exact = plan(cfg)
    assert not [i for i in exact.items if i.name == "logical reduction"]
    gathered = 2 if cfg.trainer.precision == "bf16" else 4  # fsdp gathers in bf16 under bf16
    assert exact.hosted_base == exact.facts.n_params * gathered
    room = exact.budget - exact.peak - exact.hosted_base
    assert max_hosted(exact) == (1 + room // (exact.trainable * 4) if room > 0 else 1)
    off = over[:1] + over[2:] + ["checkpointless.shrink=off"]
    assert plan(load("llama3.2-1b", off)).hosted_base == 0


def test_under_fsdp_a_shrink_stops_where_the_plan_no_longer_fits():
    """Fewer fsdp processes each hold a larger chunk and host more logical ranks: the launcher
    gives the supervisor the fewest processes whose plan fits with them (one fewer does not),
    and a smaller device budget raises it; cpu (no plan) and ddp keep 2 and 1."""
    from launcher.run.supervise import shrink_min_processes
    from launcher.plan.fit import _with, max_hosted, plan
    over = ["distributed.strategy=fsdp", "checkpointless.shrink=exact", "distributed.device=cuda",
            "distributed.num_processes=8"]

    def on(p: int, budget: list):  # the 8-process recipe's plan for p processes
        return plan(_with(load("llama3.2-1b", [*over, *budget]),
                          {"distributed.num_processes": p}), search=False)

    def fits(p: int, budget: list) -> bool:
        got = on(p, budget)
        return got.fits and max_hosted(got) >= -(-8 // p)

    at = {p: on(p, []).peak for p in (2, 4, 8)}
    assert at[2] > at[4] > at[8]  # the chunk grows as processes are taken away
    seen = []
    for budget in ([], [f"distributed.device_memory_gb={at[8] * 1.05 / 1e9:.3f}"]):
        got = shrink_min_processes(load("llama3.2-1b", [*over, *budget]))
        assert 2 <= got <= 8 and fits(got, budget), (got, budget)
        assert got == 2 or not fits(got - 1, budget), (got, budget)
        seen.append(got)
    assert seen[1] > seen[0], seen  # a device just over the 8-process peak: fewer do not fit
    assert shrink_min_processes(load("tiny-llama", ["distributed.strategy=fsdp"])) == 2
    assert shrink_min_processes(load("tiny-llama")) == 1
