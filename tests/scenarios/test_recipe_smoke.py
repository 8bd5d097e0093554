"""Every shipped recipe starts for real in its own shape (`python -m launcher smoke`,
launcher/run/smoke.py): its strategy and mesh, pretrained weights from a tiny checkpoint saved
here of its architecture, its data format, chat template, LoRA and evaluation, 3 steps on CPU,
and where it has spares a kill of rank 1 in its second step (its start, backward, optimizer or
a seeded moment, chosen by the recipe's name) ending with the failure-free bits;
the export reloads to the final state, the replay check passes, the plan's parameter bytes per
rank agree with the workers'. A recipe file added to recipes/ is covered with nothing else.

Then the numbers: from the same saved weights and the same 8 rows, the first loss under
pp x tp x fsdp equals fsdp's (fp32 compute; bf16 rounds each shape's sums differently); the
hsdp recipes' bf16 first loss is fsdp's exactly."""
import json
import os
import subprocess
import sys

import pytest

from launcher.recipe.load import load, recipe_names

pytestmark = pytest.mark.slow

# fsdp against pp x tp x fsdp (fsdp x tp and hsdp x tp: test_pretrained_meshes.py, in-process)
SAME_ROWS = ["llama3-8b", "llama3.1-405b"]


def _smoke(out, *args) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "launcher", "smoke", *args,
                        f"run.output_dir={out}"], capture_output=True, text=True, timeout=900,
                       env=env)
    summary = out / "smoke.json"
    assert summary.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    return {"results": json.loads(summary.read_text()), "stdout": r.stdout, "rc": r.returncode}


@pytest.fixture(scope="module")
def every_recipe(tmp_path_factory):
    return _smoke(tmp_path_factory.mktemp("smoke"))


@pytest.mark.parametrize("recipe", recipe_names())
def test_the_recipe_runs_in_its_own_shape_and_a_kill_ends_with_the_failure_free_bits(
        every_recipe, recipe):
    got = every_recipe["results"][recipe]
    assert got["problems"] == [], got
    cfg = load(recipe)
    assert got["killed"] is (cfg.checkpointless.spares > 0)
    assert got["replayable"] is True
    d = cfg.distributed
    shape = got["shape"]
    assert shape.startswith(d.strategy)
    assert ("tp 2" in shape) is (d.tp_size > 1) and ("pp 2" in shape) is (d.pp_size > 1)
    assert ("lora" in shape) is (cfg.peft.method == "lora")
    assert ("eval" in shape) is (cfg.eval.every > 0)
    assert f"init {cfg.model.init}" in shape and cfg.data.format in shape
    assert got["planned_param_bytes"] > 0 and got["measured_param_bytes"] > 0


def test_the_command_fails_when_any_recipe_fails(every_recipe):
    assert every_recipe["rc"] == 0 and "FAIL" not in every_recipe["stdout"]


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    return _smoke(tmp_path_factory.mktemp("fp32"), *SAME_ROWS, "trainer.precision=fp32",
                  "checkpointless.spares=0")["results"]


def test_hsdp_starts_from_the_same_first_loss_as_fsdp(every_recipe):
    results = every_recipe["results"]
    assert results["llama3-8b-hsdp"]["first_loss"] == results["llama3-8b"]["first_loss"]


def test_the_first_loss_is_fsdps_under_every_mesh_of_the_same_rows(fp32):
    assert all(fp32[r]["problems"] == [] for r in SAME_ROWS), fp32
    fsdp = fp32["llama3-8b"]["first_loss"]
    for recipe in SAME_ROWS[1:]:
        assert fp32[recipe]["first_loss"] == pytest.approx(fsdp, abs=1e-5), (recipe, fp32)
