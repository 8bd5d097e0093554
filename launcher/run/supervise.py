"""What the supervisor is told, from the recipe: its configuration (SupervisorConfig), the node
checks, and the bounds of a shrink (from the memory plan on a device)."""
from __future__ import annotations

from omegaconf import OmegaConf

from checkpointless.control import SupervisorConfig
from checkpointless.protocol import replica_offset

from launcher.parallel.mesh import parallelism_of
from launcher.recipe.load import RecipeError
from launcher.recipe.schema import SHARDED


def health_settings(cfg) -> dict:
    """The node checks (checkpointless/worker/health.py), their disk where checkpoints go."""
    h = OmegaConf.to_container(cfg.checkpointless.health)
    h["disk_path"] = str(cfg.checkpoint.dir if cfg.checkpoint.interval else cfg.run.output_dir)
    if cfg.distributed.device == "cpu":
        h["gpu"] = False  # said once, as the launcher starts
    return h


def check_node_health(cfg) -> None:
    """As a launcher starts: its node is checked; an unhealthy one is refused with its reasons."""
    from checkpointless.worker import health
    problems, notes = health.check(health_settings(cfg))
    if cfg.checkpointless.health.gpu and cfg.distributed.device == "cpu":
        notes.append("health: a CPU run: the GPU checks (ECC, XID, throttling, device memory) "
                     "are skipped")
    for n in notes:
        print(f"[launcher] {n}", flush=True)
    if problems:
        raise RecipeError(f"node {cfg.distributed.node_rank} is unhealthy: " +
                          "; ".join(problems) + ". Fix the node (or the checkpointless.health.* "
                          "settings) and launch again")


def shrink_max_hosted(cfg) -> int:
    """checkpointless.shrink_max_hosted, or where unset on a device, what the memory plan leaves
    room for (plan/fit.py: max_hosted); 0 (no limit) on CPU, where the plan is not made."""
    c, d = cfg.checkpointless, cfg.distributed
    if c.shrink_max_hosted or c.shrink == "off" or d.device == "cpu":
        return c.shrink_max_hosted
    from launcher.plan.fit import check_fits, max_hosted
    return max_hosted(check_fits(cfg))


def shrink_min_processes(cfg) -> int:
    """The fewest processes a shrink may leave: 1 under ddp; under fsdp and hsdp 2 (one
    process would not reduce-scatter: fsdp_logical.py), and on a device what the memory plan
    leaves room for, each of fewer processes holding a larger chunk (plan/fit.py)."""
    c, d = cfg.checkpointless, cfg.distributed
    if d.strategy not in SHARDED:
        return 1
    if c.shrink == "off" or d.device == "cpu":
        return 2
    from launcher.plan.fit import min_shrunk_processes
    return max(2, min_shrunk_processes(cfg))


def supervisor_config(cfg) -> SupervisorConfig:
    d, c = cfg.distributed, cfg.checkpointless
    backend = d.backend
    if backend == "auto":
        import torch
        backend = "nccl" if d.device != "cpu" and torch.cuda.is_available() else "gloo"
    par = parallelism_of(d)
    placement = c.replication.placement
    if placement == "auto":  # across nodes, copies a node apart: a lost node keeps no slice
        placement = "nodes" if d.num_nodes > 1 else "ring"
    if placement == "nodes" and d.num_nodes == 1:
        # every worker of this run lives on this machine: copies a node apart cannot exist
        raise RecipeError("checkpointless.replication.placement=nodes puts each shard's copies "
                          "on another node, but this run has one node (all "
                          f"{d.num_processes} workers here). Use placement=ring")
    groups = d.num_processes // d.shard_size if d.strategy == "hsdp" else 1
    if placement == "nodes" and d.strategy in SHARDED and groups < 2 and c.enabled and not \
            2 <= c.replication.factor <= d.num_nodes:
        raise RecipeError(
            f"checkpointless.replication.factor={c.replication.factor} with placement=nodes on "
            f"{d.num_nodes} nodes cannot survive the loss of a node: a slice needs at least one "
            f"copy on another node (factor >= 2) and its copies on distinct nodes (factor <= "
            f"{d.num_nodes}). Use checkpointless.replication.factor=2")
    # every knob of the recipe's checkpointless section under its own name; the rest here
    return SupervisorConfig.of(
        c, nproc=d.num_processes, spares=c.spares if c.enabled else 0, backend=backend,
        host=d.master_addr, port=d.master_port, seed=cfg.run.seed, nodes=d.num_nodes,
        standalone=d.standalone_coordinator,
        replication={"factor": max(1, c.replication.factor),
                     "interval": c.replication.interval,
                     "offset": replica_offset(placement, par.per_node)},
        shard_size=par.replica_group_size,
        tp_size=d.tp_size, pp_size=d.pp_size,
        straggler_factor=c.straggler.factor, straggler_window=c.straggler.window,
        audit_every=c.audit.every if c.enabled else 0,
        replay_check=c.replay_check if c.enabled else "off",
        shrink_max_hosted=shrink_max_hosted(cfg),
        shrink_min_processes=shrink_min_processes(cfg),
        health=health_settings(cfg),
        tokens_per_step=cfg.trainer.micro_batch_size * cfg.trainer.grad_accum_steps *
        cfg.data.seq_len * par.data_world,
        straggler_action=c.straggler.action if c.enabled else "report",
        faults=[dict(f) for f in OmegaConf.to_container(cfg.faults)])
