"""What one rank may use: the device's memory (or, on cpu, this machine's per process), and one
node's host memory for the replicas and snapshots its ranks keep."""
from __future__ import annotations

import math
import os

from launcher.recipe.load import RecipeError
from launcher.plan.report import GB, fmt_gb

DEFAULT_DEVICE_GB = 80.0


def detect_device(cfg) -> str:
    """cuda or cpu: distributed.device, or for auto whether this machine has a GPU."""
    d = cfg.distributed.get("device", "auto")
    if d in ("cpu", "cuda"):
        return d
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _physical_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_budget(cfg, device: str) -> tuple[int, str]:
    """(bytes, where that figure came from): distributed.device_memory_gb, else on cpu this
    machine's memory shared by its workers and spares, else the smallest visible GPU, else 80 GB."""
    d = cfg.distributed
    given = float(d.get("device_memory_gb", 0.0) or 0.0)
    if given < 0:
        raise RecipeError(f"distributed.device_memory_gb={given}: must be >= 0 (0: the real "
                          "device's memory, else 80)")
    if given > 0:
        return int(given * GB), "distributed.device_memory_gb"
    if device == "cpu":
        total = _physical_memory()
        procs = ranks_per_node(cfg) + (cfg.checkpointless.spares if cfg.checkpointless.enabled else 0)
        return total // procs, (f"this machine's {fmt_gb(total)} of memory / {procs} processes "
                                "(workers and spares)")
    import torch
    if torch.cuda.is_available() and torch.cuda.device_count():
        props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
        small = min(props, key=lambda pr: pr.total_memory)
        return int(small.total_memory), f"this machine's {small.name}"
    return int(DEFAULT_DEVICE_GB * GB), (f"default {DEFAULT_DEVICE_GB:.0f} GB: no GPU here; set "
                                         "distributed.device_memory_gb for other devices")


def host_budget(cfg, device: str) -> tuple[int | None, str]:
    """One node's host memory: distributed.host_memory_gb, or this machine's when it has GPUs
    (the launcher runs on the node its workers use); otherwise unknown."""
    given = float(cfg.distributed.get("host_memory_gb", 0.0) or 0.0)
    if given < 0:
        raise RecipeError(f"distributed.host_memory_gb={given}: must be >= 0 (0: this machine's "
                          "when it has GPUs, else not compared)")
    if given > 0:
        return int(given * GB), "distributed.host_memory_gb"
    import torch
    if device == "cuda" and torch.cuda.is_available():
        return _physical_memory(), "this machine's memory"
    return None, ""


def ranks_per_node(cfg) -> int:
    """The workers one node runs (spares not counted)."""
    d = cfg.distributed
    nodes = max(1, int(d.get("num_nodes", 1) or 1))
    return int(d.get("nproc_per_node", 0) or 0) or math.ceil(d.num_processes / nodes)
