"""Recipes: loading, overrides, deletion, and an error for every kind of bad input."""
import subprocess
import sys

import pytest

from launcher.recipes import RecipeError, load, recipe_names
from tests.conftest import ROOT

SHIPPED = ["llama3-8b", "llama3-70b", "llama3.2-1b", "gpt2", "gpt2-xl", "gpt-oss-20b",
           "tiny-llama", "tiny-gpt2", "tiny-demo"]


def test_every_required_recipe_is_shipped():
    assert set(SHIPPED) <= set(recipe_names())


@pytest.mark.parametrize("name", recipe_names())
def test_every_shipped_recipe_validates(name):
    cfg = load(name)
    assert cfg.description and cfg.run.output_dir and cfg.trainer.max_steps >= 1
    assert cfg.distributed.strategy in ("ddp", "fsdp")


@pytest.mark.parametrize("name", recipe_names())
def test_every_recipe_opens_with_a_header_saying_how_to_launch(name):
    head = (ROOT / "recipes" / f"{name}.yaml").read_text().splitlines()[:8]
    text = "\n".join(head)
    assert head[0].startswith("#") and "Launch:" in text and "Override:" in text


def test_large_recipes_name_real_hub_ids_bf16_and_shard_when_needed():
    for name in ["llama3-8b", "llama3-70b", "gpt-oss-20b", "gpt2-xl"]:
        cfg = load(name)
        assert "/" in cfg.model.id and cfg.trainer.precision == "bf16"
        assert cfg.distributed.strategy == "fsdp" and cfg.data.source == "hub"


def test_base_defaults_are_merged_not_copied():
    assert "heartbeat_timeout_s" not in (ROOT / "recipes" / "llama3-8b.yaml").read_text()
    assert load("llama3-8b").checkpointless.enabled is True


def test_overrides_set_typed_values():
    cfg = load("tiny-llama", ["trainer.max_steps=7", "optim.lr=3e-4", "model.config.hidden_size=64"])
    assert cfg.trainer.max_steps == 7 and cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.model.config.hidden_size == 64


def test_tilde_deletes_a_key_back_to_its_default():
    assert len(load("tiny-demo").faults) == 1
    assert len(load("tiny-demo", ["~faults"]).faults) == 0
    cfg = load("tiny-llama", ["~model.config.num_hidden_layers"])
    assert "num_hidden_layers" not in cfg.model.config


def test_fault_shorthand():
    f = load("tiny-llama", ["faults=[kill:2:5,hang:1:7]"]).faults
    assert [(x.kind, x.rank, x.step) for x in f] == [("kill", 2, 5), ("hang", 1, 7)]


def test_interpolation_resolves_output_dir():
    assert load("tiny-llama", ["run.name=abc"]).run.output_dir == "runs/abc"


@pytest.mark.parametrize("overrides, must_say", [
    (["trainer.max_stpes=7"], ["trainer.max_stpes", "Did you mean 'trainer.max_steps'"]),
    (["optim.learning_rate=1"], ["optim.learning_rate", "optim.lr"]),
    (["trainer.max_steps=abc"], ["trainer.max_steps", "'abc'"]),
    (["distributed.strategy=zero"], ["distributed.strategy", "'zero'", "ddp, fsdp"]),
    (["distributed.num_processes=0"], ["distributed.num_processes", "0", ">= 1"]),
    (["faults=[kill:9:5]"], ["faults[0].rank", "9", "0..3"]),
    (["faults=[explode:1:5]"], ["faults[0].kind", "explode"]),
    (["faults=[kill:1:5000]"], ["faults[0].step", "5000"]),
    (["faults=[kill:1]"], ["kill:1", "kind:rank:step"]),
    (["model.init=pretrained"], ["model.id", "pretrained"]),
    (["trainer.max_steps"], ["key=value"]),
    (["~trainer.nope"], ["trainer.nope"]),
])
def test_bad_input_is_refused_naming_key_value_and_fix(overrides, must_say):
    with pytest.raises(RecipeError) as err:
        load("tiny-llama", overrides)
    for text in must_say:
        assert text in str(err.value)


def test_unknown_recipe_suggests_the_closest():
    with pytest.raises(RecipeError, match="Did you mean 'tiny-llama'"):
        load("tiny-lama")


def test_recipe_from_a_path(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text("extends: null\nrun: {name: mine}\ntrainer: {max_steps: 3}\n")
    assert load(str(p)).trainer.max_steps == 3


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_cli_show_prints_the_resolved_recipe():
    r = _cli("show", "llama3-8b", "trainer.max_steps=7")
    assert r.returncode == 0 and "max_steps: 7" in r.stdout


def test_cli_train_refuses_a_misspelled_key_before_any_worker_starts(tmp_path):
    out = tmp_path / "run"
    r = _cli("train", "tiny-llama", "trainer.max_stpes=7", f"run.output_dir={out}")
    assert r.returncode == 2
    assert "Did you mean 'trainer.max_steps'" in r.stderr
    assert not out.exists()  # nothing was started, nothing written


def test_cli_ls_and_validate():
    r = _cli("ls")
    assert r.returncode == 0 and all(n in r.stdout for n in SHIPPED)
    r = _cli("validate")
    assert r.returncode == 0 and r.stdout.count("ok ") == len(recipe_names())
