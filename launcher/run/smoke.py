"""`python -m launcher smoke [RECIPE ...] [key=value ...]`: each recipe started for real, in its
own shape, on this machine's CPUs, for 3 steps; with no recipe, every shipped one.

What defines a recipe is kept: its strategy, tensor, pipeline and shard layout (the mesh they
make), model.init (pretrained: from a checkpoint saved here of the same architecture), its data
format and chat template, LoRA, gradient checkpointing, precision, evaluation and the export.
Only sizes shrink, by one rule (SHRINK below):

    model       the recipe's own config (its hub config, or the built-in table's offline) with
                64-wide layers, 4 heads (2 key/value heads), 4 experts where it has experts,
                4 layers, 256 positions; saved with save_pretrained in
                several files (an index, as a large model's) and used as model.id
    tokenizer   the built-in byte-level one (the recipe's chat template setting kept)
    data        text: generated documents; chat: the shipped chat files (launcher/assets);
                64 tokens a row (chat: 128); evaluation, when the recipe has it, every 2 steps
    steps       3, each of 8 rows: micro-batches of 8 / (data ranks x accumulation), with the
                recipe's gradient accumulation capped at 2
    processes   each parallel dimension the recipe has (pipeline stages, hsdp replica groups,
                fsdp shard ranks, tensor parallel) capped at 2; ddp or fsdp alone: 4 workers;
                one node; at most 1 spare
    device      cpu, gloo, one thread per worker; the tiny recipes' failure detection timeouts

Where the recipe has spares, the run is made twice: failure-free, and with rank 1 killed in the
second step (the one the replay check runs twice) at a moment the recipe's name chooses (the
step's start, its backward, its optimizer step, or a seeded moment); the two must end with the
same bits. Then: the run's replay check must not have found the step unreplayable; the export
must reload with from_pretrained (LoRA: the adapter on the saved base) to the run's final
state, bit for bit; and the memory plan's parameter bytes per rank must agree with what the
workers held.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

from omegaconf import OmegaConf

from launcher.recipe.load import RecipeError, recipe_names, resolve

STEPS = 3
ROWS = 8  # rows a step trains, whatever the shape (the same first loss across shapes)
MAX_WORKERS = 4  # of a 1-D mesh (ddp, fsdp)


def kill_for(name: str) -> str:
    """Rank 1 killed in the second step (the one the replay check runs twice) at a moment chosen
    by the recipe's name: at the step's start, in its backward (some gradient collectives
    done), as its optimizer step begins, or at a seeded moment (a fraction of the first step's
    time, which may reach into the third). Across the recipes every moment of a step is tried."""
    digest = int(hashlib.sha256(f"smoke/{name}".encode()).hexdigest()[:8], 16)
    moment = ("step", "backward", "optimizer", f"random:{1 + digest % 9999}")[digest % 4]
    return f"kill:1:1@{moment}"


# model fields and their tiny value, set where the recipe's model config has them
TINY_FIELDS = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, n_embd=64, n_head=4, n_inner=None,
                   num_local_experts=4, num_experts_per_tok=2, experts_per_token=2,
                   max_position_embeddings=256, n_positions=256, n_ctx=256,
                   sliding_window=16, initial_context_length=256)
LAYER_FIELDS = ("num_hidden_layers", "n_layer")
LAYERS = 4  # 2 pipeline stages of 2 virtual stages each; the same model for every shape
ASSETS = Path(__file__).resolve().parent.parent / "assets"  # wherever the command is run from
CHAT_FILES = (str(ASSETS / "tiny_chat.jsonl"), str(ASSETS / "tiny_chat_eval.jsonl"))


def tiny_model_config(cfg, layers: int):
    """The recipe's transformers config at the smoke's size, for the byte tokenizer."""
    from launcher.plan.model import hf_config
    byte = OmegaConf.merge(cfg, OmegaConf.from_dotlist(["tokenizer.kind=byte",
                                                         "tokenizer.id=null"]))
    hf, _ = hf_config(byte)
    for key, value in TINY_FIELDS.items():
        if hasattr(hf, key):
            setattr(hf, key, value)
    for key in LAYER_FIELDS:
        if hasattr(hf, key):
            setattr(hf, key, layers)
    if getattr(hf, "layer_types", None):  # gpt-oss: one attention kind per layer
        hf.layer_types = list(hf.layer_types[:layers])
    # a scaled rope (yarn, llama3) keeps its factor over the shorter context (transformers 5
    # names it rope_parameters, earlier ones rope_scaling)
    key = "rope_parameters" if "rope_parameters" in vars(hf) else "rope_scaling"
    rope = vars(hf).get(key)
    if isinstance(rope, dict) and "original_max_position_embeddings" in rope:
        factor = rope.get("factor") or 1
        setattr(hf, key, dict(rope, original_max_position_embeddings=max(
            1, int(TINY_FIELDS["max_position_embeddings"] // factor))))
    hf.dtype = "float32"
    return hf


def save_weights(hf, seed: int, root: Path) -> Path:
    """A checkpoint of config `hf` with seeded values, saved once per config under `root`."""
    import torch
    from transformers import AutoModelForCausalLM

    from models import byte_tokenizer
    text = hf.to_json_string(use_diff=False)
    folder = root / hashlib.sha256(f"{seed}/{text}".encode()).hexdigest()[:16]
    if (folder / "config.json").exists():
        return folder
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)  # other values than the recipe's seeded init gives
        model = AutoModelForCausalLM.from_config(hf)
    tmp = folder.with_suffix(".tmp")
    model.save_pretrained(tmp, max_shard_size="200KB")
    byte_tokenizer().save_pretrained(tmp)
    tmp.rename(folder)
    return folder


def shape(cfg) -> dict:
    """The smoke's layout for the recipe's: each parallel dimension capped at 2."""
    d = cfg.distributed
    stage = d.num_processes // d.pp_size  # the workers of one pipeline stage
    replicas = stage // d.shard_size if d.strategy == "hsdp" else 1
    ranks = stage // (replicas * d.tp_size)  # fsdp shard (or ddp) ranks of a replica group
    tp, pp, replicas = min(d.tp_size, 2), min(d.pp_size, 2), min(replicas, 2)
    # every dimension the recipe has is kept, at 2 (a 1-D mesh, ddp or fsdp alone: 4 ranks)
    ranks = min(ranks, MAX_WORKERS if tp * pp * replicas == 1 else 2)
    workers = pp * replicas * ranks * tp
    data_ranks = workers // tp
    accum = min(cfg.trainer.grad_accum_steps, 2)
    micro = max(1, ROWS // (data_ranks * accum))
    out = {"distributed.num_processes": workers, "distributed.tp_size": tp,
           "distributed.pp_size": pp, "trainer.grad_accum_steps": accum,
           "trainer.micro_batch_size": micro}
    if d.strategy == "hsdp":
        out["distributed.shard_size"] = ranks * tp
    return out


def shrunk_overrides(cfg, weights: Path) -> list[str]:
    """The recipe's overrides that make its smoke run (SHRINK, in the module's doc)."""
    chat = cfg.data.format == "chat"
    out = {**shape(cfg),
           "model.id": str(weights), "tokenizer.kind": "byte", "tokenizer.id": None,
           "data.id": None, "data.seq_len": 128 if chat else 64,
           "trainer.max_steps": STEPS, "trainer.log_every": 1, "trainer.progress_bar": False,
           "optim.warmup_steps": 1, "distributed.device": "cpu", "distributed.backend": "gloo",
           "distributed.num_nodes": 1, "distributed.nproc_per_node": 0,
           "distributed.node_rank": 0, "distributed.threads_per_worker": 1,
           "distributed.pp_layers": None, "distributed.pp_microbatches": 0,
           "checkpointless.spares": min(cfg.checkpointless.spares, 1),
           "checkpointless.spare_nodes": 0, "checkpointless.heartbeat_timeout_s": 3.0,
           "checkpointless.pg_timeout_s": 60.0, "checkpointless.replication.placement": "auto",
           "logging.trackers": [], "faults": []}  # the recipe's own faults: the smoke kills
    if chat:
        out.update({"data.source": "files", "data.files": [CHAT_FILES[0]]})
    else:
        out.update({"data.source": "synthetic", "data.synthetic_docs": 300, "data.files": []})
    if cfg.eval.every > 0:
        out.update({"eval.every": 2, "eval.max_batches": 2, "eval.split": None,
                    "eval.files": [CHAT_FILES[1]] if chat else []})
    return [f"{k}={json.dumps(v) if isinstance(v, (list, type(None))) else v}"
            for k, v in out.items()] + ["~model.config"]


def smoke_recipe(name: str, user: list[str], root: Path):
    """(the recipe's smoke run config, its overrides): the recipe as the user
    would run it (refused here if invalid), its model saved at the smoke's size, then the
    shrink applied."""
    base, _ = resolve(name, user)
    weights = save_weights(tiny_model_config(base, LAYERS), base.run.seed,
                           root / "weights")
    overrides = shrunk_overrides(base, weights) + [f"data.cache_dir={root / 'data-cache'}"] + \
        [o for o in user if not o.startswith(("run.output_dir", "faults", "logging.dir"))]
    cfg, _ = resolve(name, overrides + [f"run.output_dir={root / name}"])
    return cfg, overrides


def train_once(name: str, overrides: list[str], out: Path, faults: list[str]) -> dict | None:
    """One run of the recipe's smoke form into `out`; its report (None: it failed)."""
    from launcher.run.launch import train
    cfg, _ = resolve(name, overrides + [f"run.output_dir={out}", f"logging.dir={out / 'logs'}",
                                        f"faults=[{','.join(faults)}]"])
    report = train(cfg)
    if report is not None:
        report["output_dir"] = str(out)
    return report


def first_loss(out: str) -> float | None:
    for line in (Path(out) / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "step" in row and "loss" in row:
            return row["loss"]
    return None


def export_problem(cfg, report: dict) -> str | None:
    """The export reloaded with from_pretrained (LoRA: the adapter over its base) must be the
    run's final state, bit for bit."""
    if not cfg.trainer.save_model:
        return None
    from transformers import AutoModelForCausalLM

    from checkpointless import state_sha256
    out = Path(report["output_dir"])
    if cfg.peft.method == "lora":
        from peft import PeftModel
        # the base beside the adapter when the run made its own (a seeded init), else model.id
        base_dir = out / "base" if (out / "base").exists() else cfg.model.id
        base = AutoModelForCausalLM.from_pretrained(base_dir)
        model = PeftModel.from_pretrained(base, out / "adapter")
    else:
        model = AutoModelForCausalLM.from_pretrained(out / "model")
    got = state_sha256(model.state_dict())
    if got != report.get("params_sha256"):
        return (f"the export in {out} reloads with from_pretrained to params {got[:16]}, the "
                f"run ended with {str(report.get('params_sha256'))[:16]}")
    return None


def plan_problem(cfg, report: dict) -> tuple[str | None, dict]:
    """The memory plan's parameter bytes per rank against the largest any worker held."""
    from launcher.plan.fit import plan
    held = (report.get("memory") or {}).get("param_bytes_by_rank") or {}
    if not held:
        return "the workers reported no memory figures", {}
    item = next(i for i in plan(cfg, search=False, device_type="cpu").items
                if i.name == "parameters")
    planned, measured = item.device_max, max(held.values())
    figures = {"planned_param_bytes": planned, "measured_param_bytes": measured}
    if abs(planned - measured) > 0.05 * measured + 4096:
        return (f"the plan gives {planned:,} parameter bytes a rank, the workers held up to "
                f"{measured:,}"), figures
    return None, figures


def check(cfg, reference: dict | None, killed: dict | None, kill: bool) -> dict:
    """The recipe's smoke verdict: every problem found, and the figures behind it. `kill`: a
    killed run was made (`killed` is None if it failed)."""
    runs = [("failure-free", reference)] + ([("killed", killed)] if kill else [])
    problems = [f"the {what} run failed (its log above says why)" for what, rep in runs
                if rep is None]
    problems += [f"the {what} run ended {rep.get('status')!r}" for what, rep in runs
                 if rep is not None and rep.get("status") != "ok"]
    if problems:
        return {"problems": problems}
    if kill:
        if not killed.get("failures"):
            problems.append("the kill did not land: the report lists no failure")
        if killed.get("params_sha256") != reference.get("params_sha256"):
            problems.append("the run that lost rank 1 ended with other bits than the "
                            "failure-free run")
    # the failure-free run's rehearsal says whether the recipe's step is replayable; a kill
    # during the killed run's rehearsal leaves that one unchecked, never unreplayable
    for _, rep in runs:
        said = rep.get("replay") or {}
        if said.get("replayable") is False:
            problems.append(f"the replay check found the step unreplayable: {said}")
    final = killed if kill else reference
    problems.append(export_problem(cfg, final))
    plan_said, figures = plan_problem(cfg, final)
    problems.append(plan_said)
    return dict(figures, first_loss=first_loss(reference["output_dir"]),
                params_sha256=final.get("params_sha256"), killed=kill,
                replayable=(reference.get("replay") or {}).get("replayable"),
                problems=[p for p in problems if p])


def main(args: list[str]) -> int:
    """Smoke-run the named recipes (every shipped one when none is named); 1 if any failed."""
    overrides = [a for a in args if "=" in a or a.startswith("~")]
    names = [a for a in args if a not in overrides] or recipe_names()
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("run.output_dir=")]
    root = Path(given[-1] if given else "runs/smoke").resolve()
    root.mkdir(parents=True, exist_ok=True)
    from models.hub import offline_unless_reachable
    results = {}  # recipe -> verdict
    for name in names:
        t0 = time.time()
        try:
            cfg, shrunk = smoke_recipe(name, overrides, root)
        except RecipeError as exc:
            results[name] = {"problems": [f"refused: {exc}"]}
            continue
        offline_unless_reachable(cfg)
        print(f"[smoke] {name}: {describe(cfg)}", flush=True)
        reference = train_once(name, shrunk, root / name / "failure-free", [])
        kill = cfg.checkpointless.spares > 0 and reference is not None
        killed = train_once(name, shrunk, root / name / "killed", [kill_for(name)]) \
            if kill else None
        results[name] = dict(check(cfg, reference, killed, kill), shape=describe(cfg),
                             seconds=round(time.time() - t0, 1))
    (root / "smoke.json").write_text(json.dumps(results, indent=2) + "\n")
    print(summary(results, root), flush=True)
    return 1 if any(r["problems"] for r in results.values()) else 0


def describe(cfg) -> str:
    d = cfg.distributed
    mesh = [f"{d.strategy} {d.num_processes}"] + \
        [f"{k} {v}" for k, v in (("tp", d.tp_size), ("pp", d.pp_size)) if v > 1] + \
        ([f"shard {d.shard_size}"] if d.strategy == "hsdp" else [])
    return (", ".join(mesh) + f" + {cfg.checkpointless.spares} spare, init {cfg.model.init}, "
            f"{cfg.data.format}" + (", lora" if cfg.peft.method == "lora" else "") +
            (f", eval every {cfg.eval.every}" if cfg.eval.every else ""))


def summary(results: dict, root: Path) -> str:
    lines = [f"[smoke] {len(results)} recipes -> {root / 'smoke.json'}"]
    for name, r in results.items():
        verdict = "ok  " if not r["problems"] else "FAIL"
        said = r.get("shape", "")
        if r.get("first_loss") is not None:
            said += f"; first loss {r['first_loss']:.6f}" + \
                ("; kill: same bits" if r.get("killed") and not r["problems"] else "")
        lines.append(f"  {verdict} {name:<18} {said}")
        lines += [f"       {p}" for p in r["problems"]]
    return "\n".join(lines)
