"""How a spare replays a rank's step for an audit (checkpointless/worker/audit.py): the loop's own
micro-batches of that step, seeded and scaled as the rank ran them, on a whole model."""
from __future__ import annotations

import copy

import torch

from launcher.recipe.schema import SHARDED
from launcher.train.micro import MicroBatch


class LoopReplay:
    """What `checkpointless.join(replay=...)` asks of the loop: `model()` and `replay()`."""

    def __init__(self, cfg, model, sampler, device):
        self.cfg, self.base, self.device = cfg, model, device
        self.micro = MicroBatch.of_recipe(cfg, sampler, device)

    def model(self) -> torch.nn.Module:
        """The model to replay on. Under ddp the spare's own (it receives the whole state when
        it takes a rank anyway); under fsdp its model waits on the meta device for its shard,
        so a whole copy is built beside it, once (the audits' cost in the spare's memory)."""
        if self.cfg.distributed.strategy not in SHARDED:
            return self.base
        from models.init import materialize

        from launcher.train.model_setup import _UNFILLED
        rules, seed = _UNFILLED[self.base]
        whole = copy.deepcopy(self.base)
        materialize(whole, rules, seed, self.device)
        return whole.train()

    def replay(self, model, step: int, rank: int, world: int) -> None:
        """Rank `rank`'s forward and backward of `step`, leaving its local gradient on `model`:
        the loop's own micro-batch routine (micro.py) with the job's seeds for its data share."""
        d = self.cfg.distributed
        data_rank, data_world = rank // d.tp_size, world // d.tp_size
        loss_sum = torch.zeros(1, device=self.device)
        for micro in range(self.cfg.trainer.grad_accum_steps):
            self.micro(model, step, data_rank, data_world, micro, loss_sum)
