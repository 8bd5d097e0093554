"""A digest of model state that is the same however the state was sharded."""
from __future__ import annotations

import hashlib

import torch

from .tensors import full_tensor


class StateDigest:
    """SHA-256 over (name, dtype, shape, bytes) of tensors fed one at a time, in sorted name
    order: a caller can gather a sharded tensor, feed it and drop it before the next, so the
    whole state is never held at once."""

    def __init__(self):
        self._h = hashlib.sha256()

    def update(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach().cpu().contiguous()
        self._h.update(name.encode())
        self._h.update(str(t.dtype).encode())
        self._h.update(str(tuple(t.shape)).encode())
        self._h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def state_sha256(state: dict) -> str:
    """SHA-256 over (name, dtype, shape, bytes) of each tensor, in sorted name order. DTensors
    are gathered one at a time (a collective per tensor: every rank calls this together)."""
    h = StateDigest()
    for name in sorted(state):
        h.update(name, full_tensor(state[name]))
    return h.hexdigest()


def model_sha256(model: torch.nn.Module) -> str:
    return state_sha256(model.state_dict())
