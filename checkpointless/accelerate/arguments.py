"""What the drop-in Accelerator refuses in its arguments and environment, before the job is
joined, and the loader configuration it needs (see docs/accelerate.md)."""
from __future__ import annotations

import os

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DataLoaderConfiguration


def refuse_unsupported(a: dict) -> None:
    """`a`: accelerate.Accelerator's bound arguments. Raise, naming the argument or variable, for
    what the drop-in cannot protect."""
    if PartialState._shared_state or AcceleratorState._shared_state:
        raise RuntimeError("checkpointless.accelerate.Accelerator: build it before anything "
                           "else of accelerate's (PartialState, another Accelerator): the job "
                           "decides this process's rank when it joins")
    for plugin in ("deepspeed_plugin", "deepspeed_plugins", "fsdp_plugin",
                   "megatron_lm_plugin", "torch_tp_plugin", "parallelism_config"):
        if a.get(plugin) is not None:
            raise NotImplementedError(f"checkpointless.accelerate: {plugin} is not supported; "
                                      "the model is replicated and protected whole")
    for env in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "ACCELERATE_USE_MEGATRON_LM",
                "ACCELERATE_USE_PARALLELISM_CONFIG"):
        if os.environ.get(env, "false").lower() == "true":
            raise NotImplementedError(f"checkpointless.accelerate: {env}=true (an accelerate "
                                      "config) is not supported; the model is replicated")
    steps = a["gradient_accumulation_steps"]
    plugin = a.get("gradient_accumulation_plugin")
    if plugin is not None:
        steps = plugin.num_steps
    if int(os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", steps)) != 1:
        raise NotImplementedError("checkpointless.accelerate: gradient accumulation over "
                                  "several batches is not supported (one batch per step)")


def loader_config(config: DataLoaderConfiguration | None, seed: int) -> DataLoaderConfiguration:
    """Loaders whose order is a function of (seed, epoch), with no batch broadcast from rank 0."""
    config = config or DataLoaderConfiguration()
    if config.dispatch_batches:
        raise NotImplementedError("checkpointless.accelerate: dispatch_batches is not "
                                  "supported (rank 0 would broadcast every batch)")
    config.dispatch_batches = False
    config.use_seedable_sampler = True  # a shuffled order is a function of (seed, epoch)
    if config.data_seed is None:
        config.data_seed = seed
    return config
