"""Checks of a loaded recipe that its types alone cannot express, run before any worker starts.

First the rules each key carries in launcher/recipe/schema.py (`one_of`, `ranged`, and that a number is
finite), then the rules that tie keys together, one function each. Every refusal is a
RecipeError saying `key=value: fix`.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from omegaconf import DictConfig

from checkpointless.protocol import FaultError, Layout, parse_fault

from launcher.recipe.derive import etcd_confirm_s
from launcher.recipe.rules import get, need
from launcher.recipe.schema import RecipeError, leaves
from launcher.recipe.validate_pipeline import check_pipeline
from launcher.recipe.validate_shrink import check_shrink

TRACKERS = ("tensorboard", "wandb", "mlflow", "comet_ml", "aim", "clearml", "dvclive", "swanlab",
            "trackio")  # accelerate.tracking.LOGGER_TYPE_TO_CLASS, without importing accelerate


def validate(cfg: DictConfig) -> None:
    """Refuse, naming the key, the value and the fix, what would fail once workers run."""
    check_fields(cfg)
    for rule in CROSS_FIELD:
        rule(cfg)


def check_fields(cfg: DictConfig) -> None:
    """Each key against its own field's rules in the schema, in the schema's order."""
    for key, f in leaves():
        v = get(cfg, key)
        if isinstance(v, float) and not math.isfinite(v):
            raise RecipeError(f"{key}={v!r}: must be a finite number")
        allowed = f.metadata.get("choices")
        if allowed and v not in allowed:
            raise RecipeError(f"{key}={v!r} is not allowed; choose one of {', '.join(allowed)} "
                              f"(e.g. {key}={allowed[0]})")
        ok, when = f.metadata.get("ok"), f.metadata.get("when", "")
        on_key, _, on_value = when.partition("=")
        if ok and (not when or get(cfg, on_key) == on_value):
            need(ok(v), key, v, f.metadata["fix"])


def check_precision(cfg: DictConfig) -> None:
    """fp16 runs on GPUs under ddp only: accelerate would silently train fp32 on a CPU."""
    t, d = cfg.trainer, cfg.distributed
    if t.precision != "fp16":
        return
    on_cpu = "distributed.device=cpu" if d.device == "cpu" else \
        "distributed.backend=gloo" if d.backend == "gloo" else None
    need(on_cpu is None, "trainer.precision", t.precision,
         f"fp16 needs a GPU (float16 autocast with a GradScaler) and this recipe runs on CPU "
         f"({on_cpu}); use trainer.precision=bf16 on CPU (or fp32)")
    need(d.strategy == "ddp", "trainer.precision", t.precision,
         "fp16 is supported under distributed.strategy=ddp only; under fsdp use "
         "trainer.precision=bf16")


def check_sources(cfg: DictConfig) -> None:
    """Weights, tokenizer and data that come from somewhere must say where."""
    m, tok, data = cfg.model, cfg.tokenizer, cfg.data
    if m.init == "pretrained":
        need(m.id, "model.id", m.id,
             "model.init=pretrained needs a hub id or local folder, e.g. model.id=gpt2")
    if tok.kind == "hub":
        need(tok.id or m.id, "tokenizer.id", tok.id,
             "tokenizer.kind=hub needs tokenizer.id (or model.id)")
    if data.source == "hub":
        need(data.id, "data.id", data.id, "data.source=hub needs a dataset id")
    if data.source == "files":
        need(len(data.files) > 0, "data.files", list(data.files),
             "data.source=files needs at least one file")


def check_nodes(cfg: DictConfig) -> None:
    """The world splits evenly over the nodes, this node is one of them, and several nodes
    meet at a fixed port and hear of a lost node before a failed collective gives up."""
    d, c = cfg.distributed, cfg.checkpointless
    nodes = d.num_nodes
    per = d.nproc_per_node or (d.num_processes // nodes)
    need(per * nodes == d.num_processes, "distributed.num_processes", d.num_processes,
         f"must equal distributed.num_nodes x distributed.nproc_per_node = {nodes} x {per} = "
         f"{nodes * per}; set one consistent pair (or leave num_processes to follow)")
    need(0 <= d.node_rank < nodes + c.spare_nodes, "distributed.node_rank", d.node_rank,
         f"must be in 0..{nodes + c.spare_nodes - 1} (0..{nodes - 1} active, then spare nodes)")
    if nodes > 1 or c.spare_nodes > 0 or d.standalone_coordinator:
        need(d.master_port > 0, "distributed.master_port", d.master_port,
             "several nodes need a fixed port for the coordinator, e.g. distributed.master_port="
             "29400, the same on every node")
        need(c.node_timeout_s < c.confirm_s, "checkpointless.node_timeout_s", c.node_timeout_s,
             f"must be below checkpointless.confirm_s={c.confirm_s:g}: survivors whose "
             "collectives failed with a lost node wait that long to hear of the loss")


def check_etcd(cfg: DictConfig) -> None:
    """coordinator=etcd: where etcd is, and survivors that wait out the role's move."""
    d, c = cfg.distributed, cfg.checkpointless
    if c.coordinator != "etcd":
        return
    e = c.etcd
    need(not d.standalone_coordinator, "distributed.standalone_coordinator",
         d.standalone_coordinator, "under checkpointless.coordinator=etcd any launcher "
         "coordinates (an election): run no stand-alone coordinator")
    need(d.master_port > 0, "distributed.master_port", d.master_port,
         "under checkpointless.coordinator=etcd the coordinator's store listens on this port "
         "on whichever node holds the role: set one, e.g. 29400, the same on every node")
    if not e.endpoints:
        total = d.num_nodes + c.spare_nodes
        need(total >= 3, "checkpointless.etcd.endpoints", e.endpoints,
             f"the embedded etcd runs one member on each of the first three nodes, and this job "
             f"has {total}: name an etcd cluster you run (host:port,...) or use three nodes")
        hosts = [h for h in e.member_hosts.split(",") if h.strip()]
        need(len(hosts) == 3 or (not hosts and os.environ.get("SLURM_JOB_NODELIST")),
             "checkpointless.etcd.member_hosts", e.member_hosts,
             "the embedded etcd needs the addresses of nodes 0, 1 and 2 (host,host,host), "
             "or Slurm's node list to read them from")
    need(c.confirm_s > c.node_timeout_s + e.ttl_s + 2, "checkpointless.confirm_s", c.confirm_s,
         f"must exceed node_timeout_s + etcd.ttl_s + 2 = {c.node_timeout_s + e.ttl_s + 2:g} "
         "under coordinator=etcd: a survivor whose collective failed with the coordinator's "
         "node waits this long for the next coordinator to record the loss. Fix: "
         f"checkpointless.confirm_s={etcd_confirm_s(c.node_timeout_s, e.ttl_s)}, or leave it "
         "unset and it is derived so")


