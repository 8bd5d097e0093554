"""The process group of one generation: built on the store, torn down, and handed to FSDP.

Each generation gets a fresh group on its own store prefix. Before it is built, the members meet
at a barrier on the store, so a member that died after the plan was published cannot block the
others inside the group's constructor. Tearing a group down must release any peer still blocked
on it: gloo's abort does not, so a leaving worker also shuts its group's sockets (release.py).
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from . import membership, protocol
from .failures import communicating
from .release import sever_peer_connections


class Group:
    """Owns this worker's process group: forming one per plan, tearing it down, aborting it, and
    keeping FSDP2 modules pointed at the live one."""

    def __init__(self, store, backend: str, pg_timeout_s: float, store_port: int, modules):
        self.store = store
        self.backend = backend
        self.pg_timeout_s = pg_timeout_s
        self.store_port = store_port
        self.modules = modules  # () -> the protected nn.Modules, for FSDP's cached group handles

    def form(self, plan: membership.Plan, rank: int) -> bool:
        """Build generation `plan.gen`'s group; False when a newer plan replaced it meanwhile."""
        self.teardown()
        if not membership.barrier(self.store, plan.gen, plan.world_size):
            return False
        with communicating(f"forming the process group of generation {plan.gen}"):
            dist.init_process_group(
                self.backend, store=dist.PrefixStore(protocol.group_prefix(plan.gen), self.store),
                rank=rank, world_size=plan.world_size,
                timeout=timedelta(seconds=self.pg_timeout_s))
        self.rebind_sharded_modules(dist.group.WORLD)
        got = dist.get_world_size()
        if got != plan.world_size:
            raise RuntimeError(f"process group has world size {got}, the plan asked for "
                               f"{plan.world_size}")
        return True

    def teardown(self) -> None:
        # Drop FSDP's handles on the old group first: while anything references it, its
        # sockets stay open and a peer blocked on us would wait for the timeout.
        self.rebind_sharded_modules(None)
        if not dist.is_initialized():
            return
        self.release_peers()
        self.abort()
        try:
            dist.destroy_process_group()
        except Exception:
            pass

    def release_peers(self) -> None:
        """Shut this process's group connections (gloo), before anything closes its copies of
        them: children forked after join (DataLoader workers) hold the same sockets, so closing
        our descriptors alone would leave the connections open and peers blocked on them."""
        if self.backend == "gloo":
            sever_peer_connections({self.store_port})

    @staticmethod
    def abort() -> None:
        """Make every call blocked on the current group return with an error (NCCL honours this;
        for gloo the sockets are shut as well, in teardown)."""
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:
            pass

    def rebind_sharded_modules(self, group) -> None:
        """Point FSDP2 modules at `group` (the new default group, or None to drop the old one).

        FSDP keeps the group object it was built with; after a regroup that object is dead. The new
        default group gets the old one's name, so DTensor's mesh resolves to it; only FSDP's cached
        handles need replacing, no parameter moves.
        """
        for obj in self.modules():
            for module in obj.modules():
                get_state = getattr(module, "_get_fsdp_state", None)
                param_group = get_state()._fsdp_param_group if get_state else None
                if param_group is None:
                    continue
                for info in (param_group.mesh_info,
                             getattr(param_group, "post_forward_mesh_info", None)):
                    if info is not None and hasattr(info, "shard_process_group"):
                        info.shard_process_group = group


def side_group(host: str, port: int, gen: int, rank: int, world_size: int, timeout_s: float):
    """A second gloo group over generation `gen`'s members, for the replica exchange thread
    (redundancy.py): one group's calls must not run from two threads at once.

    Built in that thread on its own store connection, under its own prefix, and never registered
    with torch.distributed, so FSDP and the training group know nothing of it. Tearing down the
    training group shuts its sockets too (release.py severs every peer connection)."""
    store = membership.connect(host, port)
    return dist.ProcessGroupGloo(dist.PrefixStore(f"replicas/{gen}", store), rank, world_size,
                                 timedelta(seconds=timeout_s))


def reshard_all(modules) -> None:
    """A step cut short leaves FSDP mid-iteration: parameters gathered, and the forward order of
    the interrupted pass still recorded, by which the redo's backward would prefetch (a survivor
    would then all-gather where a fresh replacement reduce-scatters, and both wait forever).
    The root's iteration state is reset as torch resets it after an exception in a step
    (FSDPState._reset_iter_state, torch 2.13); without it, every module is resharded.

    Neither drops the gradients that autograd already accumulated into the unsharded parameters
    of blocks whose backward ran but whose reduce-scatter the failure cut short (nor their
    reduce-dtype accumulators): the redo's backward would add to them, and the step would end
    with a gradient the failure-free run never had (seen: the redone step's loss equal, its
    grad_norm not). They are dropped here, for every sharded parameter."""
    for obj in modules:
        for module in obj.modules():
            get_state = getattr(module, "_get_fsdp_state", None)
            if get_state is None:
                continue
            state = get_state()
            _drop_unsharded_grads(state)
            if getattr(state, "_is_root", None) and hasattr(state, "_reset_iter_state"):
                try:
                    state._reset_iter_state()
                    continue
                except Exception:  # noqa: BLE001  an older layout: resharding is what is left
                    pass
            if hasattr(module, "reshard"):
                module.reshard()


def _drop_unsharded_grads(state) -> None:
    """Forget the gradients an interrupted backward left on one FSDP state's parameters."""
    group = getattr(state, "_fsdp_param_group", None)
    for fsdp_param in getattr(group, "fsdp_params", None) or []:
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is not None:
            unsharded.grad = None
        if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
            fsdp_param.unsharded_accumulated_grad = None


def is_dtensor(t) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def local_part(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t
