"""The memory plan (launcher/plan/): parameter counts of the built-in configs, LoRA counts
against peft, what each large recipe needs per rank against the hardware its header names, the
refusal of a recipe that does not fit, and the CLI. Meta device only: no weights, offline."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import re
import subprocess
import sys
from functools import lru_cache

import pytest
import torch

from launcher import plan as P
from launcher.recipe.load import RECIPES_DIR, RecipeError, load
from models.known_configs import known_config
from tests.conftest import ROOT

LARGE = ["llama3-8b", "llama3-70b", "llama3.2-1b", "llama3.2-1b-sft", "gpt2", "gpt2-xl",
         "gpt-oss-20b", "llama3-8b-lora", "gpt2-sft", "llama3-8b-hsdp", "llama3.2-1b-hsdp"]


def header_gb(name: str) -> float:
    """The device memory a recipe's `Sized for:` line names (80 when it names none)."""
    for line in (RECIPES_DIR / f"{name}.yaml").read_text().splitlines():
        if "Sized for" in line:
            m = re.search(r"(\d+)\+? GB", line)
            return float(m.group(1)) if m else P.DEFAULT_DEVICE_GB
    return P.DEFAULT_DEVICE_GB


@lru_cache(maxsize=None)
def facts(name: str):
    return P.model_facts(load(name))


def plan_on_its_hardware(name, *overrides):
    cfg = load(name, [f"distributed.device_memory_gb={header_gb(name)}", *overrides])
    return P.plan(cfg, facts(name))


# ---- parameter counts ------------------------------------------------------------------------

KNOWN_COUNTS = {  # published sizes
    "meta-llama/Meta-Llama-3-8B": 8.03e9, "meta-llama/Meta-Llama-3-70B": 70.6e9,
    "meta-llama/Llama-3.2-1B": 1.24e9, "openai-community/gpt2": 124e6,
    "openai-community/gpt2-xl": 1.56e9, "openai/gpt-oss-20b": 20.9e9,
}


@pytest.mark.parametrize("model_id", sorted(KNOWN_COUNTS))
def test_the_built_in_configs_have_the_published_parameter_counts(model_id):
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(known_config(model_id))
    n = sum(p.numel() for p in model.parameters())
    assert n == pytest.approx(KNOWN_COUNTS[model_id], rel=0.01), f"{n:,}"


