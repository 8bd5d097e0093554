"""What a replacement must receive: the objects given to `protect()`, read and loaded as one state."""
from __future__ import annotations

import os

import torch
from torch.utils.data import DataLoader

from . import consistency
from .. import protocol
from .data import LoaderPosition, check_loader
from .redundancy import KEEP, ShardReplicas
from .tensors import is_dtensor, local_part


class ProtectedState:
    """Owns the registry of protected objects (anything with state_dict/load_state_dict, and
    DataLoaders, kept as their position: data.py), reads them as one nested state, loads one
    into them (re-placing sharded values like the live ones), and notes whether an optimizer update landed in the step in flight. Under FSDP it also owns
    the peer replicas of this rank's shard and the durable-checkpoint fallback."""

    def __init__(self, spec):
        self.spec = spec
        self.objects: dict = {}
        self.replicas: ShardReplicas | None = None
        self.fallback = None  # (newest_step(), load_step(step)) of durable checkpoints
        self.update_applied = False  # an optimizer step ran in the step in flight
        self.send_frozen = True  # False: frozen parameters are rebuilt by each worker, not sent
        # sharded: (ways, index, groups) the live slices are cut for (layout_for); `rebuild()` makes a model
        # sharded for this generation's processes and protects it (reshard.py)
        self.layout: tuple[int, int, int] | None = None
        self.rebuild = None

    def protect(self, **objects) -> None:
        for name, obj in list(objects.items()):
            _refuse_torch_ddp(name, obj)
            if isinstance(obj, DataLoader):  # its position, not the loader, is the state
                objects[name] = obj = LoaderPosition(obj)
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                if hasattr(obj, "__iter__"):  # a loader of another kind: say which ones work
                    check_loader(obj)
                raise TypeError(f"protect({name}=...): needs state_dict() and load_state_dict()")
            if isinstance(obj, torch.optim.Optimizer):
                obj.register_step_post_hook(self._on_optimizer_step)
        self.objects.update(objects)
        sharded = any(is_dtensor(p) for m in self.modules() for p in m.parameters())
        if sharded and self.replicas is None:
            rep = {**protocol.default_replication(), **self.spec.replication}
            self.replicas = ShardReplicas(int(rep["factor"]), int(rep["interval"]),
                                          int(rep["offset"]), int(self.spec.shard_size),
                                          int(getattr(self.spec, "pp_size", 1)))
            self.check_host_memory()

    def layout_for(self, world: int, rank: int) -> tuple[int, int, int]:
        """(ways, index, groups) the sharded state of `rank` is cut for in a generation of `world`
        processes (mesh.slice_of)."""
        from .mesh import slice_of
        return slice_of(world, rank, int(getattr(self.spec, "shard_size", 0) or 0))

    def twins(self, world: int) -> list[list[int]] | None:
        """Under HSDP, each rank's twins (the ranks holding its slice live); under ddp with
        pipeline stages the other ranks of its stage; else None."""
        pp = int(getattr(self.spec, "pp_size", 1))
        if self.replicas:
            twins = [self.replicas.twins(r, world) for r in range(world)]
        elif pp > 1:  # ddp stages: each rank a replica group of its own (mesh.py)
            from .mesh import Layout
            twins = [Layout(world, 1, pp=pp).twins(r) for r in range(world)]
        else:
            twins = []
        return twins if any(twins) else None

    def compared(self, world: int) -> list[list[int]] | None:
        """The rank sets whose parameters must agree (consistency.compared); None under fsdp,
        whose slices exist once each."""
        twins = self.twins(world)
        if (self.replicas is not None or int(getattr(self.spec, "pp_size", 1)) > 1) \
                and not twins:
            return None
        return consistency.compared(world, twins)

    def check_at_end(self, world: int, between_steps) -> None:
        """The replicas agree at the end (consistency.check_at_end): every rank under ddp, a rank
        and its twins under HSDP; and under tensor parallel the ranks of each tp group on the
        parameters it leaves whole, which each of them computes alike."""
        if (groups := self.compared(world)) is not None:
            consistency.check_at_end(self.modules(), groups, between_steps)
        tp = int(self.spec.tp_size)
        if tp > 1:
            consistency.check_at_end(self.modules(), [list(range(f, f + tp))
                                                      for f in range(0, world, tp)],
                                     between_steps, only=consistency.whole_on_tp,
                                     what="the ranks of a tensor-parallel group")

    def _on_optimizer_step(self, *_):
        self.update_applied = True

    def modules(self) -> list[torch.nn.Module]:
        return [o for o in self.objects.values() if isinstance(o, torch.nn.Module)]

    def state(self) -> dict:
        return {name: self._state_of(obj) for name, obj in self.objects.items()}

    def _state_of(self, obj) -> dict:
        if self.send_frozen or not isinstance(obj, torch.nn.Module):
            return obj.state_dict()
        frozen = _frozen_keys(obj)
        return {k: v for k, v in obj.state_dict().items() if k not in frozen}

    def load(self, state: dict) -> None:
        for name, obj in self.objects.items():
            value = state[name]
            if self.replicas is not None:  # plain local shards -> DTensors placed like the live ones
                value = _as_sharded(obj, value)
            if self.send_frozen or not isinstance(obj, torch.nn.Module):
                obj.load_state_dict(value)
                continue
            result = obj.load_state_dict(value, strict=False)
            missing = set(result.missing_keys) - _frozen_keys(obj)
            if missing or result.unexpected_keys:  # only the frozen part may be absent
                raise RuntimeError(f"protected {name}: the received state lacks {sorted(missing)}"
                                   f" and has unexpected {sorted(result.unexpected_keys)}")

    def zero_grads(self) -> None:
        for m in self.modules():
            m.zero_grad(set_to_none=True)

    def check_host_memory(self) -> None:
        """Refuse to start when the peer copies would not fit in this node's memory."""
        if self.replicas.factor <= 1:  # no copies are made (ShardReplicas.due): nothing to hold
            return
        local = sum(local_part(p).numel() * local_part(p).element_size()
                    for m in self.modules() for p in m.parameters())
        # params + 2 Adam moments, KEEP versions of each copy (redundancy.py)
        need = local * 3 * self.replicas.factor * KEEP
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return
        per_worker = avail / max(1, int(self.spec.workers_per_node))
        if need > per_worker:
            raise RuntimeError(
                f"checkpointless.replication.factor={self.replicas.factor} needs about "
                f"{need / 1e9:.1f} GB of host memory per worker for peer copies, but this node "
                f"has {per_worker / 1e9:.1f} GB available per worker. Lower the factor, raise "
                "checkpointless.replication.interval (same memory, fewer copies) or add nodes")


