"""How a spare replays a rank's step for an audit (checkpointless/worker/audit.py): the loop's own
micro-batches of that step, seeded and scaled as the rank ran them, on a whole model."""
from __future__ import annotations

import copy
from contextlib import nullcontext

import torch

from checkpointless import step_seed
from checkpointless.worker import seed_all

from .data import to_device
from .schema import SHARDED


class LoopReplay:
    """What `checkpointless.join(replay=...)` asks of the loop: `model()` and `replay()`."""

    def __init__(self, cfg, model, sampler, device):
        self.cfg, self.base, self.sampler, self.device = cfg, model, sampler, device

    def model(self) -> torch.nn.Module:
        """The model to replay on. Under ddp the spare's own (it receives the whole state when
        it takes a rank anyway); under fsdp its model waits on the meta device for its shard,
        so a whole copy is built beside it, once (the audits' cost in the spare's memory)."""
        if self.cfg.distributed.strategy not in SHARDED:
            return self.base
        from models.init import materialize

        from .model_setup import _UNFILLED
        rules, seed = _UNFILLED[self.base]
        whole = copy.deepcopy(self.base)
        materialize(whole, rules, seed, self.device)
        return whole.train()

    def replay(self, model, step: int, rank: int, world: int) -> None:
        """Rank `rank`'s forward and backward of `step` (launcher/loop.py forward_backward),
        leaving its local gradient on `model`."""
        t, d = self.cfg.trainer, self.cfg.distributed
        data_rank, data_world = rank // d.tp_size, world // d.tp_size
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) \
            if t.precision == "bf16" else nullcontext()
        for micro in range(t.grad_accum_steps):
            seed_all(step_seed(int(self.cfg.run.seed), step, data_rank, micro))
            batch = to_device(self.sampler.batch(step, data_rank, data_world, micro), self.device)
            with autocast:
                loss = model(**batch).loss
            (loss / t.grad_accum_steps).backward()  # accelerate's scaling of accumulation
