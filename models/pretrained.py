"""Pretrained weights read slice by slice from safetensors files: each rank reads only its shard.

    files = SafetensorsFiles.locate("meta-llama/Meta-Llama-3-8B")   # a folder or the hub cache
    local = files.read_part("model.layers.0.mlp.up_proj.weight", param)  # this rank's rows only

`safe_open(...).get_slice(key)[a:b, c:d]` reads the bytes of that block of one tensor from the
memory-mapped file and nothing else. Which block a rank holds is DTensor's own answer for the
parameter's mesh and placements (any number of dimensions: fsdp, hsdp, fsdp x tp, hsdp x tp,
each pipeline stage's): every rank cuts a small index probe as DTensor cuts the parameter, so a
rank reads its part of each tensor and no process holds a whole large tensor.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from models import mxfp4


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
        found = next((c for c in candidates if c in self.where), None)
        if found is None:  # stored quantized (gpt-oss's MXFP4 experts): models/mxfp4.py reads it
            found = next((k for k in (mxfp4.packed_key(c, self.where) for c in candidates) if k),
                         None)
        return found

    @staticmethod
    def may_lack(name: str) -> bool:
        """A parameter the checkpoint need not hold: peft's adapters, which the recipe adds to
        the pretrained model and initializes by their own rules."""
        return ".lora_" in name or name.startswith("lora_")

    def missing(self, name: str) -> "MissingWeights":
        return MissingWeights(
            f"{self.folder}: the checkpoint holds no tensor for parameter {name!r} of the model "
            "the recipe builds (its keys name none of that parameter's spellings). The model "
            "would start with that weight random while the rest is pretrained. Fix: point "
            "model.id at a checkpoint of the same architecture as model.name and model.config, "
            "saved with save_pretrained")

    def _file(self, path: Path):
        if path not in self._open:
            from safetensors import safe_open
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path]

    def _slice(self, key: str):
        return self._file(self.where[key]).get_slice(key)

    def shape(self, key: str) -> tuple:
        """The shape of the parameter that checkpoint tensor `key` gives (dequantized)."""
        stored = tuple(self._slice(key).get_shape())
        return mxfp4.logical_shape(stored) if mxfp4.is_packed(key) else stored

    def read_part(self, key: str, param) -> torch.Tensor:
        """The part of checkpoint tensor `key` that this rank holds of `param` (all of it when
        `param` is not a DTensor), in the parameter's dtype."""
        shape = self.shape(key)
        if shape != tuple(param.shape):
            raise MissingWeights(f"{key}: the checkpoint holds shape {list(shape)}, the model "
                                 f"built from the recipe's config wants {list(param.shape)}")
        index = _my_index(param)
        if mxfp4.is_packed(key):
            scales = key.removesuffix(mxfp4.BLOCKS) + mxfp4.SCALES
            part, read = mxfp4.read(self._slice(key), self._slice(scales), index, param.dtype)
            self.elements_read += read
            return part
        sl = self._slice(key)
        part = sl[index] if index else sl[:]
        self.elements_read += part.numel()
        return part.to(param.dtype)

    def close(self):
        self._open.clear()


def _my_index(param) -> tuple | None:
    """This rank's part of `param` as an index into the whole tensor: one slice per dimension,
    or None for a whole tensor (not a DTensor, or replicated on every mesh dimension).

    The rows (and columns) a rank holds are found by letting DTensor cut, for each dimension d,
    a probe whose values along d are their own indices (and whose other dimensions are just long
    enough for every rank to keep one entry): the values this rank keeps are its indices along
    d. This follows any placement DTensor makes, FSDP2's Shard(0) and its strided shard over a
    tensor-parallel split included, without restating how each one divides a tensor."""
    if not hasattr(param, "device_mesh"):
        return None
    from torch.distributed.tensor import Replicate, distribute_tensor
    mesh, placements = param.device_mesh, tuple(param.placements)
    if all(isinstance(p, Replicate) for p in placements):
        return None
    shape = tuple(param.shape)
    sharded = {}  # tensor dim -> how many parts the mesh cuts it into
    for size, p in zip(mesh.shape, placements):
        if hasattr(p, "dim"):
            sharded[p.dim] = sharded.get(p.dim, 1) * size
        elif not isinstance(p, Replicate):
            raise NotImplementedError(f"reading pretrained weights into placement {p} "
                                      "(a partial sum) is not handled")
    index = [slice(None)] * len(shape)
    for dim in sharded:
        probe_shape = [min(shape[k], sharded.get(k, 1)) if k != dim else shape[k]
                       for k in range(len(shape))]
        view = [1] * len(shape)
        view[dim] = shape[dim]
        probe = torch.arange(shape[dim], dtype=torch.int64).view(view).expand(probe_shape)
        # src_data_rank=None: each rank cuts its own copy, nothing is sent
        mine = distribute_tensor(probe.contiguous(), mesh, placements,
                                 src_data_rank=None).to_local()
        along = mine.movedim(dim, 0).reshape(mine.shape[dim], -1)
        rows = along[:, 0].tolist() if along.shape[1] else []  # [] : an empty part
        if not rows:
            index[dim] = slice(0, 0)
        elif rows != list(range(rows[0], rows[0] + len(rows))):
            raise NotImplementedError(f"reading pretrained weights: the part of dimension {dim} "
                                      f"placed by {placements} is not one run of rows")
        else:
            index[dim] = slice(rows[0], rows[-1] + 1)
    return tuple(index)
