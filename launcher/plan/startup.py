"""How long a worker needs to start here, against checkpointless.startup_timeout_s.

A first-generation worker still silent startup_timeout_s after its launch is taken for hung and
replaced by a spare (checkpointless/control/losses.py). Set below what the start-up of the
recipe's model needs, every healthy worker would be "hung" before its first step: replaced, the
replacements too, until the crash-loop rule stops the run minutes later with a misleading cause.
So a value below the estimate is refused before any worker starts (the pre-flight,
`launcher validate`), and `launcher plan` prints the estimate.

The estimate leans slow, since the two errors cost differently: one refused too eagerly costs
the user a larger timeout (a hung start-up is found later); one accepted too short costs the run.
  imports   a fresh interpreter importing torch, transformers, accelerate and datasets on a busy
            node: 15 s; with GPUs 30 s (CUDA's context and the first NCCL communicator besides)
  reading   model.init=pretrained: the checkpoint bytes the node reads, at 400 MB/s (a SATA
            disk, a shared filesystem under load; a local NVMe reads several times faster).
            Under ddp the whole checkpoint once (the node's workers share the page cache);
            under fsdp and hsdp the slices its ranks hold
  building  each worker's parameters drawn or converted to their master dtype (fp32; its shard
            under fsdp and hsdp): on CPU the node's processes share its cores, 200 MB/s for the
            node; on GPUs each worker fills its own device, 2 GB/s
Downloading the weights is not counted: a first run on a machine without them in its Hugging
Face cache downloads them inside the workers' start-up (`huggingface-cli download ID` ahead).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from launcher.recipe.schema import SHARDED

IMPORT_S = {"cpu": 15.0, "cuda": 30.0}
READ_BYTES_PER_S = 400e6
BUILD_BYTES_PER_S = {"cpu": 200e6, "cuda": 2e9}
MASTER_BYTES = 4  # fp32 masters (launcher/model_setup.master_dtype)


@dataclass
class Estimate:
    """Seconds a worker needs from its launch to its first heartbeat, and what they are for."""
    parts: list  # (what, seconds)

    @property
    def seconds(self) -> float:
        return sum(s for _, s in self.parts)

    def says(self) -> str:
        return ", ".join(f"{what} {s:.0f} s" for what, s in self.parts)

    def enough(self) -> int:
        """A timeout to suggest: half again the estimate, in whole tens of seconds."""
        return int(math.ceil(self.seconds * 1.5 / 10) * 10)


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def estimate(cfg, facts, device: str) -> Estimate:
    """The start-up of one of the recipe's workers on a `device` (cpu or cuda) node, from the
    model's parameter count (launcher/plan/model.py's facts, built on the meta device)."""
    from launcher.plan.budget import ranks_per_node
    d, c = cfg.distributed, cfg.checkpointless
    per_node = ranks_per_node(cfg)
    sharded = d.strategy in SHARDED
    # how many slices the model is cut into: every rank of a replica group holds one (tp ranks
    # included, as the shard_size counts them)
    slices = (d.shard_size if d.strategy == "hsdp" and d.shard_size else d.num_processes) \
        if sharded else 1
    parts = [("imports", IMPORT_S[device])]
    if cfg.model.init == "pretrained":
        node_bytes = facts.n_params * facts.param_bytes * min(per_node, slices) / slices
        parts.append((f"reading {_gb(node_bytes)} of the checkpoint at "
                      f"{READ_BYTES_PER_S / 1e6:.0f} MB/s", node_bytes / READ_BYTES_PER_S))
    lora_base = cfg.peft.method != "none" and not sharded  # a frozen base keeps its dtype
    worker_bytes = facts.n_params * (facts.param_bytes if lora_base else MASTER_BYTES) / slices
    building = 1
    if device == "cpu":  # the spares build their model at the same time, whole under ddp
        building = per_node + (0 if sharded or not c.enabled else c.spares)
    rate = BUILD_BYTES_PER_S[device]
    parts.append((f"building {_gb(worker_bytes)} of parameters"
                  + (f" x {building} processes" if building > 1 else "")
                  + f" at {rate / 1e6:.0f} MB/s", worker_bytes * building / rate))
    return Estimate(parts)


def model_estimate(cfg) -> Estimate | None:
    """The estimate for this recipe on this machine; None when its model cannot be measured
    here (an unknown hub id offline: the pre-flight's model check says why; a model.config its
    class rejects: the workers say it in their own words, as they did before this check)."""
    from launcher.plan.model import model_facts
    from launcher.plan.budget import detect_device
    try:
        facts = model_facts(cfg)
    except Exception:  # noqa: BLE001  not this check's to report
        return None
    return estimate(cfg, facts, detect_device(cfg))


def startup_problem(cfg, est: Estimate | None = None) -> str | None:
    """One sentence when checkpointless.startup_timeout_s is below the estimate, naming the key,
    its value, the estimate and the fix; None when it is enough (or cannot be judged)."""
    est = est or model_estimate(cfg)
    value = cfg.checkpointless.startup_timeout_s
    if est is None or value >= est.seconds:
        return None
    from checkpointless.protocol import DEFAULTS
    default = DEFAULTS.startup_timeout_s
    fix = f"checkpointless.startup_timeout_s={est.enough()}" + \
        (f" (or drop it: the default is {default:g} s)" if default >= est.enough() else "")
    return (f"checkpointless.startup_timeout_s={value:g}: a worker of this recipe needs about "
            f"{est.seconds:.0f} s here to start ({est.says()}; launcher/plan/startup.py), and one "
            "still starting when the timeout runs out is taken for hung and replaced, its "
            f"replacement too. Fix: {fix}")


def startup_line(est: Estimate | None, value: float) -> str:
    """The line `launcher plan` prints."""
    if est is None:
        return "start-up: not estimated (the model cannot be measured here)"
    return (f"start-up: about {est.seconds:.0f} s a worker ({est.says()}); "
            f"checkpointless.startup_timeout_s={value:g}"
            + ("" if value >= est.seconds else ": TOO LOW"))
