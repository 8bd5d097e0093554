"""Where a node's place in a multi-node job comes from: overrides, then the environment (Slurm,
torchrun-style variables, an accelerate config file), then the recipe.

`from_environment(overrides)` returns extra overrides for the keys the user did not set on the
command line, and a line per value saying where it came from, for the launcher to print. The
recipe is the fallback: a key found nowhere keeps its recipe value.
"""
from __future__ import annotations

import os
import re

from launcher.recipe.load import RecipeError

KEYS = ("distributed.num_nodes", "distributed.node_rank", "distributed.master_addr",
        "distributed.master_port", "distributed.num_processes", "distributed.strategy",
        "trainer.precision", "model.gradient_checkpointing")


class UnsupportedConfig(RecipeError):
    """An accelerate config file asks for something this launcher cannot honour."""


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list ("gpu[001-004,007],login1") as host names, in order."""
    hosts = []
    parts = re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", text)
    for part in parts:
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            if not hi:
                hosts.append(f"{prefix}{lo}{suffix}")
                continue
            width = len(lo)
            for n in range(int(lo), int(hi) + 1):
                hosts.append(f"{prefix}{n:0{width}d}{suffix}")
    return hosts


def _accelerate_file(path: str) -> dict:
    """Recipe keys from an accelerate config file, read with accelerate's own loader: the
    machine keys, num_processes, mixed_precision, and FSDP (with its activation checkpointing).
    What cannot be honoured is refused, naming the file's key and the reason."""
    from accelerate.commands.config.config_args import load_config_from_file
    cfg = load_config_from_file(path)
    out = {}
    kind = str(getattr(cfg, "distributed_type", "NO")).split(".")[-1]
    if kind in ("DEEPSPEED", "MEGATRON_LM", "XLA") or getattr(cfg, "deepspeed_config", None) \
            or getattr(cfg, "megatron_lm_config", None):
        raise UnsupportedConfig(
            f"{path}: distributed_type={kind}: this launcher runs ddp or fsdp (FSDP2) with its own "
            "recovery; remove the DeepSpeed/Megatron settings, or use distributed_type: FSDP")
    if kind == "FSDP":
        out["distributed.strategy"] = "fsdp"
        fsdp = getattr(cfg, "fsdp_config", None) or {}
        strategy = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD"))
        if strategy not in ("FULL_SHARD", "1"):
            raise UnsupportedConfig(
                f"{path}: fsdp_config.fsdp_sharding_strategy={strategy}: only FULL_SHARD (FSDP2's "
                "fully_shard) is supported here")
        if fsdp.get("fsdp_activation_checkpointing"):
            out["model.gradient_checkpointing"] = True
    elif kind in ("MULTI_GPU", "MULTI_CPU", "NO"):
        out["distributed.strategy"] = "ddp"
    precision = str(getattr(cfg, "mixed_precision", "no") or "no")
    if precision == "fp8":
        raise UnsupportedConfig(
            f"{path}: mixed_precision={precision}: this launcher trains in bf16, fp16 (GPU) or "
            "fp32 (trainer.precision); set mixed_precision: bf16, fp16 or no")
    # fp16 on CPU is refused by the recipe's validation, naming trainer.precision
    out["trainer.precision"] = {"bf16": "bf16", "fp16": "fp16"}.get(precision, "fp32")
    if getattr(cfg, "num_machines", None):
        out["distributed.num_nodes"] = int(cfg.num_machines)
    if getattr(cfg, "machine_rank", None) is not None:
        out["distributed.node_rank"] = int(cfg.machine_rank)
    if getattr(cfg, "main_process_ip", None):
        out["distributed.master_addr"] = str(cfg.main_process_ip)
    if getattr(cfg, "main_process_port", None):
        out["distributed.master_port"] = int(cfg.main_process_port)
    if getattr(cfg, "num_processes", None):
        out["distributed.num_processes"] = int(cfg.num_processes)
    return out


def from_environment(overrides: list[str], env=None) -> tuple[list[str], list[str]]:
    """(extra overrides, lines saying where each node value came from)."""
    env = os.environ if env is None else env
    given = {o.split("=", 1)[0].strip() for o in overrides if "=" in o}
    found: dict[str, tuple[object, str]] = {}

    def put(key, value, source):
        if key not in found and value not in (None, ""):
            found[key] = (value, source)

    accel = next((o.split("=", 1)[1] for o in overrides
                  if o.startswith("distributed.accelerate_config=")), None)
    if accel:
        for key, value in _accelerate_file(accel).items():
            put(key, value, f"accelerate config {accel}")
    if "SLURM_NNODES" in env and "SLURM_NODEID" in env:
        spare = next((int(o.split("=", 1)[1]) for o in overrides
                      if o.startswith("checkpointless.spare_nodes=")), 0)
        put("distributed.num_nodes", int(env["SLURM_NNODES"]) - spare,
            "Slurm (SLURM_NNODES" + (f" - {spare} spare node(s))" if spare else ")"))
        put("distributed.node_rank", int(env["SLURM_NODEID"]), "Slurm (SLURM_NODEID)")
        if env.get("SLURM_JOB_NODELIST"):
            put("distributed.master_addr", expand_nodelist(env["SLURM_JOB_NODELIST"])[0],
                "Slurm (first host of SLURM_JOB_NODELIST)")
    put("distributed.master_addr", env.get("MASTER_ADDR"), "environment (MASTER_ADDR)")
    if env.get("MASTER_PORT"):
        put("distributed.master_port", int(env["MASTER_PORT"]), "environment (MASTER_PORT)")
    if env.get("NNODES"):
        put("distributed.num_nodes", int(env["NNODES"]), "environment (NNODES)")
    if env.get("NODE_RANK"):
        put("distributed.node_rank", int(env["NODE_RANK"]), "environment (NODE_RANK)")
    extra, said = [], []
    for key in KEYS:
        if key in given:
            said.append(f"{key}: from the command line")
        elif key in found:
            value, source = found[key]
            extra.append(f"{key}={value}")
            said.append(f"{key}={value}: from {source}")
    return extra, said
