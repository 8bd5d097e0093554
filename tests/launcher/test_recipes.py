"""Recipes: loading, overrides, deletion, and an error for every kind of bad input."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.recipe.load import RecipeError, load, recipe_names
from launcher.recipe.schema import leaves
from tests.conftest import ROOT


@pytest.mark.parametrize("name", recipe_names())
def test_every_shipped_recipe_validates(name):
    assert load(name).description  # `launcher ls` shows it


@pytest.mark.parametrize("name", recipe_names())
def test_every_recipe_opens_with_a_header_saying_how_to_launch(name):
    head = (ROOT / "recipes" / f"{name}.yaml").read_text().splitlines()[:8]
    text = "\n".join(head)
    assert head[0].startswith("#") and "Launch:" in text and "Override:" in text


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
    f = load("tiny-llama", ["faults=[kill:2:5,hang:1:7@random:3]"]).faults
    assert [(x.kind, x.rank, x.step, x.phase, x.seed) for x in f] == [
        ("kill", 2, 5, "step", 0), ("hang", 1, 7, "random", 3)]


def test_a_fault_may_take_its_values_from_other_keys():
    f = load("tiny-llama", ["faults=[{rank: 1, step: '${trainer.log_every}'}]"]).faults[0]
    assert (f.kind, f.rank, f.step) == ("kill", 1, load("tiny-llama").trainer.log_every)


def test_every_key_with_choices_refuses_another_value_naming_them():
    for key, f in leaves():
        allowed = f.metadata.get("choices")
        if allowed:
            _refused("tiny-llama", [f"{key}=bogus"],
                     must_say=[f"{key}='bogus'", ", ".join(allowed), f"e.g. {key}={allowed[0]}"])


def test_lora_bounds_apply_only_under_lora():
    assert load("tiny-llama", ["peft.r=0", "peft.dropout=1"]).peft.r == 0  # unused: not checked
    _refused("tiny-llama", ["peft.method=lora", "peft.r=0"], must_say=["peft.r=0", ">= 1"])
    _refused("tiny-llama", ["peft.method=lora", "peft.dropout=1"],
             must_say=["peft.dropout=1", "[0, 1)"])


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
    (["faults=[kill:0:1,kill:1:3@forward]"], ["faults[1].phase", "'forward'", "choose one of"]),
    (["faults=[raise:1:3@random]"], ["faults[0].kind", "'raise'", "@random", "kill, hang"]),
    (["faults=[{kind: kill, rank: 1, step: 2, seed: 3}]"],
     ["faults[0].seed", "3", "only phase=random", "delete it"]),
    (["faults=[kill:1:3@backward:4]"], ["kill:1:3@backward:4", "only @random takes a seed"]),
    (["faults=[slow:2:5:0]"], ["faults[0].factor=0.0", "must be > 1"]),  # not "the default"
    (["faults=[slow:2:5:1]"], ["faults[0].factor=1.0", "must be > 1"]),
    (["faults=[{kind: kill, rank: 1, step: 2, factor: 0}]"], ["faults[0].factor", "kind=slow"]),
    (["model.init=pretrained"], ["model.id", "pretrained"]),
    (["trainer.max_steps"], ["key=value"]),
    (["~trainer.nope"], ["trainer.nope"]),
    (["trainer.precision=fp16"], ["trainer.precision='fp16'", "needs a GPU",
                                  "distributed.device=cpu", "trainer.precision=bf16"]),
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
    p.write_text("extends: null\nrun: {name: mine}\ntrainer: {max_steps: 3}\n"
                 "model: {name: llama, config: {hidden_size: 64}}\n")
    assert load(str(p)).trainer.max_steps == 3


def _recipe(tmp_path, text, name="mine.yaml"):
    p = tmp_path / name
    p.write_bytes(text) if isinstance(text, bytes) else p.write_text(text)
    return str(p)


def _refused(name_or_path, overrides=(), must_say=()):
    with pytest.raises(RecipeError) as err:
        load(name_or_path, list(overrides))
    for text in must_say:
        assert text in str(err.value), str(err.value)
    return str(err.value)


@pytest.mark.parametrize("text", ["", "\n\n", "# just a comment\n# and another\n", "null\n", "~\n",
                                  "description:\n", "description:\nmodel:\ntrainer:\n",
                                  "faults: []\nmodel: {}\n"])
def test_an_empty_recipe_file_is_refused_saying_what_a_recipe_needs(tmp_path, text):
    path = _recipe(tmp_path, text)
    msg = _refused(path, must_say=[path, "empty", "extends:", "model", "launcher show tiny-llama"])
    assert "Traceback" not in msg


@pytest.mark.parametrize("text", [
    "extends: _tiny\n",                                 # a base with no model in it
    "extends: _base\ntrainer: {max_steps: 3}\n",
    "run: {name: mine}\ntrainer: {max_steps: 3}\n",
    "extends: _tiny\nmodel: {gradient_checkpointing: true, size: 1M}\n",  # says nothing of which
])
def test_a_recipe_that_does_not_choose_a_model_is_refused(tmp_path, text):
    path = _recipe(tmp_path, text)
    _refused(path, must_say=[path, "model.name", "model.id", "model.config", "full-size Llama",
                             "extends: tiny-llama"])


def test_a_model_chosen_by_extends_by_the_file_or_by_an_override_is_enough(tmp_path):
    assert load(_recipe(tmp_path, "extends: tiny-llama\n")).model.config.hidden_size == 128
    gpt2 = load(_recipe(tmp_path, "extends: _tiny\nmodel: {name: gpt2, config: {n_layer: 2}}\n"))
    assert gpt2.model.name == "gpt2" and gpt2.trainer.max_steps == 200  # _tiny found in recipes/
    bare = _recipe(tmp_path, "extends: _tiny\ntrainer: {max_steps: 5}\n")
    assert load(bare, ["model.name=gpt2"]).model.name == "gpt2"
    # deleting the model by override leaves nothing chosen
    _refused("tiny-llama", ["~model"], must_say=["tiny-llama.yaml", "which model"])


def test_output_dir_naming_an_existing_file_is_refused(tmp_path):
    f = tmp_path / "taken"
    f.write_text("not a folder")
    _refused("tiny-llama", [f"run.output_dir={f}"],
             must_say=["run.output_dir", str(f), "existing file", "run.output_dir=runs/"])


def test_output_dir_under_an_existing_file_is_refused(tmp_path):
    f = tmp_path / "taken"
    f.write_text("not a folder")
    out = f / "sub" / "run"
    _refused("tiny-llama", [f"run.output_dir={out}"],
             must_say=["run.output_dir", str(out), f"{f} is a file", "run.output_dir=runs/"])


def test_output_dir_that_is_a_broken_link_is_refused(tmp_path):
    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "gone")
    _refused("tiny-llama", [f"run.output_dir={link}"],
             must_say=["run.output_dir", "broken symbolic link"])


def test_output_dir_that_cannot_be_created_is_refused_and_nothing_is_created(tmp_path,
                                                                            monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    out = locked / "a" / "b"
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == locked
                        else real_access(p, mode, **kw))
    _refused("tiny-llama", [f"run.output_dir={out}"],
             must_say=["run.output_dir", str(out), f"{locked} is not writable", "runs/"])
    _refused("tiny-llama", [f"run.output_dir={locked}"],
             must_say=["run.output_dir", "cannot write"])
    assert list(locked.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_output_dir_in_a_read_only_folder_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        _refused("tiny-llama", [f"run.output_dir={locked / 'run'}"],
                 must_say=["run.output_dir", "not writable"])
    finally:
        locked.chmod(0o700)


def test_other_folders_are_checked_too(tmp_path):
    f = tmp_path / "taken"
    f.write_text("x")
    _refused("tiny-llama", ["run.output_dir="], must_say=["run.output_dir", "blank"])
    _refused("tiny-llama", ["run.output_dir=' '"],
             must_say=["run.output_dir", "must name a folder"])
    _refused("tiny-llama", [f"data.cache_dir={f}"], must_say=["data.cache_dir", "existing file"])
    _refused("tiny-llama", ["checkpoint.interval=5", f"checkpoint.dir={f}"],
             must_say=["checkpoint.dir", "existing file"])
    ok = load("tiny-llama", [f"run.output_dir={tmp_path / 'new' / 'run'}"])  # creatable: fine
    assert ok.run.output_dir.endswith("new/run") and not (tmp_path / "new").exists()


@pytest.mark.parametrize("text, must_say", [
    ("- a\n- b\n", ["top level must be a mapping", "a list"]),
    ("just a string\n", ["top level must be a mapping", "'just a string'"]),
    ("3\n", ["top level must be a mapping"]),
    (b"extends: tiny-llama\ndescription: caf\xe9\n", ["not UTF-8", "0xe9"]),
    ("extends: tiny-llama\nmodel: [1, 2]\n", ["'model' must be a mapping", "list [1, 2]"]),
    ("extends: tiny-llama\ntrainer: 5\n", ["'trainer' must be a mapping", "int 5"]),
    ("extends: tiny-llama\nmodel: {config: [1]}\n", ["'model.config' must be a mapping"]),
    ("extends: tiny-llama\nfaults: {kind: kill}\n", ["'faults' must be a list"]),
    ("extends: tiny-llama\nfaults: [5]\n", ["'faults[0]' must be a mapping", "kill:1:5"]),
    ("extends: tiny-llama\nfaults: [{kind: kill, rank: 0, step: 1, x: 2}]\n",
     ["'faults[0].x'", "kind, rank, step"]),
    ("extends: tiny-llama\ndata: {files: {a: 1}}\n", ["'data.files' must be a list"]),
    ("extends: tiny-llama\nrun: {output_dir: [a]}\n", ["'run.output_dir' must be a single value"]),
    ("extends: tiny-llama\nmodel:\n", ["'model' is blank"]),
    ("extends: tiny-llama\n1: 2\n", ["unknown recipe key '1'"]),
    ("extends: [tiny-llama]\n", ["'extends' must be a single value"]),
    ("extends: 5\n", ["extends=5", "name of a recipe"]),
    ("extends: tiny-lama\n", ["extends='tiny-lama'", "Did you mean 'tiny-llama'"]),
    ("extends: mine\nmodel: {name: gpt2}\n", ["cycle"]),
    ("extends: tiny-llama\nfoo: 1\nfoo: 2\n", ["not valid YAML", "duplicate key"]),
])
def test_malformed_recipe_files_are_refused_naming_the_file_and_key(tmp_path, text, must_say):
    path = _recipe(tmp_path, text)
    msg = _refused(path, must_say=must_say)
    assert "mine.yaml" in msg


def test_a_folder_given_as_recipe_is_refused(tmp_path):
    d = tmp_path / "recipes.yaml"
    d.mkdir()
    _refused(str(d), must_say=[str(d), "is a folder"])
    _refused(str(tmp_path) + "/", must_say=["is a folder"])


def test_an_unreadable_recipe_is_refused(tmp_path, monkeypatch):
    path = _recipe(tmp_path, "extends: tiny-llama\n")
    def deny(self):
        raise PermissionError(13, "Permission denied", str(self))
    monkeypatch.setattr(Path, "read_bytes", deny)
    _refused(path, must_say=[path, "cannot be read", "Permission denied"])


def test_a_utf8_bom_is_fine(tmp_path):
    assert load(_recipe(tmp_path, b"\xef\xbb\xbfextends: tiny-llama\n")).model.name == "llama"


@pytest.mark.parametrize("overrides, must_say", [
    (["trainer.max_steps=-1"], ["trainer.max_steps", "-1", "at least 1"]),
    (["model.config=[1]"], ["'model.config' must be a mapping", "override 'model.config=[1]'"]),
    (["faults={a: 1}"], ["'faults' must be a list", "'faults=[kill:1:5]'"]),
    (["faults=kill:1:5"], ["'faults' must be a list", "'faults=[kill:1:5]'"]),
    (["trainer=[1]"], ["'trainer' must be a mapping", "trainer.max_steps="]),
    (["model=5"], ["'model' must be a mapping", "int 5"]),
    (["data.files={a: 1}"], ["'data.files' must be a list"]),
    (["trainer.max_steps={a: 1}"], ["'trainer.max_steps' must be a single value (int)"]),
    (["faults=[{kind: kill, rank: 0, step: 1, x: 2}]"], ["'faults[0].x'", "kind, rank, step"]),
    (["trainer.nope=1"], ["trainer.nope", "max_steps, micro_batch_size"]),
    (["=5"], ["'=5'", "names no key"]),
    (["~"], ["names no key"]),
    (["optim.lr=inf"], ["optim.lr", "inf", "finite"]),
    (["optim.weight_decay=nan"], ["optim.weight_decay", "finite"]),
    (["optim.beta1=1"], ["optim.beta1", "[0, 1)"]),
    (["optim.eps=0"], ["optim.eps", "> 0"]),
    (["optim.grad_clip=-1"], ["optim.grad_clip", ">= 0"]),
    (["checkpointless.pg_timeout_s=0"], ["checkpointless.pg_timeout_s", "> 0"]),
    (["run.output_dir=${nope}"], ["interpolation failed in 'run.output_dir'", "nope"]),
    (["trainer.max_steps=${trainer.max_steps}"], ["trainer.max_steps", "must not refer to itself"]),
])
def test_more_bad_overrides_are_refused(overrides, must_say):
    _refused("tiny-llama", overrides, must_say=must_say)


def test_cli_validate_reports_an_empty_recipe_without_a_traceback(tmp_path):
    path = _recipe(tmp_path, "# nothing here yet\n")
    r = _cli("validate", path)
    assert r.returncode == 1 and "INVALID" in r.stdout and "is empty" in r.stdout
    assert "Traceback" not in r.stdout + r.stderr
    r = _cli("show", "tiny-llama", "model.config=[1]")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "model.config" in r.stderr


def test_cli_train_refuses_an_output_dir_that_is_a_file(tmp_path):
    f = tmp_path / "taken"
    f.write_text("x")
    r = _cli("train", "tiny-llama", f"run.output_dir={f}", "trainer.max_steps=2")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "run.output_dir" in r.stderr and "existing file" in r.stderr


def _cli(*args):
    """`python -m launcher ARGS`: its exit code, stdout and stderr. `train` runs in a process of
    its own (past its refusals it would start workers); ls, show and validate only read recipes,
    so they run in this process through the same main() (each process would import torch and
    transformers again: about 3 s apiece on 2 cores). An exception escaping main() fails the
    test as the traceback a process would print."""
    if args[0] == "train":
        return subprocess.run([sys.executable, "-m", "launcher", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
    import contextlib
    import io

    from launcher.cli import main
    out, err, cwd = io.StringIO(), io.StringIO(), os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(args))
            except SystemExit as exc:  # what sys.exit would have made the exit code
                rc = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(cwd)
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def test_cli_train_refuses_fp16_on_cpu_before_any_worker_starts(tmp_path):
    out = tmp_path / "out"
    r = _cli("train", "tiny-llama", "trainer.precision=fp16", f"run.output_dir={out}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "trainer.precision='fp16'" in r.stderr and "trainer.precision=bf16" in r.stderr
    assert not out.exists()  # nothing started, nothing written


def test_fp16_is_for_ddp_on_gpus_only():
    assert load("gpt2", ["trainer.precision=fp16"]).trainer.precision == "fp16"
    _refused("llama3-8b", ["trainer.precision=fp16"], must_say=["fp16", "distributed.strategy=ddp",
                                                              "trainer.precision=bf16"])
    _refused("gpt2", ["trainer.precision=fp16", "distributed.backend=gloo"],
             must_say=["distributed.backend=gloo"])


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
    assert r.returncode == 0 and all(n in r.stdout for n in recipe_names())
    r = _cli("validate")
    assert r.returncode == 0 and r.stdout.count("ok ") == len(recipe_names())


ETCD = ["distributed.num_nodes=3", "distributed.nproc_per_node=2", "checkpointless.spare_nodes=1",
        "distributed.master_port=29400", "checkpointless.coordinator=etcd"]


@pytest.mark.parametrize("extra, key", [
    ([], "checkpointless.etcd.member_hosts"),  # the embedded etcd needs its members' addresses
    (["checkpointless.etcd.member_hosts=a,b,c", "checkpointless.confirm_s=5"],
     "checkpointless.confirm_s"),  # set by hand: 5 <= 3 + 3 + 2 (unset, it is derived)
    (["checkpointless.etcd.endpoints=e:2379", "checkpointless.confirm_s=12",
      "distributed.standalone_coordinator=true"], "distributed.standalone_coordinator"),
    (["checkpointless.etcd.endpoints=e:2379", "checkpointless.confirm_s=12",
      "checkpointless.etcd.ttl_s=1"], "checkpointless.etcd.ttl_s"),
])
def test_coordinator_etcd_refuses_what_could_not_survive_a_move(extra, key):
    with pytest.raises(RecipeError) as err:
        load("tiny-llama", ETCD + extra)
    assert str(err.value).startswith(key), str(err.value)


def test_coordinator_etcd_on_too_few_nodes_for_the_embedded_members():
    with pytest.raises(RecipeError, match="checkpointless.etcd.endpoints"):
        load("tiny-llama", ["distributed.num_nodes=2", "distributed.nproc_per_node=2",
                            "distributed.master_port=29400", "checkpointless.coordinator=etcd",
                            "checkpointless.confirm_s=12"])
    cfg = load("tiny-llama", ETCD + ["checkpointless.etcd.member_hosts=a,b,c",
                                     "checkpointless.confirm_s=12"])
    assert cfg.checkpointless.coordinator == "etcd"


def test_coordinator_etcd_without_an_etcd_binary_is_said_in_one_sentence_before_launch(
        monkeypatch):
    from checkpointless.protocol import keys
    from launcher.run.preflight import _etcd_binary
    cfg = load("tiny-llama", ETCD + ["checkpointless.etcd.member_hosts=a,b,c",
                                     "checkpointless.confirm_s=12"])
    monkeypatch.delenv(keys.ENV_ETCD, raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    said = _etcd_binary(cfg)
    assert said.startswith("checkpointless.coordinator=etcd: node 0 runs a member") and \
        "Fix: install it" in said and "\n" not in said
    monkeypatch.setenv(keys.ENV_ETCD, "/usr/bin/etcd")
    assert _etcd_binary(cfg) is None
    ext = load("tiny-llama", ETCD + ["checkpointless.etcd.endpoints=e:2379",
                                     "checkpointless.confirm_s=12"])
    assert _etcd_binary(ext) is None  # the user's own cluster: nothing to run here


def test_cli_validate_takes_overrides_like_show_and_plan():
    r = _cli("validate", "tiny-llama", "trainer.max_steps=0")
    assert r.returncode == 1 and "INVALID tiny-llama: trainer.max_steps=0" in r.stdout
    assert _cli("validate", "tiny-llama", "trainer.max_steps=7").returncode == 0
    r = _cli("validate", "--help")
    assert r.returncode == 0 and "validate [RECIPE [key=value ...]]" in r.stdout
