"""Pre-flight: before any worker starts, check once what the recipe needs, and say in one message
everything that is missing.

Without it, each of N workers and the spares finds the problem on its own (N tracebacks, each
after the hub's retries) and the run ends with "worker 5 exited before it finished starting up".
Checked here, in the launcher:
  * the devices: a recipe sized for GPUs on a machine without enough of them;
  * the model config and the tokenizer, when the recipe names a hub id or folder: resolved once,
    an unreachable hub, a gated model, a wrong id each get their own sentence;
  * the data: local files exist; a hub dataset id can be resolved;
  * checkpoint.resume=auto over checkpoints this version cannot read (the old single-file ones)
    or over the newest checkpoint of another model (its `.metadata` against the shapes of the
    recipe's model built on the meta device: no tensor read, no memory);
  * model.init=pretrained from a local folder without the weight files its loader reads, or from
    a hub id whose weights are not in the local cache while the hub cannot be reached;
  * the optional packages the recipe's keys ask for (the trackers; prometheus_client for
    checkpointless.metrics_port): named with the install command;
  * the memory plan (launcher/plan/);
  * checkpointless.startup_timeout_s against the time a worker needs to start with this model
    (launcher/plan/startup.py).
The model's and the tokenizer's checks (folders, hub, weight files) are in preflight_model.py;
the hub helpers they share with the plan live in models/hub.py.
"""
from __future__ import annotations

from models.hub import hub_problem, offline_unless_reachable
from launcher.plan import check_fits
from launcher.recipe.load import RecipeError
from launcher.plan.startup import startup_problem
from launcher.run.preflight_model import model_problem, tokenizer_problem
# its name here before the model's checks had a file of their own
from launcher.run.preflight_model import weights_problem as _weights_problem  # noqa: F401


def preflight(cfg) -> None:
    """Raise RecipeError listing every problem found, each with its fix; return when none."""
    offline_unless_reachable(cfg)
    model, tokenizer = model_problem(cfg), tokenizer_problem(cfg)
    problems = [p for p in (_devices(cfg), _etcd_binary(cfg), *missing_packages(cfg), model,
                            tokenizer, _data(cfg),
                            # the model is built to compare shapes only when it can be
                            _checkpoints(cfg, model_ok=not (model or tokenizer))) if p]
    if not problems:
        problems += [p for p in (_tensor_parallel(cfg), _pipeline(cfg)) if p] or _memory(cfg)
        problems += [p for p in (startup_problem(cfg),) if p]
    if problems:
        raise RecipeError("this recipe cannot start on this machine:\n  - " +
                          "\n  - ".join(problems))


def preflight_data(cfg) -> None:
    """The part of the pre-flight that preparing the data needs (`python -m launcher prepare`,
    on a node or login host without the recipe's GPUs): the tokenizer and the dataset."""
    offline_unless_reachable(cfg)
    problems = [p for p in (tokenizer_problem(cfg), _data(cfg)) if p]
    if problems:
        raise RecipeError("the data of this recipe cannot be prepared here:\n  - " +
                          "\n  - ".join(problems))


# the module each of accelerate's trackers imports, and the package that provides it
TRACKER_MODULES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                   "mlflow": ("mlflow", "mlflow-skinny"), "comet_ml": ("comet_ml", "comet_ml"),
                   "aim": ("aim", "aim"), "clearml": ("clearml", "clearml"),
                   "dvclive": ("dvclive", "dvclive"), "swanlab": ("swanlab", "swanlab"),
                   "trackio": ("trackio", "trackio")}


