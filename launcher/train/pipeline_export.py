"""The end of a pipelined run: the whole model's digest, and its export, from its stages.

The digest is the same function of the model as an unpipelined run's (export.py): SHA-256 over
every tensor in sorted name order. No rank holds the whole model for it: tensors travel one at
a time, in that order, from the first rank of the stage holding each (gathered inside its stage
first under fsdp) to rank 0, which hashes and drops them. Each stage's first rank writes one file
of the export with its stage's tensors; rank 0 then writes the index, the config and the
tokenizer, as save_pretrained lays out a large model.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from checkpointless.worker import StateDigest, full_tensor

from launcher.train.export import _file_name, _remove_stale_weights, _write_index, local_state, saved_names


def digest_and_export(part, strategy: str, tokenizer, path: Path | None, rank: int,
                      world: int, pp: int) -> tuple[str, int]:
    """(params_sha256, parameter count) of the whole model, and with `path` its export. Every
    rank calls this together."""
    per = world // pp
    stage, lead = rank // per, rank % per == 0
    state = local_state(part, strategy)
    shapes = {n: (str(t.dtype), tuple(t.shape)) for n, t in state.items()}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, shapes)
    owner = {}
    for r in range(0, world, per):  # each stage's first rank speaks for its stage
        for name, meta in everyone[r].items():
            owner.setdefault(name, (r // per, meta))
    digest, count, keep = StateDigest(), 0, {}
    kept = set(saved_names(part, list(state))) if path is not None else set()
    for name in sorted(owner):
        s, (dtype, shape) = owner[name]
        t = None
        if s == stage:
            t = full_tensor(state[name]).detach().to("cpu").contiguous()  # inside the stage
            if lead and name in kept:
                keep[name] = t.clone()
            if lead and rank != 0:
                dist.send(t, 0)
        if rank == 0:
            if s != 0:
                t = torch.empty(shape, dtype=getattr(torch, dtype.removeprefix("torch.")))
                dist.recv(t, s * per)
            digest.update(name, t)
            count += t.numel()
        del t
    said = [digest.hexdigest(), count] if rank == 0 else [None, None]
    dist.broadcast_object_list(said, src=0)
    if path is not None:
        _write(part, tokenizer, Path(path), stage if lead else None, pp, keep)
    return said[0], said[1]


def _write(part, tokenizer, path: Path, index: int | None, pp: int, keep: dict) -> None:
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    if index is not None:
        name = path / _file_name(index, pp)
        save_file(keep, str(name) + ".tmp", metadata={"format": "pt"})
        (path / (name.name + ".tmp")).replace(name)
    dist.barrier()  # every file is complete before the index names it
    if index != 0:
        return
    _remove_stale_weights(path, {_file_name(i, pp) for i in range(pp)})
    if pp > 1:
        _write_index(path, pp)
    config = part.config
    config.architectures = [part.model_class]
    config.dtype = str(next(part.parameters()).dtype).removeprefix("torch.")
    config.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