def check_trackers(cfg: DictConfig) -> None:
    for i, name in enumerate(cfg.logging.trackers):
        need(name in TRACKERS, f"logging.trackers[{i}]", name,
             f"choose among accelerate's trackers: {', '.join(TRACKERS)}")


def check_eval(cfg: DictConfig) -> None:
    """Validation needs rows of its own, never the training ones."""
    ev, data = cfg.eval, cfg.data
    if ev.every > 0 and not ev.files:
        need(data.source != "files", "eval.files", list(ev.files),
             "validation of a data.source=files recipe needs its own files, e.g. "
             "eval.files=[val.jsonl] (or eval.every=0)")
        need(data.source != "hub" or ev.split, "eval.split", ev.split,
             f"validation of hub data needs a split of {data.id} other than the training "
             "one, e.g. eval.split=validation, or eval.files=[...] (or eval.every=0)")
    need(not (ev.split and data.source == "hub" and ev.split == data.split),
         "eval.split", ev.split, f"is the training split (data.split={data.split}): "
         "validating on training rows says nothing; name another split")


def check_peft(cfg: DictConfig) -> None:
    pf = cfg.peft
    if pf.method == "lora":
        need(len(pf.target_modules) > 0, "peft.target_modules", list(pf.target_modules),
             "name the modules to adapt, e.g. peft.target_modules=[q_proj,v_proj], or "
             "[all-linear]")
    need(not pf.merge or pf.method == "lora", "peft.merge", pf.merge,
         "only applies to peft.method=lora (a full fine-tune already exports the whole model)")


