"""Pre-flight: what a recipe needs is checked once, in the launcher, and every missing thing is said
in one message, before any worker starts."""
import os
import subprocess
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from models.hub import hub_problem
from launcher.run.preflight import preflight
from launcher.recipe.load import RecipeError, load
from tests.conftest import ROOT


def test_a_gpu_recipe_on_a_machine_without_gpus_says_everything_missing_at_once():
    with pytest.raises(RecipeError) as err:
        preflight(load("llama3-8b"))
    text = str(err.value)
    assert "distributed.device=cpu" in text  # the override that runs it anyway
    assert "model.id=meta-llama/Meta-Llama-3-8B" in text
    assert "tokenizer.id=meta-llama/Meta-Llama-3-8B" in text
    assert "data.id=HuggingFaceFW/fineweb-edu" in text and "--repo-type dataset" in text


def test_tiny_recipes_pass_and_missing_files_are_named(tmp_path):
    preflight(load("tiny-llama"))
    preflight(load("tiny-sft"))  # shipped files, found from the project root
    with pytest.raises(RecipeError, match="data.files: 'nowhere.jsonl' does not exist"):
        preflight(load("tiny-sft", ["data.files=[nowhere.jsonl]"]))


def test_a_model_in_a_local_folder_is_resolved_and_a_wrong_one_is_named(tmp_path):
    from transformers import LlamaConfig
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, vocab_size=257).save_pretrained(tmp_path / "m")
    preflight(load("tiny-llama", [f"model.id={tmp_path / 'm'}"]))
    with pytest.raises(RecipeError, match="model.id=no-such-org/no-such-model"):
        preflight(load("tiny-llama", ["model.id=no-such-org/no-such-model"]))
    # fsdp reads pretrained weights shard by shard: only safetensors files allow it
    with pytest.raises(RecipeError, match="no model.safetensors.*distributed.strategy=ddp"):
        preflight(load("tiny-llama", [f"model.id={tmp_path / 'm'}", "model.init=pretrained",
                                      "distributed.strategy=fsdp"]))


def test_each_hub_failure_gets_its_own_sentence():
    from huggingface_hub import errors
    gated = errors.GatedRepoError.__new__(errors.GatedRepoError)  # built as the hub does, minus
    missing = errors.RepositoryNotFoundError.__new__(errors.RepositoryNotFoundError)  # a response
    offline = errors.LocalEntryNotFoundError("not cached")
    wrapped = OSError("could not load")
    wrapped.__cause__ = gated  # transformers re-raises hub errors as OSError
    assert "license" in hub_problem(wrapped, "model", "model.id", "meta-llama/X")
    assert "huggingface-cli login" in hub_problem(gated, "model", "model.id", "meta-llama/X")
    assert "no such model" in hub_problem(missing, "model", "model.id", "nobody/x")
    assert "cannot be reached" in hub_problem(offline, "model", "model.id", "a/b")