def _frozen_keys(module: torch.nn.Module) -> set[str]:
    """State-dict keys of the parameters that do not train (requires_grad=False)."""
    frozen = {id(p) for p in module.parameters() if not p.requires_grad}
    return {k for k, v in module.state_dict(keep_vars=True).items() if id(v) in frozen}


def _refuse_torch_ddp(name: str, obj) -> None:
    """torch's DistributedDataParallel cannot follow a recovery: its constructor broadcasts from
    rank 0, so a replacement building it waits in a collective the survivors never join (each
    spare dies, and the next, in a loop), and it keeps the process group it was built with."""
    from torch.nn.parallel import DistributedDataParallel
    found = isinstance(obj, DistributedDataParallel) or (
        isinstance(obj, torch.nn.Module) and
        any(isinstance(m, DistributedDataParallel) for m in obj.modules()))
    if found:
        raise TypeError(
            f"protect({name}=...): the model is wrapped in torch.nn.parallel."
            "DistributedDataParallel, which cannot survive a recovery (its constructor "
            "broadcasts from rank 0, so a replacement would wait in a collective the survivors "
            "never join, and it keeps the dead process group). Drop the wrapper: protect the "
            "bare model and average gradients with job.all_reduce_grads(model.parameters()) "
            "before optimizer.step()")


def refuse_torch_ddp_construction() -> None:
    """From join() on, building torch's DistributedDataParallel raises at once, with the fix.

    A script that protects the bare model and then wraps it in torch's DDP (as every DDP script
    does) would train until the first failure: then each replacement, building the wrapper,
    broadcasts from rank 0 where no survivor joins it and dies in gloo's size mismatch, spare
    after spare. Refused where it is built, the error names the wrapper and the drop-in."""
    from torch.nn.parallel import DistributedDataParallel
    if getattr(DistributedDataParallel.__init__, "_checkpointless_refused", False):
        return

    def refused(self, module=None, *args, **kwargs):
        raise TypeError(
            "torch.nn.parallel.DistributedDataParallel was built inside a checkpointless job: "
            "it cannot survive a recovery (its constructor broadcasts from rank 0, which a "
            "replacement would wait for alone, and it keeps the process group it was built "
            "with). Use checkpointless.DistributedDataParallel(model) instead (the same "
            "arguments, its all-reduce follows every new group), or protect the bare model and "
            "call job.all_reduce_grads(model.parameters()) before optimizer.step()")

    refused._checkpointless_refused = True
    DistributedDataParallel.__init__ = refused


def _like(local: torch.Tensor, ref):
    """`local` (a shard) as a DTensor placed like `ref`, or as is when `ref` is not sharded."""
    if not is_dtensor(ref):
        return local
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(local.to(ref.device), ref.device_mesh, ref.placements,
                              shape=ref.shape, stride=ref.stride(), run_check=False)


def _as_sharded(obj, value):
    if isinstance(obj, torch.nn.Module):
        live = obj.state_dict()
        return {k: _like(v, live[k]) if k in live else v for k, v in value.items()}
    if isinstance(obj, torch.optim.Optimizer):
        params = [p for g in obj.param_groups for p in g["params"]]
        order = [i for g in value["param_groups"] for i in g["params"]]
        by_id = dict(zip(order, params))
        state = {}
        for idx, st in value["state"].items():
            p = by_id[idx]
            state[idx] = {k: (_like(v, p) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                          for k, v in st.items()}
        return {"state": state, "param_groups": value["param_groups"]}
    return value