def test_parameter_dtype_follows_the_config_as_transformers_builds_the_model(tmp_path):
    """The Llama 3 and gpt-oss configs say bfloat16: transformers builds those models in bf16
    (from_config, and from_pretrained's default dtype="auto"), which is what a frozen LoRA base
    under ddp keeps (trained parameters are fp32 masters); GPT-2's configs name no dtype: fp32."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    small = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, vocab_size=64, dtype="bfloat16")
    AutoModelForCausalLM.from_config(small).save_pretrained(tmp_path)
    assert next(AutoModelForCausalLM.from_pretrained(tmp_path).parameters()).dtype == \
        torch.bfloat16  # what models.build_model(init=pretrained) gets: no dtype passed
    assert facts("llama3-8b").param_bytes == facts("gpt-oss-20b").param_bytes == 2
    assert facts("gpt2").param_bytes == facts("gpt2-xl").param_bytes == 4


# ---- LoRA ------------------------------------------------------------------------------------

def test_lora_adapters_of_llama3_8b_on_the_seven_projections():
    cfg = load("llama3-8b-lora")
    n = P.lora_params(facts("llama3-8b-lora"), cfg.peft.r, cfg.peft.target_modules)
    assert n == 41_943_040  # r=16 x (in + out), 7 projections x 32 layers
    assert P.plan(cfg, facts("llama3-8b-lora")).trainable == n


@pytest.mark.parametrize("recipe,targets", [
    ("tiny-llama", ["all-linear"]), ("tiny-llama", ["q_proj", "v_proj", "down_proj"]),
    ("tiny-gpt2", ["all-linear"]), ("tiny-gpt2", ["c_attn"])])
def test_the_lora_formula_counts_what_peft_trains(recipe, targets):
    from transformers import AutoModelForCausalLM

    from models.lora import apply_lora
    f = facts(recipe)
    hf, _ = P.hf_config(load(recipe))
    with torch.device("meta"):
        model = apply_lora(AutoModelForCausalLM.from_config(hf), 4, 8.0, 0.0, targets)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert P.lora_params(f, 4, targets) == trained


# ---- activations -----------------------------------------------------------------------------

def test_the_activation_estimate_of_a_layer_is_close_to_what_autograd_keeps():
    """What a Llama layer saves for backward (bf16 parameters, bf16 autocast, sdpa), measured
    with saved-tensor hooks on CPU, against the per-token formula: within 15%."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                      dtype="bfloat16")
    layer = AutoModelForCausalLM.from_config(cfg).model.layers[0].train()
    b, s = 2, 64
    x = torch.randn(b, s, 128, dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(s)[None].expand(b, -1)
    rope = AutoModelForCausalLM.from_config(cfg).model.rotary_emb(x, pos)
    weights = {p.data_ptr() for p in layer.parameters()}
    kept = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in weights:
            kept[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x, attention_mask=None, position_embeddings=rope, position_ids=pos)
    f = P.ModelFacts(name="t", config_source="", n_params=0, param_bytes=2, dtype_name="bf16",
                     n_layers=1, block_params=0, root_params=0, lm_head_params=0, head_matmul=0,
                     matmul_params=0, hidden=128, heads=4, q_dim=128, kv_dim=64,
                     intermediate=352, vocab=64, mlp="swiglu", experts_per_token=1,
                     dropout=0.0, attn_dropout=0.0, attn_impl="sdpa", fused_qkv=False)
    estimate = P.layer_bytes_per_token(f, 2, 2, False, 0, 0, 0.0) * b * s
    assert estimate == pytest.approx(sum(kept.values()), rel=0.15)


# ---- the large recipes on their hardware -----------------------------------------------------

@pytest.mark.parametrize("name", LARGE)
def test_every_large_recipe_fits_the_hardware_its_header_names(name):
    result = plan_on_its_hardware(name)
    assert result.fits, result.report()


def test_autocast_copies_weights_under_ddp_and_not_under_fsdps_bf16_policy():
    """ddp autocasts fp32 masters (a bf16 copy of each weight); FSDP2's bf16 policy hands
    autocast weights that are bf16 already."""
    sharded = {i.name for i in plan_on_its_hardware("llama3-70b").items}
    assert "bf16 weight copies" not in sharded and "two blocks unsharded" in sharded
    whole = {i.name for i in plan_on_its_hardware("llama3.2-1b", "distributed.strategy=ddp",
                                                  "distributed.device_memory_gb=80").items}
    assert {"bf16 weight copies", "gradient all-reduce copy"} <= whole


# ---- refusal and the override that fits -------------------------------------------------------

def test_check_fits_refuses_llama3_70b_under_ddp_and_names_what_fits():
    cfg = load("llama3-70b", ["distributed.strategy=ddp"])
    with pytest.raises(RecipeError) as err:  # whole-model state on every GPU: fsdp is the fix
        P.check_fits(cfg)
    assert "fits with: distributed.strategy=fsdp" in str(err.value)
    assert "Add: distributed.strategy=fsdp" in str(err.value)


def test_when_no_override_fits_the_refusal_names_the_closest():
    # 70B of fp32 state over two GPUs: 565 GB each whatever the batch
    cfg = load("llama3-70b", ["distributed.num_processes=2", "checkpointless.spares=0"])
    with pytest.raises(RecipeError) as err:
        P.check_fits(cfg)
    text = str(err.value)
    assert "does not fit" in text and "no override tried fits" in text
    assert "the closest, " in text and "Add: " not in text


def test_the_override_named_is_computed_and_fits():
    with pytest.raises(RecipeError) as err:
        # the recipe as it was before it was sized by the plan
        P.check_fits(load("llama3.2-1b", OLD_1B := ["distributed.strategy=ddp",
                                                    "model.gradient_checkpointing=false",
                                                    "trainer.micro_batch_size=4"]))
    fix = re.search(r"Add: (.*)", str(err.value)).group(1).split()
    assert fix[0] == "distributed.strategy=fsdp"
    assert P.plan(load("llama3.2-1b", [*OLD_1B, *fix]), facts("llama3.2-1b")).fits


def test_a_tiny_cpu_recipe_is_planned_against_host_memory_per_process():
    result = P.check_fits(load("tiny-llama"))
    assert result.device_type == "cpu" and "processes" in result.budget_source
    assert result.budget <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 5


def test_a_negative_device_memory_is_refused():
    with pytest.raises(RecipeError, match="device_memory_gb"):
        P.plan(load("llama3-8b", ["distributed.device_memory_gb=-1"]), facts("llama3-8b"))


# ---- the command line -------------------------------------------------------------------------

def test_cli_plan_prints_the_table_and_the_verdict(capsys):
    from launcher.cli import main
    assert main(["plan", "llama3-8b"]) == 0
    out = capsys.readouterr().out
    assert "device/rank" in out and "optimizer state" in out and "\nfits: " in out
    r = subprocess.run([sys.executable, "-m", "launcher", "plan", "llama3-70b"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT,
                       env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert "config: built-in table (offline)" in r.stdout, r.stderr
    assert "peer replicas" in r.stdout and "host/rank" in r.stdout
    # with launcher/train/loop.py as it is the 70B recipe fits its 64 GPUs
    assert r.returncode == 0 and "\nfits: " in r.stdout


def test_a_nodes_host_memory_is_checked_against_its_ranks_replicas_and_snapshots():
    """gpt-oss-20b: 8 ranks per node hold three versions of their own 42 GB slice of fp32 state
    and of a peer's: 1.6 TB of host memory per node beside the processes."""
    over = ["distributed.host_memory_gb=1024"]
    with pytest.raises(RecipeError) as err:
        P.check_fits(load("gpt-oss-20b", over))
    text = str(err.value)
    assert "host memory of a node does not fit" in text and "8 ranks" in text
    assert "1,024.00 GB (distributed.host_memory_gb)" in text
    assert "checkpointless.replication.factor=1" in text
    fixed = P.check_fits(load("gpt-oss-20b", [*over, "checkpointless.replication.factor=1"]))
    assert fixed.host_fits and fixed.host_per_node < 1024 * P.GB
    big = P.check_fits(load("gpt-oss-20b", ["distributed.host_memory_gb=2048"]))
    assert big.host_fits and "8 ranks per node" in big.report()
    if not torch.cuda.is_available():  # no key and no GPU here: a node's memory is not known
        assert "not compared" in P.plan(load("gpt-oss-20b"), search=False).report()
    with pytest.raises(RecipeError, match="distributed.host_memory_gb=-1.0: must be >= 0"):
        P.plan(load("gpt-oss-20b", ["distributed.host_memory_gb=-1"]), search=False)
