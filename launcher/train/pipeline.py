"""Pipeline parallelism in the recipe loop (`distributed.pp_size`).

The split follows the model's own pipeline plan (transformers' `base_model_pp_plan`: the
embedding, the run of decoder layers, the final norm; the head after it): each stage holds a
run of decoder layers, the first stage the embedding too, the last the norm and the head. Which
layers each stage holds is chosen by parameter count (`split`) or set with
`distributed.pp_layers`, and printed at the start. torch's own `torch.distributed.pipelining`
runs the schedule (GPipe, 1F1B, interleaved 1F1B) over the job's pp mesh dimension.

A worker builds the whole model as every other shape does (the same seed gives every layer the
same initial bits as an unpipelined run), then keeps its stage's part (`StagePart`, whose
parameter names are the whole model's, so checkpoints and digests name each tensor once). Under
interleaved 1F1B a worker holds two virtual stages, p and p + pp_size; each is a `StageView` over
the part's modules.

Recovery: a rank lost anywhere in the schedule (a microbatch's send or receive, the stage's
gradient reduction, the optimizer) fails the step on every stage; each drops the step's
microbatches and partial gradients and redoes it whole on the next generation's group, the
replacement having received its stage's state from a twin (the same stage in another
data-parallel replica) or peer copies (restore.py). The stages are rebuilt for every generation:
torch's PipelineStage keeps the process group it was made with.
"""
from __future__ import annotations

import torch

from launcher.parallel.pipeline_split import (SCHEDULES, describe, microbatches, stage_layers,
                                              virtual_stages)


class StagePart(torch.nn.Module):
    """A worker's part of a causal LM: its decoder layers (under their index in the whole
    model), the rotary embedding every stage needs, the embedding on the first stage, the norm
    and head on the last. Shaped like the model (`<prefix>.layers.<i>`, `lm_head`) so the
    sharding and tensor-parallel code find the blocks where they look for them."""

    def __init__(self, model: torch.nn.Module, layers: list[int], first: bool, last: bool):
        super().__init__()
        prefix = model.base_model_prefix
        base = getattr(model, prefix)
        self.config, self.base_model_prefix = model.config, prefix
        self.model_class = type(model).__name__  # what the export's config names
        body = torch.nn.Module()
        body.layers = torch.nn.ModuleDict({str(i): base.layers[i] for i in layers})
        body.rotary_emb = base.rotary_emb
        body.embed_tokens = base.embed_tokens if first else None
        body.norm = base.norm if last else None
        setattr(self, prefix, body)
        self.lm_head = model.lm_head if last else None
        self.loss_function = model.loss_function  # the whole model's: the same loss as unpipelined

    @property
    def body(self) -> torch.nn.Module:
        return getattr(self, self.base_model_prefix)


class StageView(torch.nn.Module):
    """One (virtual) stage: the forward of its layers of a StagePart, from the input ids on the
    first stage or the previous stage's hidden states, to the logits on the last."""

    def __init__(self, part: StagePart, layers: list[int], first: bool, last: bool):
        super().__init__()
        body = part.body
        self.config = part.config
        self.layers = torch.nn.ModuleList([body.layers[str(i)] for i in layers])
        self.rotary_emb = body.rotary_emb
        self.embed_tokens = body.embed_tokens if first else None
        self.norm = body.norm if last else None
        self.lm_head = part.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        # the positions and causal mask an unpipelined forward makes (no padding, no cache)
        pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                  cache=None, position_ids=pos)
        rope = self.rotary_emb(h, position_ids=pos)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_embeddings=rope, position_ids=pos)
        if self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h


class ViewSet(torch.nn.Module):
    """The stage views as a protected object with no state of its own (the part holds all of
    it): protected so that a recovery points their FSDP handles at the new group too, as it
    does the part's (each view is an FSDP root under fsdp, as torch's pipelining expects)."""

    def __init__(self, views: list[StageView]):
        super().__init__()
        self.views = torch.nn.ModuleList(views)

    def state_dict(self, *args, **kwargs) -> dict:
        return {}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return None


