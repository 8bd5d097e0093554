"""Pretrained weights read slice by slice from safetensors files: each rank reads only its shard.

    files = SafetensorsFiles.locate("meta-llama/Meta-Llama-3-8B")   # a folder or the hub cache
    local = files.read_part("model.layers.0.mlp.up_proj.weight", param)  # this rank's rows only

`safe_open(...).get_slice(key)[a:b]` reads the bytes of rows a..b of one tensor from the
memory-mapped file and nothing else, so a rank under FSDP2 (Shard(0) over a 1-D mesh) reads
1/world of each parameter and no process holds the whole model.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch


class MissingWeights(RuntimeError):
    pass


class SafetensorsFiles:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            self.where = {k: self.folder / f
                          for k, f in json.loads(index.read_text())["weight_map"].items()}
        elif (self.folder / "model.safetensors").exists():
            from safetensors import safe_open
            one = self.folder / "model.safetensors"
            with safe_open(str(one), framework="pt") as f:
                self.where = {k: one for k in f.keys()}
        else:
            raise MissingWeights(f"{self.folder}: no model.safetensors or "
                                 "model.safetensors.index.json (only safetensors checkpoints can "
                                 "be read shard by shard)")
        self._open: dict = {}
        self.elements_read = 0  # what this process read, for the tests' accounting

    @classmethod
    def locate(cls, ident: str) -> "SafetensorsFiles":
        """A local folder as is; a hub id through the local cache (downloading the safetensors
        files and configs once, when the hub can be reached)."""
        if os.path.isdir(ident):
            return cls(Path(ident))
        from huggingface_hub import snapshot_download
        folder = snapshot_download(ident, allow_patterns=["*.safetensors", "*.json"])
        return cls(Path(folder))

    def key_for(self, name: str, prefixes=()) -> str | None:
        """The checkpoint key of model parameter `name`: as is, or without peft's wrapping
        (base_model.model., .base_layer) and the base model's prefix, which checkpoints saved
        from the bare model lack (GPT-2's `h.0...` for `transformer.h.0...`)."""
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        candidates = [name, plain] + [plain.removeprefix(p + ".") for p in prefixes if p]
        return next((c for c in candidates if c in self.where), None)

    def _file(self, path: Path):
        if path not in self._open:
            from safetensors import safe_open
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path]

    def read_part(self, key: str, param) -> torch.Tensor:
        """The part of checkpoint tensor `key` that this rank holds of `param` (all of it when
        `param` is not a DTensor), in the parameter's dtype."""
        sl = self._file(self.where[key]).get_slice(key)
        shape = tuple(sl.get_shape())
        if shape != tuple(param.shape):
            raise MissingWeights(f"{key}: the checkpoint holds shape {list(shape)}, the model "
                                 f"built from the recipe's config wants {list(param.shape)}")
        index = _my_index(param)
        part = sl[index] if index else sl[:]
        self.elements_read += part.numel()
        return part.to(param.dtype)

    def close(self):
        self._open.clear()


def _my_index(param) -> tuple | None:
    """Index of this rank's part of a DTensor sharded on a 1-D mesh (torch.chunk's split, as
    DTensor's Shard(dim) cuts); None for a whole tensor."""
    if not hasattr(param, "device_mesh"):
        return None
    from torch.distributed.tensor import Replicate, Shard
    mesh = param.device_mesh
    if mesh.ndim != 1:
        raise NotImplementedError("sharded loading handles a 1-D device mesh (FSDP2's)")
    (placement,) = param.placements
    if isinstance(placement, Replicate):
        return None
    if not isinstance(placement, Shard):
        raise NotImplementedError(f"sharded loading: placement {placement} is not handled")
    dim, n, world = placement.dim, param.shape[placement.dim], mesh.size()
    chunk = -(-n // world)
    start = min(n, mesh.get_local_rank() * chunk)
    stop = min(n, start + chunk)
    index = [slice(None)] * len(param.shape)
    index[dim] = slice(start, stop)
    return tuple(index)
