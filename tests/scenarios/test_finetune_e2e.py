"""Fine-tuning end to end through the real CLI: chat data the repo ships, LoRA through peft,
validation, a worker killed; tiny models, real processes, gloo, offline."""
import json

import pytest
import torch

from tests.conftest import assert_same_bits, train

pytestmark = pytest.mark.slow  # real training processes; `make test-fast` skips them


def evals(out):
    lines = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return [l for l in lines if "eval_loss" in l]


def test_tiny_lora_survives_a_kill_in_validation_moving_only_the_adapters(tmp_path, references):
    # 20 steps (about 1 s each on 2 cores, in each of the two runs), validation every 10
    args = ("trainer.max_steps=20", "eval.every=10", "eval.max_batches=4")
    clean_out, clean, _ = references.train("tiny-lora", *args)
    # the kill lands at the start of step 10, whose body begins with a validation pass: the
    # survivors' first collective after it is the validation's
    out, rep, r = train(tmp_path, "kill", "tiny-lora", *args, "faults=[kill:1:10]")
    assert_same_bits(rep, clean)
    (rec,) = rep["recoveries"]
    assert rec["resumed_step"] == 10
    full_finetune_bytes = rep["full_params"] * 4 * 3  # fp32 parameters and two Adam moments
    assert rec["state_bytes"] < full_finetune_bytes / 10, (rec["state_bytes"], full_finetune_bytes)
    # validation: after 10 steps (once: the redone step does not log it twice) and at the end
    ev = evals(out)
    assert [e["eval_after_steps"] for e in ev] == [10, 20]
    assert ev[-1]["eval_loss"] < ev[0]["eval_loss"]
    assert [e["eval_loss"] for e in ev] == [e["eval_loss"] for e in evals(clean_out)]
    assert rep["eval"]["eval_loss"] == ev[-1]["eval_loss"]
    assert "validation after" in r.stdout or "eval_loss" in r.stdout

    # the base kept its exact bits: the exported base equals a fresh build of it
    from omegaconf import OmegaConf
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launcher.train.model_setup import build
    from launcher.recipe.schema import Recipe
    cfg = OmegaConf.merge(OmegaConf.structured(Recipe), OmegaConf.load(out / "recipe.yaml"))
    _, fresh, _ = build(cfg, torch.device("cpu"))
    fresh_base = fresh.unload().state_dict()
    base = AutoModelForCausalLM.from_pretrained(out / "base")
    assert fresh_base.keys() == base.state_dict().keys()
    assert all(torch.equal(v, fresh_base[k]) for k, v in base.state_dict().items())

    # the adapter reloads with peft on that base, holds the trained adapters, and generates
    model = PeftModel.from_pretrained(base, out / "adapter")
    tok = AutoTokenizer.from_pretrained(out / "adapter")
    trained = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert trained and not all(torch.count_nonzero(v) == 0 for k, v in trained.items()
                               if "lora_B" in k)
    ids = tok.apply_chat_template([{"role": "user", "content": "what is 2 plus 3?"}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    gen = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False)
    assert gen.shape[1] > ids.shape[1]


@pytest.mark.extended  # in make test-scale, not make test (its time budget)
def test_lora_under_fsdp_with_padded_examples_recovers_and_exports_merged(tmp_path, references):
    args = ("distributed.num_processes=2", "distributed.strategy=fsdp", "trainer.max_steps=16",
            "data.packing=false", "eval.every=8", "eval.max_batches=2", "peft.merge=true")
    _, clean, _ = references.train("tiny-lora", *args)
    out, rep, _ = train(tmp_path, "kill", "tiny-lora", *args, "checkpointless.spares=1",
                        "faults=[kill:1:5]")
    assert_same_bits(rep, clean)
    (rec,) = rep["recoveries"]  # sharded: resumes from the peers' newest copy of the slice
    assert rec["resumed_step"] in (4, 5)
    assert rep["eval"]["eval_loss"] == clean["eval"]["eval_loss"]
    from transformers import AutoModelForCausalLM
    merged = AutoModelForCausalLM.from_pretrained(out / "model")  # adapters folded into the base
    assert not any("lora" in k for k in merged.state_dict())
    assert (out / "adapter" / "adapter_config.json").exists() and (out / "base").exists()


def test_tiny_sft_full_fine_tune_validates_and_exports_the_model(tmp_path):
    out, rep, r = train(tmp_path, "sft", "tiny-sft", "distributed.num_processes=2",
                        "checkpointless.spares=0", "trainer.max_steps=30", "eval.every=15",
                        "eval.max_batches=4")
    ev = evals(out)
    assert [e["eval_after_steps"] for e in ev] == [15, 30]
    assert ev[1]["eval_loss"] < ev[0]["eval_loss"] < 5.6  # from uniform over 257 tokens, down
    assert rep["eval"] == ev[1] and len(set(rep["params_sha256_by_rank"].values())) == 1
    assert "validation after 15 steps" in r.stdout
    assert (out / "model" / "model.safetensors.index.json").exists()
    assert not (out / "adapter").exists()
