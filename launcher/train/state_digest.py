"""The final training state's digests, one per part, beside `params_sha256` (report.json's
`state_sha256`): a run that lost a worker must end with the failure-free run's parameters, and
with its optimizer state, data position and random state too, or its next step would differ.

    optimizer  every AdamW moment and step count, by parameter name, gathered one tensor at a
               time as the parameters are (`get_optimizer_state_dict`, so the same however the
               state is sharded), and the parameter groups (learning rate, betas, ...); under a
               pipeline each stage's, combined in stage order
    data       the data position: the steps completed and the tokens trained (the sampler draws
               step s's rows from (run.seed, s), so nothing else positions it)
    rng        torch's CPU random state (and the CUDA one on a GPU), by rank: each rank's own.
               The loop reseeds every micro-batch from (run.seed, step, share, micro)
               (micro.py), so no random state is carried from one step to the next: this one
               says the run drew the same numbers, and a rank replaced after the last step (in
               the export) shows its fresh process's
"""
from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from checkpointless.worker import StateDigest, full_tensor


def optimizer_sha256(model, optimizer, stages: int = 1) -> str:
    """The optimizer state's digest (a collective under fsdp and tp: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    state = get_optimizer_state_dict(model, optimizer)
    h = StateDigest()
    for name in sorted(state["state"]):
        for key in sorted(state["state"][name]):
            value = state["state"][name][key]
            h.update(f"{name}/{key}", full_tensor(value) if isinstance(value, torch.Tensor)
                     else torch.tensor(value))
    groups = json.dumps(state["param_groups"], sort_keys=True, default=str).encode()
    h.update("param_groups", torch.frombuffer(bytearray(groups), dtype=torch.uint8))
    mine = h.hexdigest()
    if stages <= 1:
        return mine
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)  # each stage's first rank speaks for its stage
    per = len(everyone) // stages
    return hashlib.sha256("".join(everyone[::per]).encode()).hexdigest()


def data_sha256(steps: int, tokens: int) -> str:
    return hashlib.sha256(json.dumps({"steps": steps, "tokens": tokens}).encode()).hexdigest()


def rng_sha256() -> str:
    h = StateDigest()
    h.update("cpu", torch.get_rng_state())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        h.update("cuda", torch.cuda.get_rng_state())
    return h.hexdigest()


def state_digests(run, params: str) -> dict:
    """{params, optimizer, data, rng} of this rank at the end of the run."""
    stages = run.cfg.distributed.pp_size if run.pipe is not None else 1
    optimizer = run.job.between_steps(lambda: optimizer_sha256(run.model, run.optimizer, stages))
    return {"params": params, "optimizer": optimizer,
            "data": data_sha256(run.job.completed_steps, run.tokens), "rng": rng_sha256()}