def test_train_refuses_with_one_message_and_no_traceback():
    r = subprocess.run([sys.executable, "-m", "launcher", "train", "llama3-8b"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode != 0
    assert "this recipe cannot start on this machine" in r.stderr + r.stdout
    assert "Traceback" not in r.stderr and "exited" not in r.stderr  # no worker started


def test_fp16_on_a_machine_without_gpus_is_refused_when_the_device_is_left_to_auto(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load("tiny-llama", ["distributed.device=auto", "distributed.backend=auto",
                              "trainer.precision=fp16"])
    with pytest.raises(RecipeError) as err:
        preflight(cfg)
    assert "trainer.precision=fp16" in str(err.value) and "trainer.precision=bf16" in str(err.value)


def _checkpoint_of(cfg, directory, step=4):
    """A checkpoint as the workers write it (`step-%08d/` with `.metadata`; the model's keys
    under "model."), of the model `cfg` builds, written without any worker."""
    import torch
    import torch.distributed.checkpoint as dcp

    from launcher.run.preflight import meta_model_state
    import warnings
    state = {k: torch.zeros(v.shape) for k, v in meta_model_state(cfg).items()}
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": state, "step": step}, checkpoint_id=str(directory / f"step-{step:08d}"))


def test_resume_over_another_models_checkpoint_is_refused_before_launch(tmp_path):
    _checkpoint_of(load("tiny-gpt2"), tmp_path)
    resume = [f"checkpoint.dir={tmp_path}", "checkpoint.resume=auto"]
    preflight(load("tiny-gpt2", resume))  # its own checkpoint: resumed
    preflight(load("tiny-llama", [f"checkpoint.dir={tmp_path}"]))  # resume=never: not read
    with pytest.raises(RecipeError) as err:  # another architecture
        preflight(load("tiny-llama", resume))
    msg = str(err.value)
    assert f"checkpoint.resume=auto: {tmp_path / 'step-00000004'} is a checkpoint of a " \
           "different model" in msg
    assert "'model.embed_tokens.weight'" in msg and "Fix:" in msg
    assert "checkpoint.resume=never" in msg and "Traceback" not in msg
    _checkpoint_of(load("tiny-llama"), tmp_path, step=8)  # the newest is the one compared
    preflight(load("tiny-llama", resume))
    with pytest.raises(RecipeError, match=r"another shape \(first: 'model.embed_tokens.weight', "
                                          r"\[257, 128\] there, \[257, 64\] here\).*Fix:"):
        preflight(load("tiny-llama", resume + ["model.config.hidden_size=64"]))


def test_a_pretrained_folder_without_weights_is_refused_under_any_strategy(tmp_path):
    from transformers import LlamaConfig
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, vocab_size=257).save_pretrained(tmp_path / "m")
    pretrained = [f"model.id={tmp_path / 'm'}", "model.init=pretrained"]
    with pytest.raises(RecipeError) as err:
        preflight(load("tiny-llama", pretrained + ["distributed.strategy=ddp"]))
    msg = str(err.value)
    assert f"model.id={tmp_path / 'm'}: model.init=pretrained" in msg
    assert "pytorch_model.bin" in msg and "save_pretrained" in msg and "model.init=random" in msg
    # under ddp the workers load with from_pretrained, which reads a .bin too; fsdp does not
    (tmp_path / "m" / "pytorch_model.bin").write_bytes(b"")
    preflight(load("tiny-llama", pretrained + ["distributed.strategy=ddp"]))
    with pytest.raises(RecipeError, match="no model.safetensors.*distributed.strategy=ddp"):
        preflight(load("tiny-llama", pretrained + ["distributed.strategy=fsdp"]))


def test_a_hub_model_whose_weights_are_not_cached_is_refused_while_offline(tmp_path,
                                                                          monkeypatch):
    """Offline (the hub unreachable), a hub id's weights must be in the local cache: named
    before launch, not found by each worker. Shards listed by a cached index count one by one."""
    import json

    from huggingface_hub import constants

    from launcher.run.preflight import _weights_problem
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snap = tmp_path / "models--some-org--tiny" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap.parent.parent / "refs").mkdir()
    (snap.parent.parent / "refs" / "main").write_text("abc")
    (snap / "config.json").write_text("{}")
    cfg = load("tiny-llama", ["model.id=some-org/tiny", "model.init=pretrained"])
    msg = _weights_problem(cfg)
    assert msg.startswith("model.id=some-org/tiny: model.init=pretrained needs its weights, "
                          "which are not in the local Hugging Face cache")
    assert "huggingface-cli download some-org/tiny" in msg and "model.init=random" in msg
    (snap / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (snap / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert "needs 1 of its 2 weight files (model-00002-of-00002.safetensors" in \
        _weights_problem(cfg)
    (snap / "model-00002-of-00002.safetensors").write_bytes(b"")
    assert _weights_problem(cfg) is None
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # online: the workers download what is missing
    (snap / "model-00002-of-00002.safetensors").unlink()
    assert _weights_problem(cfg) is None


def test_a_package_the_recipe_asks_for_is_named_with_its_install_command(monkeypatch):
    from launcher.run import preflight as P
    monkeypatch.setattr(P, "installed", lambda module: module not in ("wandb", "mlflow"))
    problems = P.missing_packages(load("tiny-llama",
                                       ["logging.trackers=[tensorboard,wandb,mlflow]"]))
    assert problems == [
        "logging.trackers[1]=wandb: the wandb package is not installed here. Fix: pip install "
        "wandb (or drop wandb from logging.trackers)",
        "logging.trackers[2]=mlflow: the mlflow package is not installed here. Fix: pip install "
        "mlflow-skinny (or drop mlflow from logging.trackers)"]
    with pytest.raises(RecipeError, match=r"logging.trackers\[0\]=wandb: the wandb package"):
        preflight(load("tiny-llama", ["logging.trackers=[wandb]"]))


def test_a_missing_model_folder_and_one_without_config_get_their_own_sentence(tmp_path,
                                                                              monkeypatch):
    monkeypatch.chdir(tmp_path)
    for ident in (str(tmp_path / "nonexistent"), "./nonexistent_dir", "../nonexistent_dir"):
        with pytest.raises(RecipeError) as err:
            preflight(load("tiny-llama", [f"model.id={ident}"]))
        msg = str(err.value)
        assert f"model.id={ident}: no such folder" in msg and "Repo id" not in msg
        assert msg.count("model.id=") == 1  # said once, not again for the tokenizer
    (tmp_path / "empty").mkdir()
    for ident in (str(tmp_path / "empty"), "empty"):  # an existing relative folder is a folder
        with pytest.raises(RecipeError) as err:
            preflight(load("tiny-llama", [f"model.id={ident}"]))
        msg = str(err.value)
        assert f"model.id={ident}: the folder has no config.json (a Hugging Face model folder " \
               "written by save_pretrained has one)" in msg
        assert "model_type" not in msg and msg.count("model.id=") == 1


def test_replication_above_the_process_count_names_the_fix():
    with pytest.raises(RecipeError) as err:
        load("tiny-llama", ["distributed.num_processes=1"])
    msg = str(err.value)
    assert "checkpointless.replication.factor=2: cannot exceed distributed.num_processes=1" in msg
    assert "set checkpointless.replication.factor=1 (no peer copies) or use more processes" in msg


def test_a_checkpoint_that_is_not_the_recipes_model_is_refused_before_launch(tmp_path):
    """Read shard by shard, a weight the checkpoint lacks would otherwise be found by every rank
    at its first step; one of another shape too."""
    from transformers import AutoModelForCausalLM

    from launcher.plan.model import hf_config
    AutoModelForCausalLM.from_config(hf_config(load("tiny-llama"))[0]).save_pretrained(
        tmp_path / "m")  # tiny-llama's own model
    pretrained = [f"model.id={tmp_path / 'm'}", "model.init=pretrained",
                  "distributed.strategy=fsdp"]
    preflight(load("tiny-llama", pretrained))  # the checkpoint's own shape: accepted
    with pytest.raises(RecipeError) as err:
        preflight(load("tiny-llama", pretrained + ["model.config.num_hidden_layers=5"]))
    msg = str(err.value)
    assert f"model.id={tmp_path / 'm'}: the checkpoint does not hold the model" in msg
    assert "model.layers.4.self_attn.q_proj.weight is missing" in msg and "more" in msg
    assert "Fix:" in msg
    with pytest.raises(RecipeError, match=r"model.layers.0.mlp.gate_proj.weight is \[352, 128\] "
                                          r"there, \[48, 128\] here"):
        preflight(load("tiny-llama", pretrained + ["model.config.intermediate_size=48"]))