def check_faults(cfg: DictConfig) -> None:
    """Each fault strikes a rank and a step this run has; what a fault may be is
    checkpointless.protocol.faults' to say, worded here with the recipe's key. Faults with
    checkpointless.enabled=false are allowed: they rehearse what a failure costs without
    recovery (the run stops; durable checkpoints are what is left)."""
    world, steps = cfg.distributed.num_processes, cfg.trainer.max_steps
    for i, f in enumerate(cfg.faults):
        need(0 <= f.rank < world, f"faults[{i}].rank", f.rank,
             f"must be a rank in 0..{world - 1}")
        need(0 <= f.step < steps, f"faults[{i}].step", f.step,
             f"must be a step in 0..{steps - 1}")
        try:
            parse_fault(f)
        except FaultError as exc:
            raise RecipeError(f"faults[{i}].{exc.field}={exc.value!r}: {exc.fix}") from None


def check_audits(cfg: DictConfig) -> None:
    """Audits (checkpointless/worker/audit.py) are replayed by idle spares, judged against a
    witness rank, and a worker found wrong is undone by a rewind to a durable checkpoint; the
    replay must reproduce the rank's bits, which a GradScaler's scale or tensor-parallel
    shards would not give it."""
    every, key = cfg.checkpointless.audit.every, "checkpointless.audit.every"
    if every <= 0:
        return
    c, d = cfg.checkpointless, cfg.distributed
    need(c.enabled, key, every, "audits need recovery: set checkpointless.enabled=true, or "
         "checkpointless.audit.every=0")
    need(c.spares > 0 or c.spare_nodes > 0, key, every, "audits are replayed by idle spares: "
         "set checkpointless.spares=1 (or more), or checkpointless.audit.every=0")
    need(cfg.checkpoint.interval > 0, key, every, "a worker found computing wrong is undone by "
         "going back to a durable checkpoint known clean: set checkpoint.interval (e.g. 5)")
    need(d.num_processes >= 2, key, every, "an audit needs a witness rank: use "
         "distributed.num_processes=2 or more, or checkpointless.audit.every=0")
    need(d.tp_size == 1, key, every, "audits replay a whole rank's step; under "
         "distributed.tp_size>1 they are not supported yet: set checkpointless.audit.every=0")
    precision = cfg.trainer.precision
    need(precision != "fp16" and not (precision == "bf16" and d.strategy != "ddp"), key, every,
         f"with trainer.precision={precision} under {d.strategy} a spare's replay would not "
         "reproduce the rank's gradients bit for bit (a GradScaler's scale, FSDP's bf16 "
         "gather): use trainer.precision=fp32, bf16 under ddp, or checkpointless.audit.every=0")


def check_replication(cfg: DictConfig) -> None:
    """Each copy of a rank's state is held by another worker."""
    rep, n = cfg.checkpointless.replication, cfg.distributed.num_processes
    need(rep.factor <= max(1, n), "checkpointless.replication.factor", rep.factor,
         f"cannot exceed distributed.num_processes={n} (each copy is held by "
         f"another worker). Fix: set checkpointless.replication.factor={max(1, n)}"
         f"{' (no peer copies)' if n <= 1 else ''} or use more processes "
         f"(distributed.num_processes={rep.factor})")


def check_sharding(cfg: DictConfig) -> None:
    """hsdp's groups divide the world, and no one node holds every copy of a slice."""
    d = cfg.distributed
    if d.strategy != "hsdp":
        need(d.shard_size == 0, "distributed.shard_size", d.shard_size,
             f"applies under distributed.strategy=hsdp only (this recipe runs {d.strategy}). "
             "Fix: set distributed.strategy=hsdp, or drop distributed.shard_size")
        return
    n = d.num_processes
    need(d.shard_size <= n and n % d.shard_size == 0, "distributed.shard_size", d.shard_size,
         f"must divide distributed.num_processes={n} into whole replica groups. Fix: a divisor "
         f"of {n}, e.g. distributed.shard_size={max(1, n // max(1, d.num_nodes))} (one node's "
         "processes)")
    per_node = n // max(1, d.num_nodes)
    layout = Layout(n, d.shard_size, pp=d.pp_size)
    lost = layout.lost_with_a_node(per_node) if d.num_nodes > 1 and layout.groups >= 2 else []
    need(not lost, "distributed.shard_size", d.shard_size,
         f"puts every copy of shard position(s) {lost} on one node, so that node's loss "
         f"would take the slice from every replica group. Fix: distributed.shard_size="
         f"{per_node} (a shard group per node)")


