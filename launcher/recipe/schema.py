"""The recipe schema: every key a recipe may set, its type, its default, what it means and,
for the keys that have one, the values it may take.

A recipe is YAML merged onto these dataclasses; a key that is not here is refused with a
suggestion, a value of the wrong type names the key and the type expected. `one_of` and `ranged`
put a key's allowed values in its field's metadata, where launcher/recipe/validate.py reads them: the
rule sits on the line that declares the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Dict, List, Optional

from checkpointless.protocol import Fault
from checkpointless.protocol import DEFAULTS as CL


class RecipeError(ValueError):
    """A recipe that cannot run; the text names the key, the value and the fix."""


SHARDED = ("fsdp", "hsdp")  # strategies under which FSDP2 shards parameters and optimizer


def one_of(*allowed: str):
    """A string key that takes one of `allowed`; the first is its default."""
    return field(default=allowed[0], metadata={"choices": allowed})


def _rule(rule: str):
    """'>= 1', '> 0', '[0, 1)' or '[0, 1]' as a test of a number."""
    if rule.startswith("["):
        low, high = (float(x) for x in rule[1:-1].split(","))
        closed = rule.endswith("]")
        return lambda v: low <= v and (v <= high if closed else v < high)
    op, text = rule.split()
    bound = float(text)
    return {">=": lambda v: v >= bound, ">": lambda v: v > bound}[op]


def ranged(default, rule: str, say: str = "", *, fix: str = "", when: str = ""):
    """A number key refused outside `rule` (see _rule) with 'must be RULE' and `say` (units, what
    0 means, an example), or with `fix` in their place; `when='key=value'`: checked only then."""
    fix = fix or f"must be {'in ' if rule.startswith('[') else ''}{rule}{say}"
    return field(default=default, metadata={"ok": _rule(rule), "fix": fix, "when": when})


@dataclass
class RunConfig:
    name: str = "run"  # name of the run, used in the default output folder
    output_dir: str = "runs/${run.name}"  # where the resolved recipe, metrics, model and report go
    seed: int = 0  # seeds model init, data order, dropout (per step and rank)


@dataclass
class ModelConfig:
    name: str = "llama"  # registry name (llama, gpt2, gpt-oss) or any transformers model_type
    id: Optional[str] = None  # Hugging Face hub id or local folder for the config / weights
    init: str = one_of("random", "pretrained")  # random: built from the config; pretrained: weights loaded from `id`
    config: Dict[str, Any] = field(default_factory=dict)  # overrides of the transformers config
    gradient_checkpointing: bool = False  # recompute each decoder block's activations in backward to save memory (per block; under fsdp inside the block's unit)
    size: str = ""  # parameter count for people (shown by `launcher ls`), e.g. 8B


@dataclass
class TokenizerConfig:
    kind: str = one_of("byte", "hub")  # byte: built-in byte-level tokenizer (no download); hub: load `id`
    id: Optional[str] = None  # hub id or local folder when kind=hub (defaults to model.id)
    chat_template: str = one_of("own", "simple")  # data.format=chat: own (the tokenizer's template) or simple (the project's role-tagged one, for tokenizers without a template)


@dataclass
class DataConfig:
    source: str = one_of("synthetic", "hub", "files")  # synthetic (generated offline), hub (datasets hub id) or files
    id: Optional[str] = None  # hub dataset id when source=hub
    subset: Optional[str] = None  # hub dataset configuration name, if it has several
    revision: Optional[str] = None  # hub dataset commit, tag or branch (source=hub); part of the token cache's key. Unpinned, the cache keeps the rows of its first download
    split: str = "train"  # dataset split to train on
    files: List[str] = field(default_factory=list)  # json/jsonl/txt/parquet files for source=files
    text_field: str = "text"  # column holding the text (format=text)
    format: str = one_of("text", "chat", "instruction")  # text (raw text, packed), chat (a list of {role, content} messages per example) or instruction (prompt and response fields)
    messages_field: str = "messages"  # column holding the messages (format=chat)
    prompt_field: str = "prompt"  # column holding the prompt (format=instruction)
    response_field: str = "response"  # column holding the response (format=instruction)
    train_on_prompt: bool = False  # chat/instruction: also train on prompt and user tokens (default: only the responses count in the loss)
    packing: bool = True  # chat/instruction: pack examples into seq_len rows (positions restart and attention stays inside each example), or false: one example per row, padded
    seq_len: int = ranged(256, ">= 8")  # tokens per packed training sequence
    max_docs: Optional[int] = None  # use only the first N documents (quick trials)
    synthetic_docs: int = 4000  # documents generated when source=synthetic
    cache_dir: str = ".cache/data"  # tokenized, packed Arrow cache (memory-mapped on load); on a filesystem all nodes share, one node builds it and the others wait and map it
    num_proc: int = ranged(0, ">= 0", " processes (0: all of this node's cores, e.g. data.num_proc=0)")  # processes that download, convert and tokenize the data, once per node in the launcher before workers start (0: all of this node's cores); the rows do not depend on it


@dataclass
class OptimConfig:
    lr: float = ranged(3e-4, "> 0", ", e.g. optim.lr=3e-4")  # peak learning rate of AdamW
    weight_decay: float = ranged(0.1, ">= 0")  # decoupled weight decay on matrices (not on norms and biases)
    beta1: float = ranged(0.9, "[0, 1)", ", e.g. 0.9")  # AdamW first-moment decay
    beta2: float = ranged(0.95, "[0, 1)", ", e.g. 0.95")  # AdamW second-moment decay
    eps: float = ranged(1e-8, "> 0", ", e.g. 1e-8")  # AdamW epsilon
    warmup_steps: int = ranged(100, ">= 0")  # linear warm-up from 0 to lr
    min_lr_ratio: float = ranged(0.1, "[0, 1]")  # cosine decays to lr * min_lr_ratio at max_steps
    grad_clip: float = ranged(1.0, ">= 0", " (0 disables clipping)")  # clip the global gradient norm to this (0 disables)


@dataclass
class TrainerConfig:
    max_steps: int = ranged(1000, ">= 1", fix="must be at least 1")  # optimizer steps to train
    micro_batch_size: int = ranged(4, ">= 1")  # sequences per forward pass on each worker
    grad_accum_steps: int = ranged(1, ">= 1")  # micro-batches per optimizer step on each worker
    precision: str = one_of("fp32", "bf16", "fp16")  # fp32; bf16 (under fsdp FSDP2's MixedPrecisionPolicy: bf16 compute, fp32 reduce, fp32 master parameters and AdamW; under ddp autocast over the config's dtype); or fp16 (GPU and ddp only: autocast with a GradScaler, which a replacement receives with the model)
    log_every: int = ranged(10, ">= 1")  # steps between metric lines
    progress_bar: bool = True  # show a progress bar with loss and tokens/s on rank 0
    save_model: bool = True  # write the final model with save_pretrained


@dataclass
class DistributedConfig:
    num_processes: int = ranged(2, ">= 1")  # active workers (world size); one per GPU on GPUs
    strategy: str = one_of("ddp", "fsdp", "hsdp")  # ddp: full replica per worker; fsdp: parameters and optimizer sharded over all workers; hsdp: sharded within groups of distributed.shard_size workers, each group a whole replica (the groups are each other's copies)
    shard_size: int = ranged(0, ">= 0", " (0: one node's processes)")  # hsdp: workers per shard group (0: one node's processes); num_processes / shard_size replica groups
    tp_size: int = ranged(1, ">= 1", " (1: no tensor parallel)")  # tensor parallel: workers per tp group, consecutive ranks inside a node, that split each layer's attention heads and MLP columns (the model's own plan); with fsdp (mesh dp_shard x tp) or hsdp (dp_replicate x dp_shard x tp, shard_size counting the tp ranks)
    pp_size: int = ranged(1, ">= 1", " (1: no pipeline)")  # pipeline parallel: stages, each num_processes / pp_size consecutive workers (whole nodes: stages span nodes), each holding a run of decoder layers (the model's own pp plan); with ddp, fsdp, hsdp and tp inside each stage
    pp_schedule: str = one_of("1f1b", "gpipe", "interleaved-1f1b")  # pp: torch.distributed.pipelining's schedule: 1f1b (one forward one backward, least activation memory), gpipe (all forwards then all backwards), interleaved-1f1b (two stages per worker, a smaller bubble)
    pp_microbatches: int = ranged(0, ">= 0", " (0: pp_size x trainer.grad_accum_steps)")  # pp: pipeline microbatches per step; a pipeline trains the rows of its pp_size workers (pp_size x grad_accum_steps x micro_batch_size, so the batch is the recipe's with or without pp), split into this many (0: one per micro-batch)
    pp_layers: Optional[List[int]] = None  # pp: decoder layers per stage, first to last (interleaved-1f1b: per virtual stage, 2 x pp_size entries), summing to the model's layers; unset: chosen by parameter count (the embedding counts with the first stage, the head with the last) and printed
    backend: str = one_of("auto", "gloo", "nccl")  # auto (nccl with GPUs, else gloo), gloo or nccl
    device: str = one_of("auto", "cuda", "cpu")  # what the recipe is sized for: cuda (refused on a machine without enough GPUs), cpu, or auto (cuda when present)
    device_memory_gb: float = 0.0  # memory of one device, GB (0: the real device's when there is one, else 80)
    host_memory_gb: float = 0.0  # host memory of one node, GB, against which the plan checks the peer replicas and snapshots of its ranks (0: this machine's when it has GPUs, else not compared)
    master_addr: str = "127.0.0.1"  # address the coordination store listens on
    master_port: int = ranged(0, "[0, 65535]", fix="0..65535")  # port of the coordination store (0: any free port)
    threads_per_worker: int = ranged(0, ">= 0", " (0 picks cores / processes)")  # torch CPU threads per worker (0: cores / processes)
    bucket_cap_mb: float = ranged(25.0, "> 0", " MB")  # ddp: gradient bucket size; a bucket's all-reduce starts as soon as it is full
    grad_sync: str = one_of("buckets", "flat")  # ddp with checkpointless.shrink=fast or off: buckets (all-reduces overlapped with backward) or flat (one after backward); under shrink=exact (the ddp default) the reduction is by logical rank after backward
    num_nodes: int = ranged(1, ">= 1")  # active nodes; run the same command on each, with its own node_rank
    nproc_per_node: int = 0  # workers per node (0: num_processes / num_nodes); num_processes must equal num_nodes x nproc_per_node
    node_rank: int = 0  # this node: 0 hosts the coordinator, 1..num_nodes-1 active, num_nodes.. spare nodes
    standalone_coordinator: bool = False  # true: `python -m launcher coordinator` runs the coordinator (on a login node); node 0 is served by an agent like the others
    accelerate_config: Optional[str] = None  # an accelerate config file: num_machines, machine_rank, main_process_ip/port, num_processes fill the keys above


@dataclass
class ReplicationConfig:
    factor: Optional[int] = ranged(None, ">= 0", " (0 or 1: no peer copies; 2: one copy in a peer's memory)")  # copies of each rank's slice in host memory (own + peers); unset: 2 under fsdp, 0 under hsdp with two or more replica groups (the groups are the copies)
    interval: int = ranged(CL.replication_interval, ">= 1")  # steps between peer copies (fewer: less to redo)
    placement: str = one_of("auto", "ring", "nodes")  # auto (ring on one node, nodes on several), ring: next ranks, nodes: the same local rank on the next nodes


@dataclass
class StragglerConfig:
    action: str = one_of("evict", "report", "off")  # evict: a ready spare takes a straggler's rank (only reported while none is ready); report: say it only; off: do not judge
    factor: float = ranged(CL.straggler_factor, "> 1", " (a rank this many times slower than its peers' median is slow)")  # own time per step above this times the peers' median is slow
    window: int = ranged(CL.straggler_window, ">= 1", " steps")  # consecutive slow steps before a rank is a straggler


@dataclass
class AuditConfig:
    every: int = ranged(CL.audit_every, ">= 0", " steps (0: no audits)")  # every N steps an idle ready spare replays one sampled rank's step (ranks in turn) and compares its gradient digest: a worker computing wrong is evicted and the job rewinds to a durable checkpoint known clean (needs checkpoint.interval); 0: off


@dataclass
class HealthConfig:
    command: Optional[str] = None  # a script run on each node as a launcher starts and in each spare before it takes a rank; a non-zero exit is an unhealthy node (its last output line says why)
    timeout_s: float = ranged(30.0, "> 0", " seconds")  # longest the command may run
    every_s: float = ranged(10.0, "> 0", " seconds")  # how often a waiting spare checks its node again
    min_free_memory_gb: float = ranged(0.0, ">= 0", " GB (0: not checked)")  # host memory available (MemAvailable) below which a node is unhealthy
    min_free_disk_gb: float = ranged(0.0, ">= 0", " GB (0: not checked)")  # free disk, where checkpoints (or the run's output) go, below which a node is unhealthy
    gpu: bool = True  # on GPU nodes, NVML's checks (nvidia-ml-py): uncorrected ECC errors, XID errors, hardware or thermal throttling; skipped on CPU
    min_free_device_memory_gb: float = ranged(0.0, ">= 0", " GB (0: not checked)")  # free device memory below which a GPU node is unhealthy


@dataclass
class EtcdConfig:
    endpoints: str = ""  # an etcd cluster you run, host:port,host:port (empty: the embedded default, one member in each of the first three nodes' launchers)
    member_hosts: str = ""  # embedded: the addresses of nodes 0, 1 and 2, where their members listen (empty: the first three hosts of Slurm's node list)
    node_addr: str = ""  # this node's address, where its store listens if it coordinates (empty: the one it reaches etcd from)
    client_port: int = ranged(2379, "[1, 65535]", fix="1..65535")  # embedded members: the clients' port
    peer_port: int = ranged(2380, "[1, 65535]", fix="1..65535")  # embedded members: the peers' port
    ttl_s: int = ranged(3, ">= 2", " seconds")  # the coordinator's lease: the role moves within this after its holder is lost
    prefix: str = ""  # the job's keys in etcd (empty: /checkpointless/<run.name>)


@dataclass
class CheckpointlessConfig:
    enabled: bool = True  # recover in-process from worker failures (off: a failure stops the run)
    spares: int = ranged(CL.spares, ">= 0")  # warm spare workers waiting to take over a failed rank
    refill: bool = CL.refill  # start a new spare in the background after one is used
    heartbeat_timeout_s: float = ranged(CL.heartbeat_timeout_s, "> 0", " seconds")  # loop silence before a lagging worker is hung
    pg_timeout_s: float = ranged(CL.pg_timeout_s, "> 0", " seconds")  # last-resort timeout of collectives (hangs caught sooner)
    spare_wait_s: float = ranged(CL.spare_wait_s, "> 0", " seconds")  # how long to wait for a spare to warm up before giving up
    startup_timeout_s: float = ranged(CL.startup_timeout_s, "> 0", " seconds")  # a first-generation worker silent this long after its launch (imports, model build or load, first group) is hung and replaced by a spare; refused when below what the model's load needs here
    confirm_s: float = ranged(CL.confirm_s, ">= 0", " seconds")  # how long a failed collective waits for a peer's loss to be confirmed
    consistency_every: int = ranged(CL.consistency_every, ">= 0", " steps (0 checks only at the end)")  # steps between checks that replicas hold the same parameters (0: end only)
    max_replacement_failures: int = ranged(CL.max_replacement_failures, ">= 1")  # replacements dying before a first step, in a row, before the run stops
    shrink: str = one_of("auto", "exact", "fast", "off")  # with no spare ready for a lost rank: exact (a survivor hosts its logical rank; every reduction sums the logical ranks in one fixed order, the failure-free run's too, so a shrunk run ends with its bits; ddp, fsdp and hsdp), fast (the same with today's collectives: the bits may differ after a shrink; ddp), off (wait spare_wait_s for a spare, then stop); auto: exact under ddp, and under fsdp and hsdp with 3 or more processes, full training, not fp16; else off. The job grows back at a step boundary when a spare is ready (docs/shrink.md)
    replay_check: str = one_of("warn", "strict", "off")  # the replay rehearsal: the launch's second step is run twice from the same state and compared bit for bit (the parameters read, the output, the gradients, the state after the update), the proof that a recovery's redo gives the failure-free bits; warn: a difference is said (log, report.json's replay, metrics) and training goes on; strict: the run stops; off: not checked (README "A step must be replayable")
    shrink_max_hosted: int = ranged(0, ">= 0", " (0: derived)")  # the most logical ranks one process may host after a shrink (each keeps one more fp32 copy of the gradients); 0: on a device, what the memory plan leaves free; on cpu, no limit
    spare_nodes: int = ranged(0, ">= 0")  # extra nodes whose launchers start nproc_per_node warm spares each: a lost node's ranks move to one of them together
    node_timeout_s: float = ranged(CL.node_timeout_s, "> 0", " seconds")  # silence of a node's launcher after which the node is lost, failed whole and fenced
    coordinator: str = one_of("store", "etcd")  # store: the coordinator is node 0's (or a stand-alone) launcher, and its loss ends the run; etcd: the job's facts live in etcd, any launcher can coordinate, and the role moves when its node is lost (docs/multinode.md)
    etcd: EtcdConfig = field(default_factory=EtcdConfig)
    metrics_port: int = ranged(0, "[0, 65535]", " (0: off)")  # >0: the coordinator serves Prometheus metrics at http://<its host>:PORT/metrics (goodput, steps, tokens/s, recoveries by cause and phase, spares, nodes, stragglers); needs prometheus_client
    replication: ReplicationConfig = field(default_factory=ReplicationConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    audit: AuditConfig = field(default_factory=AuditConfig)


@dataclass
class PeftConfig:
    method: str = one_of("none", "lora")  # none (train every parameter) or lora (train low-rank adapters through peft; the base stays frozen)
    r: int = ranged(8, ">= 1", " (a rank of 8 or 16 is typical)", when="peft.method=lora")  # LoRA rank
    alpha: float = ranged(16.0, "> 0", " (often 2 x peft.r)", when="peft.method=lora")  # LoRA scaling numerator (the update is scaled by alpha / r)
    dropout: float = ranged(0.0, "[0, 1)", when="peft.method=lora")  # dropout on the adapters' input
    target_modules: List[str] = field(default_factory=lambda: ["all-linear"])  # module names to adapt (all-linear: every linear layer but the output head)
    merge: bool = False  # also export the model with the adapters merged into the base weights


@dataclass
class EvalConfig:
    every: int = ranged(0, ">= 0", " steps (0: no validation)")  # steps between validation passes (0: none); the last step is always evaluated when > 0
    split: Optional[str] = None  # split of the training dataset to validate on (source=hub)
    files: List[str] = field(default_factory=list)  # json/jsonl/parquet/txt files to validate on (source=files or synthetic)
    max_batches: int = ranged(8, ">= 1")  # micro-batches per rank... at most this many batches of micro_batch_size rows in all, split over ranks
    seed: int = 1  # seeds generated validation text (source=synthetic without files)


@dataclass
class LoggingConfig:
    trackers: List[str] = field(default_factory=list)  # accelerate trackers: tensorboard, wandb, mlflow, comet_ml, aim, clearml, dvclive, swanlab, trackio
    dir: str = "${run.output_dir}/logs"  # where file-based trackers (tensorboard) write; the same run continues here after rank 0 is replaced


@dataclass
class CheckpointConfig:
    interval: int = ranged(0, ">= 0", " (0 disables durable checkpoints)")  # steps between durable checkpoints (0: none; peers hold the live state)
    keep: int = ranged(2, ">= 1")  # newest checkpoints kept on disk
    dir: str = "${run.output_dir}/checkpoints"  # where checkpoints are written
    resume: str = one_of("never", "auto")  # auto: continue from the newest checkpoint in dir, if any; never


@dataclass
class Recipe:
    description: str = ""  # one line on what the recipe is
    extends: Optional[str] = None  # recipe this one is merged onto (e.g. _base)
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    checkpointless: CheckpointlessConfig = field(default_factory=CheckpointlessConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    faults: List[Fault] = field(default_factory=list)  # failures to inject (rehearsal): checkpointless/protocol/faults.py


def leaves(cls=Recipe, prefix: str = ""):
    """(dotted key, field) of every key below the sections of `cls`, in declaration order."""
    for f in fields(cls):
        full = f"{prefix}{f.name}"
        default = f.default_factory() if callable(f.default_factory) else f.default
        if is_dataclass(default):
            yield from leaves(type(default), full + ".")
        else:
            yield full, f