class Pipeline:
    """This worker's stage(s) of the pipeline and the schedule that runs them."""

    def __init__(self, cfg, model: torch.nn.Module, job, counts: list[int]):
        d = self.d = cfg.distributed
        self.cfg, self.job = cfg, job
        self.pp, self.v = d.pp_size, virtual_stages(d)
        self.stage = job.rank // (job.world_size // self.pp)
        layers = stage_layers(counts)
        self.indices = [self.stage + i * self.pp for i in range(self.v)]
        n_stages = self.pp * self.v
        mine = sorted(i for s in self.indices for i in layers[s])
        self.first, self.last = self.stage == 0, self.stage == self.pp - 1
        self.part = StagePart(model, mine, self.first, self.last)
        self.views = [StageView(self.part, layers[s], s == 0, s == n_stages - 1)
                      for s in self.indices]
        self.n_micro = microbatches(cfg)
        self.split = describe(counts, self.pp)
        self._gen, self.schedule = None, None

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.part.loss_function(logits=logits, labels=labels,
                                       vocab_size=self.part.config.vocab_size)

    def _current(self, device):
        """The schedule over this generation's pp group (rebuilt after every recovery)."""
        if self._gen != self.job.gen:
            from torch.distributed import pipelining
            group = self.job.mesh_group("pp")
            stages = [pipelining.PipelineStage(v, s, self.pp * self.v, device, group=group)
                      for v, s in zip(self.views, self.indices)]
            kind = getattr(pipelining, SCHEDULES[self.d.pp_schedule])
            self.schedule = kind(stages if self.v > 1 else stages[0], self.n_micro,
                                 loss_fn=self.loss)
            self._gen = self.job.gen
        return self.schedule

    def forward_backward(self, run, step: int) -> torch.Tensor:
        """The step's microbatches through the schedule, forward and backward; the step's
        summed loss as the unpipelined loop counts it (on the last stage; zero elsewhere).
        Only the first stage reads the inputs, only the last the labels: the rows of the
        pp_size data shares of this pipeline (rows_per_step)."""
        job, t, device = self.job, self.cfg.trainer, run.accelerator.device
        schedule = self._current(device)
        job.seed_step(step, 0)
        inputs = labels = None
        if self.first or self.last:
            shares = job.data_world * self.pp
            rows = [run.micro.batch(step, job.data_rank * self.pp + k, shares, micro)
                    for k in range(self.pp) for micro in range(t.grad_accum_steps)]
            inputs = torch.cat([r["input_ids"] for r in rows]) if self.first else None
            labels = torch.cat([r["labels"] for r in rows]) if self.last else None
        losses: list = []
        with run.accelerator.autocast():
            schedule.step(*([inputs] if self.first else []), target=labels, losses=losses,
                          return_outputs=False)
        if not self.last:
            return torch.zeros(1, device=device)
        # the mean of the microbatches' losses, counted as grad_accum_steps micro-batches
        return (torch.stack([x.detach().float() for x in losses]).mean() *
                t.grad_accum_steps).reshape(1)

    def loss_and_clip(self, params, loss_sum: torch.Tensor, max_norm: float):
        """One small collective over every rank: the step's loss (summed over the ranks, as
        unpipelined) and the squares of each stage's gradient norm (its first rank's), for the
        whole model's norm; the gradients are then scaled by the same factor everywhere."""
        import torch.distributed as dist
        from launcher.train.tensor_parallel import scale_by_clip, squared_norm
        grads = [p.grad for p in params if p.grad is not None]
        squares = squared_norm(grads)  # this stage's, the same on each of its ranks
        first = self.job.rank % (self.job.world_size // self.pp) == 0
        both = torch.stack([loss_sum.detach().to("cpu", torch.float32).reshape(()),
                            squares if first else torch.zeros(())]).to(loss_sum.device)
        dist.all_reduce(both)
        both = both.cpu()
        total = both[1].sqrt()
        scale_by_clip(grads, total, max_norm)
        return both[0].reshape(1), total


class Pipelined:
    """The step strategy of a pipelined job (strategy.py): the schedule runs the microbatches
    through the stages; the gradients are averaged over the stage's replicas (by FSDP2, or in
    one fixed-order all-reduce under ddp); the loss and the norm over the whole pipeline."""

    def gradients_and_norm(self, run, step: int, max_norm: float):
        params = run.model.parameters
        loss_sum = run.pipe.forward_backward(run, step)
        if run.cfg.distributed.strategy == "ddp":
            run.job.all_reduce_grads(params())
        return run.pipe.loss_and_clip(params(), loss_sum, max_norm)
