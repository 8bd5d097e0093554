"""A digest of model state that is the same however the state was sharded."""
from __future__ import annotations

import hashlib

import torch


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor (FSDP2 shard) is gathered, a plain tensor returned as is.

    Gathering is a collective, so every rank must call this for the same tensors in the same order.
    """
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def state_sha256(state: dict) -> str:
    """SHA-256 over (name, dtype, shape, bytes) of each tensor, in sorted name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = full_tensor(state[name]).detach().cpu().contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def model_sha256(model: torch.nn.Module) -> str:
    return state_sha256(model.state_dict())
