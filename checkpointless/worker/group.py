"""The process group of one generation: built on the store, torn down, aborted, and handed to FSDP.

Each generation gets a fresh group on its own store prefix. Before it is built, the members meet
at a barrier on the store, so a member that died after the plan was published cannot block the
others inside the group's constructor. Tearing a group down must release any peer still blocked
on it: gloo's abort does not, so a leaving worker also shuts its group's sockets
(sockets.sever_peer_connections). A Watch thread (watch.py) aborts the group the moment a newer
plan is published, and cuts a group still forming (its rendezvous has a store connection of its
own).
"""
from __future__ import annotations

import sys
from datetime import timedelta

import torch.distributed as dist

from ..protocol import membership
from .. import protocol
from . import mesh as meshes
from . import sockets
from .failures import communicating
from .watch import Watch  # noqa: F401  (the thread that follows the generations: watch.py)


class Group:
    """Owns this worker's process group: forming one per plan, tearing it down, aborting it, and
    keeping FSDP2 modules pointed at the live one."""

    def __init__(self, store, node_store, backend: str, pg_timeout_s: float, store_ports,
                 modules, shard_size: int = 0, tp_size: int = 1, connect=None,
                 pp_size: int = 1):
        self.store, self.node_store = store, node_store
        # () -> a new connection to the job's store, for one generation's rendezvous (None: the
        # shared one, which nothing may cut)
        self.connect = connect
        self._rendezvous_fd: int | None = None  # that connection's socket, while it forms
        self.backend = backend
        self.pg_timeout_s = pg_timeout_s
        self.store_ports = set(store_ports)  # connections to the stores: never severed
        self.modules = modules  # () -> the protected nn.Modules, for FSDP's cached group handles
        self.shard_size = shard_size  # HSDP: ranks per replica group (0: none, see mesh.py)
        self.tp_size = tp_size  # ranks per tensor-parallel group (1: none)
        self.pp_size = pp_size  # pipeline stages (1: none)
        self.layout: meshes.Layout | None = None
        self.subgroups: dict | None = None  # {dimension: group} of this generation (mesh.py)

    def form(self, plan: membership.Seat, after_barrier=lambda: None) -> bool:
        """Build generation `plan.gen`'s group; False when a newer plan replaced it meanwhile.
        `after_barrier()` runs once every member met, just before the group's rendezvous (faults
        @join strike there; it raises when a newer plan came meanwhile)."""
        self.teardown()
        rank = plan.rank
        if not membership.barrier(self.store, self.node_store, plan):
            return False
        meeting = self._rendezvous_store()
        after_barrier()  # after the connection exists: a newer plan seen later cuts it
        hook = sys.excepthook
        try:
            with communicating(f"forming the process group of generation {plan.gen}"):
                dist.init_process_group(
                    self.backend, store=dist.PrefixStore(protocol.group_prefix(plan.gen),
                                                         meeting),
                    rank=rank, world_size=plan.world_size,
                    timeout=timedelta(seconds=self.pg_timeout_s))
        except BaseException:
            _forget_failed_init()
            raise
        # torch wraps the excepthook at every init_process_group to prefix "[rankN]: ": one
        # wrapper more per generation. The job's own hook (failures.report_uncaught) stays.
        sys.excepthook = hook
        self.subgroups = None
        stage_world = plan.world_size // self.pp_size
        hsdp = meshes.has_replica_groups(stage_world, self.shard_size)
        if hsdp or self.tp_size > 1 or self.pp_size > 1:
            self.layout = meshes.Layout(plan.world_size, self.shard_size if hsdp
                                        else stage_world, self.tp_size, self.pp_size)
            with communicating(f"forming the mesh's groups of generation {plan.gen}"):
                self.subgroups = meshes.build(self.layout, rank)
        self._rendezvous_fd = None  # formed: from here a newer plan aborts the group itself
        self.rebind_sharded_modules(dist.group.WORLD)
        got = dist.get_world_size()
        if got != plan.world_size:
            raise RuntimeError(f"process group has world size {got}, the plan asked for "
                               f"{plan.world_size}")
        return True

    def _rendezvous_store(self):
        """The store this generation's group meets on: a connection of its own, whose socket
        `cut_rendezvous` can shut. A member lost after the barrier and before it wrote its
        address would otherwise keep the others waiting in the group's constructor for
        pg_timeout_s (seen: 60 s, then a lost run), where no abort reaches."""
        self._rendezvous_fd = None
        if self.connect is None:
            return self.store
        for _ in range(_CONNECT_TRIES):
            before = sockets.to_ports(self.store_ports)
            store = self.connect()
            new = [fd for inode, fd in sockets.to_ports(self.store_ports).items()
                   if inode not in before]
            if len(new) == 1:  # else another thread connected at the same moment: again
                self._rendezvous_fd = new[0]
                return store
            del store  # closes it
        return self.store  # which nothing cuts: a member lost here costs pg_timeout_s

    def cut_rendezvous(self) -> bool:
        """From the watch thread, a newer plan published while this group forms: shut its
        rendezvous connection, so that a wait for a member that is gone fails now."""
        return self._rendezvous_fd is not None and sockets.shut(self._rendezvous_fd)

    def teardown(self) -> None:
        # Drop FSDP's handles on the old group first: while anything references it, its
        # sockets stay open and a peer blocked on us would wait for the timeout.
        self.rebind_sharded_modules(None)
        self.subgroups = None
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
            sockets.sever_peer_connections(self.store_ports)

    @staticmethod
    def abort() -> None:
        """Make every call blocked on the current group return with an error (NCCL honours this;
        for gloo the sockets are shut as well, in teardown)."""
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:
            pass

    def device_mesh(self):
        """The job's mesh, on the backend's device (nccl: the GPU, else the CPU): the default
        group itself, or the mesh of this generation's subgroups (dp_replicate under HSDP,
        dp_shard, tp under tensor parallel: mesh.py)."""
        from torch.distributed.device_mesh import DeviceMesh
        device_type = "cuda" if self.backend == "nccl" else "cpu"
        if self.subgroups is not None:
            return meshes.device_mesh(self.layout, self.subgroups, device_type)
        return DeviceMesh.from_group(dist.group.WORLD, device_type)

    def rebind_sharded_modules(self, group) -> None:
        """Point FSDP2 modules at `group` (the new default group, or None to drop the old one).

        FSDP keeps the group object it was built with; after a regroup that object is dead. The new
        default group gets the old one's name, so DTensor's mesh resolves to it; only FSDP's cached
        handles need replacing, no parameter moves. With subgroups (HSDP, tensor parallel) the
        shard and replicate handles take this generation's, which have the old ones' names too.
        """
        shard = replicate = group
        if group is not None and self.subgroups is not None:
            replicate = self.subgroups.get("dp_replicate")
            shard = self.subgroups["dp_shard"]
        for obj in self.modules():
            for module in obj.modules():
                get_state = getattr(module, "_get_fsdp_state", None)
                param_group = get_state()._fsdp_param_group if get_state else None
                if param_group is None:
                    continue
                for info in (param_group.mesh_info,
                             getattr(param_group, "post_forward_mesh_info", None)):
                    if info is None:
                        continue
                    if hasattr(info, "shard_process_group"):
                        info.shard_process_group = shard
                    if hasattr(info, "replicate_process_group"):
                        info.replicate_process_group = replicate


# connections opened to find the rendezvous' own one, when other threads open theirs meanwhile
_CONNECT_TRIES = 5


def _forget_failed_init() -> None:
    """A constructor that failed still counted a group: torch names the next default group by
    that count, and its rendezvous keys with the name, so the next generation's survivors
    would meet under "1" where a fresh spare meets under "0" and wait for each other until the
    timeout (seen: two members lost 0.15 s apart, a 60 s stall, then a lost run). A
    destroyed default group resets the count; a failed one must too."""
    if not dist.is_initialized():
        dist.distributed_c10d._world.group_count = 0


def side_group(host: str, port: int, gen: int, rank: int, world_size: int, timeout_s: float):
    """A second gloo group over generation `gen`'s members, for the replica exchange thread
    (redundancy.py): one group's calls must not run from two threads at once.

    Built in that thread on its own store connection, under its own prefix, and never registered
    with torch.distributed, so FSDP and the training group know nothing of it. Tearing down the
    training group shuts its sockets too (sockets.sever_peer_connections shuts every peer
    connection)."""
    store = membership.connect(host, port)
    return dist.ProcessGroupGloo(dist.PrefixStore(protocol.replicas_prefix(gen), store), rank,
                                 world_size, timedelta(seconds=timeout_s))


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