def installed(module: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def missing_packages(cfg) -> list[str]:
    """What the recipe's keys ask for and this environment lacks: one sentence each, with the
    install command (rank 0 would otherwise fail in init_trackers after the workers started)."""
    out = []
    for i, name in enumerate(cfg.logging.trackers):
        module, package = TRACKER_MODULES.get(name, (name, name))
        if not installed(module):
            out.append(f"logging.trackers[{i}]={name}: the {module} package is not installed "
                       f"here. Fix: pip install {package} (or drop {name} from logging.trackers)")
    port = cfg.checkpointless.get("metrics_port", 0)
    if port and not installed("prometheus_client"):
        out.append(f"checkpointless.metrics_port={port}: serving /metrics needs the "
                   "prometheus_client package, which is not installed here. Fix: pip install "
                   "prometheus_client (or checkpointless.metrics_port=0)")
    return out


def _checkpoints(cfg, model_ok: bool = True) -> str | None:
    """checkpoint.resume=auto over single-file checkpoints of an earlier version, or over a
    newest checkpoint of another model (told from its `.metadata`, before any worker reads it)."""
    if cfg.checkpoint.resume != "auto":
        return None
    from checkpointless.worker import durable

    from launcher.train.checkpoints import CheckpointMismatch, old_format_error, refuse_another_model
    if (msg := old_format_error(cfg.checkpoint.dir)) is not None:
        return msg
    found = durable.latest(cfg.checkpoint.dir)
    if found is None or not model_ok:
        return None
    try:
        durable.saved_shapes(found[1])
    except Exception as exc:  # noqa: BLE001  a truncated or foreign .metadata
        return (f"checkpoint.resume=auto: {found[1]}/.metadata cannot be read ({type(exc).__name__}"
                f": {exc}). Fix: move that checkpoint away (the one before it is then the newest), "
                "or start from scratch with checkpoint.resume=never (or an empty checkpoint.dir)")
    try:
        refuse_another_model(found[1], meta_model_state(cfg))
    except CheckpointMismatch as exc:
        return str(exc)
    return None


def meta_model_state(cfg) -> dict:
    """The model state dict a worker saves and loads (launcher/train/checkpoints.py), its keys and
    global shapes, from the recipe's model built as launcher/model_setup.build builds it but on the
    meta device: no weights read, no memory."""
    import warnings

    from omegaconf import OmegaConf
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from models import build_model, build_tokenizer
    from models.init import EmptyBuild
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    tok = build_tokenizer(cfg.tokenizer.kind, cfg.tokenizer.id or cfg.model.id,
                          cfg.tokenizer.chat_template)
    with EmptyBuild():
        model = build_model(cfg.model.name, cfg.model.init, cfg.model.id,
                            OmegaConf.to_container(cfg.model.config), vocab_size=len(tok),
                            token_ids={"eos_token_id": tok.eos_token_id,
                                       "bos_token_id": tok.bos_token_id,
                                       "pad_token_id": tok.pad_token_id},
                            load_weights=False)
        if cfg.peft.method == "lora":
            from models.lora import apply_lora
            p = cfg.peft
            model = apply_lora(model, p.r, p.alpha, p.dropout, list(p.target_modules))
    return get_model_state_dict(model)  # the keys get_state_dict gives the workers


def _devices(cfg) -> str | None:
    d, c = cfg.distributed, cfg.checkpointless
    if d.device == "auto" and cfg.trainer.precision == "fp16":
        import torch
        if not torch.cuda.is_available():  # workers would run on CPU, where fp16 is refused
            return ("trainer.precision=fp16: fp16 needs a GPU (float16 autocast with a "
                    "GradScaler) and this machine has none, so the workers would run on CPU; use "
                    "trainer.precision=bf16 on CPU (or fp32)")
    if d.device != "cuda":
        return None
    import torch
    need = d.num_processes + (c.spares if c.enabled else 0)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have >= need:
        return None
    if have == 0:
        return (f"distributed.device=cuda: the recipe is sized for GPUs ({d.num_processes} "
                f"workers + {need - d.num_processes} spare(s), one GPU each) and this machine has "
                "none. To run it on CPU anyway, add distributed.device=cpu (and a smaller model "
                "or fewer processes: distributed.num_processes=2)")
    return (f"distributed.device=cuda: {d.num_processes} workers + {need - d.num_processes} "
            f"spare(s) need {need} GPUs and this machine has {have}. Lower "
            f"distributed.num_processes (e.g. distributed.num_processes={max(1, have - 1)} "
            f"checkpointless.spares={min(1, have - 1)})")


def _data(cfg) -> str | None:
    d = cfg.data
    try:
        if d.source == "files":
            from launcher.data.prepare import resolve_files
            resolve_files(list(d.files))
            if cfg.eval.every > 0 and cfg.eval.files:
                resolve_files(list(cfg.eval.files), key="eval.files")
        elif d.source == "hub":
            import datasets
            try:
                datasets.load_dataset_builder(d.id, d.subset, revision=d.revision)
            except Exception as exc:  # noqa: BLE001
                return hub_problem(exc, "dataset", "data.id", d.id)
    except (ValueError, FileNotFoundError) as exc:
        return str(exc)
    return None


def _etcd_binary(cfg) -> str | None:
    """coordinator=etcd with the embedded members: nodes 0, 1 and 2 run etcd, so it must be
    here (else each node would print a traceback from the member's start)."""
    c, d = cfg.checkpointless, cfg.distributed
    if c.coordinator != "etcd" or c.etcd.endpoints or d.node_rank >= 3:
        return None
    from checkpointless.ha import member
    if member.binary() is not None:
        return None
    return ("checkpointless.coordinator=etcd: node "
            f"{d.node_rank} runs a member of the embedded etcd, and no etcd binary is on this "
            "machine. Fix: install it (apt-get install etcd-server), point "
            "CHECKPOINTLESS_ETCD at one, or name a cluster you run with "
            "checkpointless.etcd.endpoints=host:port,...")


def _tensor_parallel(cfg) -> str | None:
    """distributed.tp_size splits this model: it has a plan, and its heads divide."""
    if cfg.distributed.tp_size <= 1:
        return None
    from launcher.plan.model import hf_config
    from launcher.parallel.mesh import refusal
    return refusal(cfg.distributed.tp_size, hf_config(cfg)[0])


def _pipeline(cfg) -> str | None:
    """distributed.pp_size splits this model: it has a plan this loop runs, and layers enough."""
    if cfg.distributed.pp_size <= 1:
        return None
    from launcher.parallel.pipeline_split import refusal
    from launcher.plan.model import hf_config
    return refusal(cfg, hf_config(cfg)[0])


def _memory(cfg) -> list[str]:
    if cfg.distributed.device == "cpu":  # the CPU recipes are tiny; the plan is for devices
        return []
    try:
        check_fits(cfg)
    except RecipeError as exc:
        return [str(exc)]
    return []
