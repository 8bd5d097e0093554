"""DTensors (FSDP2's sharded parameters and their optimizer state) and plain tensors, told apart in
one place.

A DTensor is recognised by its attributes, so that torch.distributed.tensor need not be imported
(nor exist) where no tensor is sharded. Every helper returns a plain tensor unchanged.
"""
from __future__ import annotations


def is_dtensor(t) -> bool:
    """`t` is a DTensor (a parameter sharded by FSDP2 included)."""
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def local_part(t):
    """This rank's part of `t`: a DTensor's local shard, a plain tensor itself."""
    return t.to_local() if is_dtensor(t) else t


def local_tensor(t):
    """`local_part` read as an attribute where it can be: to_local (and detach) go through
    DTensor's dispatch, ~0.1 ms a tensor, which adds up over a whole state every step."""
    local = getattr(t, "_local_tensor", None)
    return local_part(t) if local is None else local


def full_tensor(t):
    """The whole tensor: a DTensor is gathered, a plain tensor returned as is.

    Gathering is a collective, so every rank must call this for the same tensors in the same order.
    """
    return t.full_tensor() if is_dtensor(t) else t
