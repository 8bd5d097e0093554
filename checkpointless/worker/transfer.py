"""Peer-to-peer transfer of training state from a healthy worker to one that needs it.

The state (model, optimizer, anything with `state_dict`) is split into a skeleton (the nested
structure with every tensor replaced by its index, pickled) and one flat byte buffer holding all
tensors back to back. Three messages cross the wire: the sizes, the skeleton, the buffer (with its
SHA-256 digest appended), so the cost is one large send whatever the number of tensors. The receiver
checks the digest before it touches its live state: a corrupt or truncated transfer is refused, never
loaded.
"""
from __future__ import annotations

import hashlib
import pickle

import torch
import torch.distributed as dist

from .failures import communicating
from .tensors import local_tensor


class _TensorRef:
    """A tensor's place in the flat buffer (index, dtype, shape), standing in for it in the skeleton."""

    __slots__ = ("index", "dtype", "shape")

    def __init__(self, index, dtype, shape):
        self.index, self.dtype, self.shape = index, dtype, shape

    def __repr__(self) -> str:  # the same for the same place (a digest of a skeleton reads it)
        return f"<tensor {self.index} {self.dtype} {list(self.shape)}>"


def strip_tensors(obj) -> tuple[object, list[torch.Tensor]]:
    """(the structure of `obj` with each tensor replaced by a reference, its tensors in traversal
    order): the local shard of a DTensor, detached, wherever it lives (no copy is made here)."""
    tensors: list[torch.Tensor] = []

    def strip(x):
        if isinstance(x, torch.Tensor):
            # a DTensor: its local shard only, read as an attribute (detach and to_local go
            # through DTensor's dispatch, ~0.1 ms a tensor: most of a snapshot's cost)
            t = local_tensor(x).detach()
            tensors.append(t)
            return _TensorRef(len(tensors) - 1, t.dtype, tuple(t.shape))
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(strip(v) for v in x)
        return x

    return strip(obj), tensors


def flatten_state(obj, tail: int = 0) -> tuple[bytes, torch.Tensor]:
    """(pickled skeleton, uint8 buffer with every tensor's bytes in traversal order), plus `tail`
    spare bytes at the end of the buffer (room for a digest, so it needs no second copy)."""
    skeleton, tensors = strip_tensors(obj)
    tensors = [t.cpu().contiguous() for t in tensors]
    parts = [t.reshape(-1).view(torch.uint8) for t in tensors if t.numel() > 0]
    if tail:
        parts.append(torch.zeros(tail, dtype=torch.uint8))
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    return pickle.dumps(skeleton), flat


def unflatten_state(skeleton_bytes: bytes, flat: torch.Tensor, copy: bool = True):
    """The object `flatten_state` took apart. With copy=False the tensors are views into `flat`
    where alignment allows (for a buffer that is not reused, such as one just received)."""
    skeleton = pickle.loads(skeleton_bytes)
    offset = 0
    refs: list[_TensorRef] = []

    def collect(x):
        if isinstance(x, _TensorRef):
            refs.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                collect(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                collect(v)

    collect(skeleton)
    tensors = {}
    for ref in sorted(refs, key=lambda r: r.index):
        size = torch.empty(0, dtype=ref.dtype).element_size()
        n = torch.Size(ref.shape).numel() * size
        chunk = flat[offset:offset + n]
        if copy or (flat.storage_offset() + offset) % size:  # a misaligned view is refused
            chunk = chunk.clone()
        offset += n
        tensors[ref.index] = chunk.view(ref.dtype).reshape(ref.shape)
    return fill_refs(skeleton, tensors)


def fill_refs(skeleton, tensors: dict):
    """`skeleton` (strip_tensors') with each reference replaced by tensors[its index]."""
    if isinstance(skeleton, _TensorRef):
        return tensors[skeleton.index]
    if isinstance(skeleton, dict):
        return {k: fill_refs(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(fill_refs(v, tensors) for v in skeleton)
    return skeleton


def _digest(skeleton: bytes, flat: torch.Tensor) -> bytes:
    h = hashlib.sha256(skeleton)
    if flat.numel():
        h.update(flat.numpy())  # hashed in place through the buffer protocol: no copy
    return h.digest()


def send_state(obj, dst: int, group=None, midway=None) -> int:
    """Send `obj` to rank `dst`; returns the number of bytes sent. `midway()` is called between
    the skeleton and the payload, while the receiver waits inside its receive (faults)."""
    skeleton, payload = flatten_state(obj, tail=32)  # the digest goes in the last 32 bytes
    flat = payload[:-32]
    payload[-32:] = torch.frombuffer(bytearray(_digest(skeleton, flat)), dtype=torch.uint8)
    sizes = torch.tensor([len(skeleton), flat.numel()], dtype=torch.int64)
    with communicating(f"sending the state to rank {dst}"):
        dist.send(sizes, dst, group=group)
        dist.send(torch.frombuffer(bytearray(skeleton), dtype=torch.uint8), dst, group=group)
        if midway is not None:
            midway()
        dist.send(payload, dst, group=group)
    return len(skeleton) + payload.numel()


def recv_state(src: int, group=None):
    """Receive a state sent by `send_state` from `src`; returns (state, bytes received)."""
    sizes = torch.empty(2, dtype=torch.int64)
    with communicating(f"receiving the state from rank {src}"):
        dist.recv(sizes, src, group=group)
        n_skel, n_flat = (int(v) for v in sizes)
        skel = torch.empty(n_skel, dtype=torch.uint8)
        dist.recv(skel, src, group=group)
        payload = torch.empty(n_flat + 32, dtype=torch.uint8)
        dist.recv(payload, src, group=group)
    skeleton = skel.numpy().tobytes()
    flat, digest = payload[:n_flat], payload[n_flat:].numpy().tobytes()
    if _digest(skeleton, flat) != digest:
        raise IntegrityError(f"state received from rank {src} failed its SHA-256 check")
    return unflatten_state(skeleton, flat, copy=False), n_skel + n_flat + 32


def broadcast_state(obj, src: int, rank: int, group=None):
    """Rank `src` sends `obj` to every member in one broadcast (the others pass None); returns
    (the state on a receiver, None on `src`; bytes moved). The same SHA-256 check as recv_state."""
    if rank == src:
        skeleton, payload = flatten_state(obj, tail=32)
        payload[-32:] = torch.frombuffer(bytearray(_digest(skeleton, payload[:-32])),
                                         dtype=torch.uint8)
        sizes = torch.tensor([len(skeleton), payload.numel()], dtype=torch.int64)
    else:
        sizes = torch.empty(2, dtype=torch.int64)
    with communicating(f"broadcasting rank {src}'s state"):
        dist.broadcast(sizes, src, group=group)
        n_skel, n_payload = (int(v) for v in sizes)
        if rank == src:
            skel = torch.frombuffer(bytearray(skeleton), dtype=torch.uint8)
        else:
            skel = torch.empty(n_skel, dtype=torch.uint8)
            payload = torch.empty(n_payload, dtype=torch.uint8)
        dist.broadcast(skel, src, group=group)
        dist.broadcast(payload, src, group=group)
    if rank == src:
        return None, n_skel + n_payload
    skeleton = skel.numpy().tobytes()
    flat, digest = payload[:-32], payload[-32:].numpy().tobytes()
    if _digest(skeleton, flat) != digest:
        raise IntegrityError(f"state broadcast by rank {src} failed its SHA-256 check")
    return unflatten_state(skeleton, flat, copy=False), n_skel + n_payload


class IntegrityError(RuntimeError):
    """A transferred state did not match its digest."""

