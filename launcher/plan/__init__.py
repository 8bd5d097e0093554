"""`python -m launcher plan RECIPE [key=value ...]`: the memory one rank needs, before launch.

    python -m launcher plan llama3-8b
    python -m launcher plan llama3-70b distributed.strategy=ddp
    python -m launcher plan llama3.2-1b distributed.device_memory_gb=24

The model is built on the meta device (no weights, no data) and everything else is computed from
the recipe; `check_fits(cfg)` is the same plan for the launcher, raising RecipeError with the
numbers and the overrides that fit. What is counted, and why: docs/memory-plan.md.

    model.py   the model's shapes and parameter counts
    items.py   the rows: what a rank holds in each phase of a step
    budget.py  the device's and the node's memory
    report.py  the Plan and the table, report and verdict it prints
    fit.py     plan(), the fix search, check_fits, the command line
    stages.py  a pipelined recipe's plan: each worker stage's, the heaviest the rank's
"""
from launcher.plan.budget import DEFAULT_DEVICE_GB
from launcher.plan.fit import candidates, check_fits, find_fix, main, plan
from launcher.plan.items import CURRENT_LOOP, LoopFacts, layer_bytes_per_token
from launcher.plan.model import ModelFacts, hf_config, lora_params, lora_targets, model_facts
from launcher.plan.report import GB, PHASES, Item, Plan

__all__ = ["plan", "check_fits", "main", "find_fix", "candidates", "model_facts", "hf_config",
           "lora_params", "lora_targets", "layer_bytes_per_token", "ModelFacts", "LoopFacts",
           "CURRENT_LOOP", "Item", "Plan", "PHASES", "GB", "DEFAULT_DEVICE_GB"]
