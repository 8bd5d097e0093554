"""What a worker builds before and just after it joins: device and threads, tokenizer, model,
data sampler, validation rows, the FSDP2 sharding, and the off-the-books warm-up of a spare."""
from __future__ import annotations

import os
import warnings
import weakref
from contextlib import nullcontext

import torch
from omegaconf import OmegaConf

from checkpointless import protocol

from launcher.recipe.schema import SHARDED
from launcher.train.micro import MicroBatch

def setup(cfg):
    """(backend, device) of this worker; the thread count of a CPU worker is set here."""
    d = cfg.distributed
    on_gpu = d.device != "cpu" and torch.cuda.is_available()
    backend = d.backend if d.backend != "auto" else ("nccl" if on_gpu else "gloo")
    if backend == "nccl":
        # the supervisor's device slot, or torchrun's local rank (the off and restart modes)
        slot = int(os.environ.get(protocol.ENV_DEVICE_SLOT, os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", slot % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        threads = d.threads_per_worker or max(1, (os.cpu_count() or 1) // d.num_processes)
        torch.set_num_threads(threads)
        # accelerate, whose Accelerator the loop builds after join, resets the thread count to
        # physical cores / local processes when OMP_NUM_THREADS is unset; this keeps ours
        os.environ["OMP_NUM_THREADS"] = str(threads)
    return backend, device


# models built on the meta device whose values wait for shard(): model -> (init rules, seed)
_UNFILLED = weakref.WeakKeyDictionary()


def build(cfg, device, sharded: bool | None = None):
    """Tokenizer, model (in train mode) and the step sampler: everything a worker builds before it
    holds a rank.

    A random init is built on the meta device with its init recorded (models/init.py). Unsharded
    (ddp, or `sharded=False`) it is materialized here, whole, on `device`. Under fsdp it stays on
    the meta device until shard(), after join: each rank then allocates and fills its own shard
    only, and a spare holds no parameter memory while it waits. Either way each parameter's
    value is a function of (run.seed, its name): the same model for any world size or strategy.
    """
    import datasets
    import transformers
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()  # save_pretrained's, at the end
    # peft asks transformers a question transformers now words differently: not the user's concern
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    from models import build_tokenizer

    from launcher.data.prepare import prepare
    from launcher.data.sampler import StepSampler
    from launcher.train.memory import mark_baseline
    mark_baseline()  # the resident set once imported, before any model or data (report.json)

    tokenizer = build_tokenizer(cfg.tokenizer.kind, cfg.tokenizer.id or cfg.model.id,
                                cfg.tokenizer.chat_template)
    model = model_for(cfg, tokenizer, device, sharded)
    t = cfg.trainer
    sampler = StepSampler(prepare(cfg, tokenizer), cfg.run.seed, t.micro_batch_size,
                          t.grad_accum_steps)
    return tokenizer, model, sampler


def master_dtype(cfg):
    """What the trained parameters are kept in: fp32, whatever dtype the model's config or
    checkpoint names (Llama 3 and gpt-oss say bfloat16). trainer.precision=bf16/fp16 computes in
    half precision over these fp32 masters (fsdp: FSDP2's MixedPrecisionPolicy, see shard();
    ddp: autocast), with fp32 gradients and AdamW moments: bf16 weights would drop every update
    smaller than their resolution (at lr 5e-5 on N(0, 0.02) weights, a large share of each
    step). Under LoRA with ddp the frozen base keeps the config's dtype (None): it never
    changes, and peft keeps the adapters in fp32."""
    if cfg.peft.method != "none" and cfg.distributed.strategy not in SHARDED:
        return None
    return torch.float32


def build_eval(cfg, tokenizer):
    """(validation rows, the fixed row set) when eval.every > 0, else None; built before join."""
    if cfg.eval.every <= 0:
        return None
    from launcher.data.prepare import prepare
    from launcher.data.sampler import eval_rows
    ds = prepare(cfg, tokenizer, part="eval")
    return ds, eval_rows(ds, cfg.eval.max_batches, cfg.trainer.micro_batch_size)


def shard(model, cfg, mesh=None, receives_state: bool = False, roots=None):
    """FSDP2: each decoder block and then the root becomes a sharded unit over `mesh` (the job's:
    1-D under fsdp, dp_replicate x dp_shard under hsdp; by default the default group's); with a
    tp dimension the plan's linear layers are split over it first (tensor_parallel.py). A model
    still on the meta device (build()) then gets its shard allocated and filled on this rank
    (`receives_state`: a replacement whose state will come from peers fills only what is not
    sent)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from models.lora import base_of
    blocks = None
    for attr in ("model.layers", "transformer.h"):
        obj = base_of(model)  # under LoRA the decoder blocks are inside peft's wrapper
        try:
            for part in attr.split("."):
                obj = getattr(obj, part)
            blocks = obj
            break
        except AttributeError:
            continue
    # trainer.precision=bf16: each unit is gathered in bf16 for compute (parameters, activations,
    # gradients computed in bf16) while the sharded parameters, their gradients and AdamW stay
    # fp32; gradients are cast to fp32 before the reduce-scatter, so the sum is fp32
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if cfg.trainer.precision == "bf16" else MixedPrecisionPolicy()
    mesh = mesh if mesh is not None else shard_mesh()
    names = mesh.mesh_dim_names or ()
    if "tp" in names:  # split the plan's linears over tp first; FSDP2 then shards over dp
        from launcher.train.tensor_parallel import apply
        apply(base_of(model), mesh["tp"])
    if "tp" in names or "pp" in names:  # FSDP2 shards over the stage's dp dimensions
        dp = tuple(n for n in names if n not in ("tp", "pp"))
        mesh = mesh[dp] if len(dp) > 1 else mesh[dp[0]]
    if isinstance(blocks, torch.nn.ModuleDict):  # a pipeline stage's layers, by index
        blocks = list(blocks.values())
    for block in blocks or []:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    # `roots`: a pipeline stage's views (pipeline.py), each run by the schedule as a whole
    for root in roots or [model]:
        fully_shard(root, mesh=mesh, mp_policy=mp)
    if model in _UNFILLED:
        _fill_shards(model, cfg, *_UNFILLED.pop(model), receives_state)
    return model


def hand_over_init(model, part) -> None:
    """A pipeline stage's part (pipeline.StagePart) of a model still on the meta device takes
    over its init rules: shard() fills the part's own parameters, by their names in the model."""
    if model in _UNFILLED:
        _UNFILLED[part] = _UNFILLED.pop(model)


def shard_mesh():
    """The mesh FSDP2 shards over: the job's default group itself, on the device of the backend
    this worker joined with (nccl: its GPU, else the CPU).

    Left to itself, fully_shard builds a mesh on the accelerator whenever one is visible, which
    would put a distributed.device=cpu (gloo) run's shards on a GPU; and a mesh made with
    init_device_mesh on a machine with a GPU over a gloo default group creates a second group,
    a collective of its own. A replacement shards alone, after joining: it would wait there
    forever for survivors that made theirs long ago (seen on an H200 machine: the survivors'
    restore timed out). From the default group, a recovery's new group (which takes the old
    one's name) is the mesh's group at once, for survivors and replacement alike."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh.from_group(dist.group.WORLD,
                                 "cuda" if dist.get_backend() == "nccl" else "cpu")


def model_for(cfg, tokenizer, device, sharded: bool | None = None):
    """The recipe's model, in train mode (build()'s, alone: a shrink under fsdp builds one anew
    for the new number of processes, launcher/train/rebuild.py)."""
    from models import build_model
    from models.init import EmptyBuild, materialize
    if sharded is None:
        sharded = cfg.distributed.strategy in SHARDED
    torch.manual_seed(cfg.run.seed)
    random = cfg.model.init != "pretrained"
    # pretrained under fsdp: built on the meta device too, each rank then reads its shard only
    on_meta = random or sharded
    with EmptyBuild() if on_meta else nullcontext() as empty:
        model = build_model(cfg.model.name, cfg.model.init, cfg.model.id,
                            OmegaConf.to_container(cfg.model.config), vocab_size=len(tokenizer),
                            token_ids={"eos_token_id": tokenizer.eos_token_id,
                                       "bos_token_id": tokenizer.bos_token_id,
                                       "pad_token_id": tokenizer.pad_token_id},
                            dtype=master_dtype(cfg), load_weights=not on_meta)
        if cfg.model.gradient_checkpointing:
            # transformers checkpoints each decoder block (its GradientCheckpointingLayer), not
            # reentrant: under fsdp a block's recompute runs inside its own FSDP unit's hooks
            enable = getattr(model, "activation_checkpointing_enable", None) or \
                model.gradient_checkpointing_enable
            enable({"use_reentrant": False})
        if cfg.peft.method == "lora":  # adapters initialized (and recorded) like the base
            from models.lora import apply_lora
            if cfg.model.gradient_checkpointing:  # frozen inputs would give checkpointing no grads
                model.enable_input_require_grads()
            p = cfg.peft
            model = apply_lora(model, p.r, p.alpha, p.dropout, list(p.target_modules))
    if on_meta:
        rules = empty.rules(model)
        if sharded:
            _UNFILLED[model] = (rules, cfg.run.seed)
        else:
            materialize(model, rules, cfg.run.seed, device)
    else:
        model.to(device)
    model.train()
    return model


def _fill_shards(model, cfg, rules, seed, receives_state: bool):
    """Allocate this rank's shard and give it its values: under model.init=pretrained read from
    the checkpoint's safetensors files, this rank's rows only (a parameter the files lack, such
    as a LoRA adapter, gets its init); else drawn by the recorded init rules. A spare taking
    over a rank fills only what it will not receive: nothing when the whole state is sent, the
    frozen base under LoRA (protect(send_frozen=False): rebuilt bit for bit, not sent). One
    that took its rank before any step was committed fills it all (Job.builds_own_state)."""
    from models.init import materialize
    from models.lora import base_of
    weights = None
    if cfg.model.init == "pretrained":
        from models.pretrained import SafetensorsFiles
        weights = SafetensorsFiles.locate(cfg.model.id)
    fill = lambda name, p: True  # noqa: E731
    if receives_state:
        if cfg.peft.method == "none":
            fill = lambda name, p: False  # noqa: E731
        else:
            fill = lambda name, p: not p.requires_grad  # noqa: E731
    mesh = next(p for p in model.parameters()).device_mesh  # where fully_shard put the shards
    device = torch.device("cuda", torch.cuda.current_device()) \
        if mesh.device_type == "cuda" else torch.device(mesh.device_type)
    materialize(model, rules, seed, device, fill, weights=weights,
                prefixes=(getattr(base_of(model), "base_model_prefix", ""),))
    if weights is not None:
        weights.close()


def full_state(model, strategy: str) -> dict:
    """The whole model state in rank 0's host memory (a collective under fsdp: each tensor is
    gathered on the device, moved to rank 0's host, and dropped before the next; the other
    ranks get nothing). Only the LoRA export uses it; the digest and the full export stream."""
    if strategy in SHARDED:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                              get_model_state_dict)
        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
    return model.state_dict()


def warm_up(model, sampler, cfg, device) -> int:
    """Forward and backward off the books, in a spare before it waits; returns the CPU threads
    its catch-up step may use.

    A fresh process runs its first step about a quarter slower (kernels picked, allocator pools
    grown). After a failure the other ranks wait on the replacement's first step, so it should
    run at full speed. On CPU the waiting ranks' cores are idle during that step: the spare may
    use them all if, on two batches of the recipe's shape, the gradients come out bit for bit
    the same as with its usual thread count (kernels that split a sum by thread would not).
    Nothing is kept: gradients are dropped and the random state is restored.
    """
    base, wide = torch.get_num_threads(), len(os.sched_getaffinity(0))

    micro = MicroBatch.of_recipe(cfg, sampler, device,
                                 seed=lambda step, _micro, _share: torch.manual_seed(step))

    def grads(step: int, threads: int) -> torch.Tensor:
        with cpu_threads(threads), torch.random.fork_rng(devices=[]):
            micro(model, step, 0, cfg.distributed.num_processes, 0, torch.zeros(1, device=device))
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        model.zero_grad(set_to_none=True)
        return flat

    if device.type != "cpu" or wide <= base:
        grads(0, base)
        return base
    same = all(torch.equal(grads(s, base), grads(s, wide)) for s in (0, 1))
    return wide if same else base


class cpu_threads:
    """Run a block with `n` torch CPU threads (None: unchanged), then restore the count."""

    def __init__(self, n):
        self.n = n

    def __enter__(self):
        self.before = torch.get_num_threads()
        if self.n and self.n != self.before:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        if torch.get_num_threads() != self.before:
            torch.set_num_threads(self.before)
        return False
