"""The recipe loop's `accelerate.Accelerator`, built after `checkpointless.join()`.

What the loop takes from accelerate: the device, autocast for `trainer.precision`, the loss
scaling of gradient accumulation (`accelerator.backward`), the fp16 GradScaler (GPU only),
gradient clipping, main-process printing and the trackers. What stays the launcher's: the FSDP2
sharding (see start_line) and the gradient reduction, in
checkpointless.DistributedDataParallel's fixed-order buckets or job.all_reduce_grads. accelerate
would wrap the model in torch's DDP, which keeps the process group it was built with (a recovery
builds a new one) and sums in an order of its own, so the model is never given to it under ddp.

Why after join, not before: accelerate reads the rank and world size once, when its first
Accelerator is built, and a spare has neither until join() hands it a failed rank. Survivors keep
their rank and a spare takes the failed one's, so what accelerate read stays true across
recoveries; its own collectives use the default group, which join() rebuilds. Its constructor
makes no collective call, so a replacement builds it before it receives the state without waiting
on survivors that are not there. Importing this module imports accelerate: the loop does it before
join(), so a spare pays for the import while it waits, not during a recovery.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import accelerate
import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration


# trainer.precision -> accelerate's mixed_precision
MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def build_accelerator(cfg, job, device: torch.device) -> Accelerator:
    """The Accelerator of this worker; `device` is the one setup() chose (and the model was built
    on, before join): accelerate must agree, or the run stops here."""
    t = cfg.trainer
    _environment(job, device)
    accelerator = Accelerator(
        cpu=device.type == "cpu",
        mixed_precision=MIXED_PRECISION[t.precision],
        # accelerator.backward divides the loss by it; which micro-batch reduces is the loop's
        # choice (see launcher/train/loop.py)
        gradient_accumulation_steps=t.grad_accum_steps,
        log_with=list(cfg.logging.trackers) or None,
        project_config=ProjectConfiguration(project_dir=str(Path(cfg.run.output_dir)),
                                            logging_dir=cfg.logging.dir),
    )
    if accelerator.device != device:
        raise RuntimeError(f"accelerate placed this worker on {accelerator.device} but the "
                           f"launcher built the model on {device}")
    return accelerator


def start_line(cfg, accelerator: Accelerator) -> str:
    """One line, printed once at start, saying what the loop runs on."""
    d = cfg.distributed
    line = (f"[launcher] on accelerate {accelerate.__version__}'s Accelerator: device "
            f"{accelerator.device}, mixed precision {accelerator.mixed_precision}"
            f"{' with a GradScaler' if accelerator.scaler is not None else ''}, gradient "
            f"accumulation {accelerator.gradient_accumulation_steps}")
    if d.pp_size > 1:
        line += (f"; pipeline of {d.pp_size} stages ({d.pp_schedule}, torch.distributed."
                 f"pipelining) x {d.num_processes // d.pp_size} workers each")
    if d.strategy == "ddp" and cfg.checkpointless.shrink == "exact":
        return line + ("; gradients averaged by checkpointless over the logical ranks in one "
                       "fixed order (checkpointless.shrink=exact)")
    if d.strategy == "ddp":
        sync = "buckets during backward" if d.grad_sync == "buckets" and d.pp_size == 1 \
            else "one all-reduce after backward"
        return line + f"; gradients averaged by checkpointless in fixed-order {sync}"
    # accelerate's FSDP2 plugin shards a model that is whole on every worker (or broadcast from
    # rank 0, a collective a replacement could never join), and on gloo it is ignored: the
    # launcher's shard() lets each rank build, load and hold only its own slice
    how = "fsdp" if d.strategy == "fsdp" else (
        f"hsdp, {d.num_processes // d.shard_size} replica groups of {d.shard_size} "
        "(sharded within a group, replicated across)")
    return line + (f"; {how} ({dist.get_backend()}): the launcher shards each decoder block "
                   "with torch's fully_shard, not accelerate's FSDP plugin (each rank "
                   "initializes or loads only its own shard)")


class Autocast:
    """`accelerator.autocast()` as a reusable context manager (launcher/train/evaluate.py enters the
    one it is given once per batch; accelerate's is a one-shot generator)."""

    def __init__(self, accelerator: Accelerator):
        self.accelerator = accelerator
        self._open = []

    def __enter__(self):
        cm = self.accelerator.autocast()
        self._open.append(cm)
        return cm.__enter__()

    def __exit__(self, *exc):
        return self._open.pop().__exit__(*exc)


def tracker_kwargs(cfg, mlflow_run_id: str | None = None) -> dict:
    """Per-tracker arguments to init_trackers, so that a replacement rank 0 continues its
    predecessor's run rather than opening a second one:
      * W&B: resumed by an id of this launch (the output folder and the time its recipe.yaml was
        written), its files under `logging.dir` (offline too: WANDB_MODE=offline), written out
        every second;
      * MLflow: the run its predecessor created (`mlflow_run_id`, kept in the job's store by
        launcher/train/trackers.py), its artifacts under `logging.dir`;
      * TensorBoard and the other file-based trackers continue in the same `logging.dir`."""
    out = {}
    if "wandb" in cfg.logging.trackers:
        recipe = Path(cfg.run.output_dir).resolve() / "recipe.yaml"
        stamp = recipe.stat().st_mtime_ns if recipe.exists() else 0
        run_id = hashlib.sha256(f"{recipe}:{stamp}".encode()).hexdigest()[:16]
        Path(cfg.logging.dir).mkdir(parents=True, exist_ok=True)
        import wandb
        # W&B writes its local record of the run (the .wandb file, all there is offline) every
        # 15 s by default: a rank 0 killed would lose that much. Every second, it loses at most
        # the steps of the last second before a kill (the replacement logs from the resume on)
        out["wandb"] = {"id": run_id, "resume": "allow", "dir": str(cfg.logging.dir),
                        "settings": wandb.Settings(x_transaction_log_flush_interval=1.0)}
    if "mlflow" in cfg.logging.trackers:
        out["mlflow"] = {"logging_dir": str(Path(cfg.logging.dir).resolve() / "mlflow-artifacts"),
                         "run_id": mlflow_run_id}
    return out


def _environment(job, device: torch.device) -> None:
    """What accelerate reads from the environment when the Accelerator is built: the process's
    place as the job sees it (`job.process_env()`, the rule the drop-in Accelerator follows too:
    under torchrun, torchrun's own), and the device named outright (ACCELERATE_TORCH_DEVICE),
    since accelerate would otherwise pick the GPU numbered by LOCAL_RANK, and a spare holds the
    failed worker's slot, not that one. accelerate's thread count is left alone because setup()
    exported OMP_NUM_THREADS."""
    os.environ["ACCELERATE_TORCH_DEVICE"] = str(device)
    os.environ.update(job.process_env())
