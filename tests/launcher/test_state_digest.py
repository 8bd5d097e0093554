"""report.json's `state_sha256` (launcher/train/state_digest.py): one digest per part of the
training state, each changing when only that part changes."""
import torch

from launcher.train.state_digest import data_sha256, optimizer_sha256, rng_sha256


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def test_one_optimizer_moment_changes_the_optimizer_digest_and_nothing_else_does():
    model, opt = _trained()
    before = optimizer_sha256(model, opt)
    assert optimizer_sha256(model, opt) == before  # a function of the state only
    params = [p.detach().clone() for p in model.parameters()]
    moment = opt.state[model[0].weight]["exp_avg"]
    old = moment[1, 2].item()
    moment[1, 2] = old + 1e-6  # one value of one moment, the parameters untouched
    assert optimizer_sha256(model, opt) != before
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters()))
    moment[1, 2] = old
    assert optimizer_sha256(model, opt) == before
    opt.state[model[2].bias]["exp_avg_sq"].mul_(2)  # the other moment, another parameter
    assert optimizer_sha256(model, opt) != before


def test_the_learning_rate_the_step_count_and_the_random_state_are_in_their_digests():
    model, opt = _trained()
    before = optimizer_sha256(model, opt)
    opt.param_groups[0]["lr"] = 2e-3
    assert optimizer_sha256(model, opt) != before
    opt.param_groups[0]["lr"] = 1e-3
    opt.state[model[0].bias]["step"] += 1
    assert optimizer_sha256(model, opt) != before
    torch.manual_seed(5)
    rng = rng_sha256()
    assert rng_sha256() == rng
    torch.rand(1)
    assert rng_sha256() != rng
    assert data_sha256(3, 100) != data_sha256(4, 100) and data_sha256(3, 100) == data_sha256(3, 100)
