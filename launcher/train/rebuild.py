"""A model sharded anew when an fsdp job shrinks or grows (checkpointless.shrink=exact).

FSDP2 cuts every parameter into one chunk per process; a shrink from 4 processes to 3 needs a
model, an optimizer and durable checkpoints built for 3. The library calls `rebuild` in the
middle of its restore (checkpointless/worker/reshard.py), after every member received the old
slices and before it loads its new chunk: what is built here is filled from them, so nothing is
initialized (the shards are allocated only).
"""
from __future__ import annotations


def rebuild(run) -> None:
    """Build the model, optimizer and checkpoints for this generation's processes, protect them,
    and put them in `run` for the steps that follow."""
    from checkpointless.worker import LogicalFSDP

    from launcher.train.checkpoints import DurableCheckpoints
    from launcher.train.optim import build_optimizer
    from launcher.train.model_setup import model_for, shard
    cfg, job, accelerator = run.cfg, run.job, run.accelerator
    model = model_for(cfg, run.tokenizer, accelerator.device, sharded=True)
    shard(model, cfg, _fresh_mesh(job), receives_state=True)
    optimizer = build_optimizer(model, cfg)
    old = getattr(accelerator, "_optimizers", None)
    if old is not None and run.opt in old:  # accelerate would keep the old one alive
        old.remove(run.opt)
    opt = accelerator.prepare_optimizer(optimizer)
    scaler = {"grad_scaler": accelerator.scaler} if accelerator.scaler is not None else {}
    job.protect(model=model, optimizer=optimizer, send_frozen=cfg.peft.method == "none",
                **scaler)
    ckpt = None
    if cfg.checkpoint.interval > 0:
        ckpt = DurableCheckpoints(cfg, job, model, optimizer, accelerator.scaler)
        if run.ckpt:  # its writer: a write in flight goes on, as in any recovery
            ckpt.writer = run.ckpt.writer
        job.set_fallback(ckpt.newest_step, ckpt.load_step, ckpt.drop_after)
    run.model = run.wrapped = model
    run.optimizer, run.opt, run.ckpt = optimizer, opt, ckpt
    run.logical_fsdp = LogicalFSDP(model, job.logical_world)


def _fresh_mesh(job):
    """The default group's mesh, named for this generation. DeviceMesh compares equal to any
    mesh of the same ranks (whatever this process's rank was then), and DTensor's sharding
    cache hands back a spec built on an equal one: after a shrink and a grow back to 4, a
    survivor renumbered from 3 to 2 got the launch's mesh again, with its old coordinate (seen:
    its checkpoint wrote the chunk of rank 3). A name no earlier mesh had rules that out."""
    from torch.distributed.device_mesh import DeviceMesh
    import torch.distributed as dist
    # under hsdp, while the processes form replica groups: the shard group's (logical_step.py)
    group = job.mesh_group("dp_shard") or dist.group.WORLD
    return DeviceMesh.from_group(group, job.device_mesh().device_type,
                                 mesh_dim_names=(f"dp_shard_gen{job.gen}",))