def check_tensor_parallel(cfg: DictConfig) -> None:
    """tp groups divide the world and a node, and compose with a sharded strategy."""
    d = cfg.distributed
    tp, n = d.tp_size, d.num_processes
    if tp == 1:
        return
    need(d.strategy in ("fsdp", "hsdp"), "distributed.tp_size", tp,
         f"composes with distributed.strategy=fsdp or hsdp, not {d.strategy}: accelerate's "
         "ParallelismConfig has no pure data parallel x tp mesh (dp_replicate with dp_shard=1), "
         "and a replicated tp run holds every optimizer state twice. Fix: "
         "distributed.strategy=fsdp")
    need(n % tp == 0, "distributed.tp_size", tp,
         f"must divide distributed.num_processes={n} into whole tp groups. Fix: a divisor "
         f"of {n}, or distributed.num_processes={max(tp, n - n % tp)}")
    per_node = n // max(1, d.num_nodes)
    need(per_node % tp == 0, "distributed.tp_size", tp,
         f"would put a tp group across two nodes ({per_node} workers per node): its "
         "all-reduces run twice per layer, forward and backward, and belong on the node's "
         f"fast links. Fix: distributed.tp_size dividing {per_node}")
    if d.strategy == "hsdp":
        need(d.shard_size % tp == 0, "distributed.shard_size", d.shard_size,
             f"counts the workers of a replica group, tp ranks included, so it must be a "
             f"multiple of distributed.tp_size={tp}. Fix: distributed.shard_size="
             f"{max(tp, d.shard_size - d.shard_size % tp)}")
    need(cfg.peft.method == "none", "peft.method", cfg.peft.method,
         f"is not combined with distributed.tp_size={tp}: peft's adapters wrap the linear "
         "layers that tensor parallel splits. Fix: distributed.tp_size=1")


def check_folders(cfg: DictConfig) -> None:
    check_dir("run.output_dir", cfg.run.output_dir, f"runs/{cfg.run.name}")
    check_dir("data.cache_dir", cfg.data.cache_dir, ".cache/data")
    if cfg.checkpoint.interval > 0:
        check_dir("checkpoint.dir", cfg.checkpoint.dir, f"runs/{cfg.run.name}/checkpoints")


def check_dir(key: str, value: str, example: str) -> None:
    """`value` is a folder that exists or can be created, and written; nothing is created here."""
    fix = f"choose a folder you can write, e.g. {key}={example}"
    if not str(value).strip():
        raise RecipeError(f"{key}={value!r}: must name a folder; {fix}")
    target = Path(value).absolute()
    for existing in (target, *target.parents):
        if os.path.lexists(existing):
            break
    if not existing.exists():
        raise RecipeError(f"{key}={value!r}: {existing} is a broken symbolic link; remove it or "
                          f"{fix}")
    if not existing.is_dir():
        what = "names an existing file, not a folder" if existing == target else \
            f"cannot be created: {existing} is a file, not a folder"
        raise RecipeError(f"{key}={value!r} {what}; move the file away or {fix}")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is a folder you cannot write to" if existing == target else \
            f"cannot be created: {existing} is not writable (permission denied)"
        raise RecipeError(f"{key}={value!r} {what}; {fix}")


# in this order: the folders last, as they look at the disk
CROSS_FIELD = (check_precision, check_sources, check_nodes, check_etcd, check_trackers,
               check_eval, check_peft, check_faults, check_audits, check_replication,
               check_pipeline, check_shrink, check_sharding,
               check_tensor_parallel, check_folders)
