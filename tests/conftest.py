"""What the tests share: the environment (set here, before any test module imports Hugging Face
code), a few gloo processes, and the end-to-end runs.

End-to-end runs start real worker processes (each imports torch, most transformers: ~13 s each on
a 2-core machine), so they are written once here:
- `train`: a recipe through the launcher's CLI, returning its report.json;
- `supervised`: a script under the supervisor (`python -m checkpointless`), returning its report;
- `final_digest` / `assert_same_bits`: the one params_sha256 every rank of a run ended with;
- the session fixture `references`: failure-free runs, each trained once per session whichever
  tests ask for it, keyed by (recipe or script, overrides).
"""
import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before any Hugging Face import: nothing is downloaded
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402


def spawn_gloo(target, world: int, *args, timeout: float = 60.0) -> list:
    """Run target(rank, store_port, queue, *args) in `world` real processes; return what they
    put on the queue, sorted. Each process sets up its own gloo group on the store."""
    import torch.distributed as dist
    import torch.multiprocessing as mp
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, store.port, q, *args)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return sorted((q.get(timeout=timeout) for _ in range(world)), key=repr)
    finally:
        for p in procs:
            p.join(timeout=30)


# ---- runs through the launcher -------------------------------------------------------------------

# The failure-free runs several files end with (their bits) or start from (their disk state).
# Spares never change the bits, so a reference trains without them.
TINY_30 = ("trainer.max_steps=30",)  # tiny-llama, 1 node x 4 workers
FSDP_12 = ("distributed.strategy=fsdp", "trainer.max_steps=12", "checkpoint.interval=4",
           "checkpoint.keep=3")
# fsdp's memory savers together: bf16 compute over fp32 masters (MixedPrecisionPolicy),
# per-block activation checkpointing, and accumulation reduce-scattering every micro-batch
FSDP_SAVERS = ("trainer.precision=bf16", "model.gradient_checkpointing=true",
               "trainer.grad_accum_steps=2")


def launcher_cmd(tmp_path, out, recipe, *overrides, command="train") -> list:
    """`python -m launcher train RECIPE` writing to `out`. The tokenized data is cached once per
    session, beside the tests' own directories (tmp_path's parent is the session's base): its
    key covers everything the rows depend on, so runs of the same data share it."""
    return [sys.executable, "-m", "launcher", command, recipe, f"run.output_dir={out}",
            f"data.cache_dir={tmp_path.parent / 'data-cache'}", "trainer.progress_bar=false",
            *overrides]


def train(tmp_path, name, recipe, *overrides, expect_rc=0, timeout=400, env=None):
    """Train `recipe` through the CLI into tmp_path/name. Returns (out dir, report.json or None
    when the run is expected to fail, the CompletedProcess)."""
    out = tmp_path / name
    r = subprocess.run(launcher_cmd(tmp_path, out, recipe, *overrides), capture_output=True,
                       text=True, timeout=timeout, cwd=ROOT,
                       env=None if env is None else dict(os.environ, **env))
    assert r.returncode == expect_rc, (r.stdout[-3000:], r.stderr[-5000:])
    report = json.loads((out / "report.json").read_text()) if expect_rc == 0 else None
    return out, report, r


def losses(out) -> list:
    recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if "step" in r]


def assert_replayed(report):
    """The run's replay rehearsal ran its second step twice and found the same bits (issue 59:
    no false warning on the project's own loops)."""
    replay = report["replay"]
    assert replay["replayable"] is True and replay["mismatches"] == [], replay
    assert replay["checked_at_step"] is not None, replay


def assert_replicas_agree(report):
    digests = set(report["params_sha256_by_rank"].values())
    processes = report.get("processes_at_end", report["world_size"])  # fewer after a shrink
    assert len(report["params_sha256_by_rank"]) == processes and len(digests) == 1
    assert report["params_sha256"] in digests


# ---- runs under the supervisor -------------------------------------------------------------------

def supervised(tmp_path, name, argv, *options, nproc=4, expect_rc=0, timeout=240, env=None):
    """`python -m checkpointless --nproc N OPTIONS ARGV` (argv: the script and its arguments),
    its report in tmp_path/name.json. Returns the report ({} if none was written) with the run's
    stdout, stderr and took_s added."""
    report = tmp_path / f"{name}.json"
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "checkpointless", "--nproc", str(nproc),
                        "--report", str(report), *options, *map(str, argv)],
                       capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)
    assert r.returncode == expect_rc, (r.stdout[-3000:], r.stderr[-4000:])
    rep = json.loads(report.read_text()) if report.exists() else {}
    return dict(rep, stdout=r.stdout, stderr=r.stderr, took_s=time.time() - t0)


# ---- the bits a run ended with -------------------------------------------------------------------

def final_digest(rep) -> str:
    """The params_sha256 of a run's final state, after asserting that every rank of it holds the
    same one: a launcher's report.json, a supervisor's report, or a digest already."""
    if isinstance(rep, str):
        return rep
    if "params_sha256_by_rank" in rep:
        assert_replicas_agree(rep)
        return rep["params_sha256"]
    by_rank = rep["results_by_rank"]
    digests = {v["params_sha256"] for v in by_rank.values()}
    assert len(by_rank) == rep["world_size"] and len(digests) == 1, by_rank
    return digests.pop()


def assert_same_bits(rep, reference, *context):
    """The run ended with the reference's bits (both: reports or digests); `context` is shown
    when they differ. Between two launcher reports, the rest of the state too
    (assert_same_state)."""
    got, want = final_digest(rep), final_digest(reference)
    assert got == want, (*context, rep.get("recoveries"), rep.get("failures"))
    assert_same_state(rep, reference, *context)


def assert_same_state(rep, reference, *context):
    """Beside the parameters, report.json's `state_sha256`: the optimizer state (the same on
    every rank) and the data position equal the reference's; and each rank's random state where
    both runs ended with the same processes under the same strategy and neither recovered. The
    recipe loop reseeds every micro-batch from (run.seed, step, share, micro), so no random
    state is carried from one step to the next; a rank replaced after the last step (in the
    export) ends with the state its fresh process has, which no step will read."""
    if not (isinstance(rep, dict) and isinstance(reference, dict)
            and rep.get("state_sha256") and reference.get("state_sha256")):
        return
    got, want = rep["state_sha256"], reference["state_sha256"]
    said = (*context, rep.get("recoveries"), rep.get("failures"))
    assert len({s["optimizer"] for s in rep["state_sha256_by_rank"].values()}) == 1, said
    for part in ("optimizer", "data"):
        assert got[part] == want[part], (part, *said)
    same_processes = all(rep.get(k) == reference.get(k) for k in ("world_size", "strategy")) \
        and not any(r.get("shrinks") or r.get("recoveries") for r in (rep, reference))
    if same_processes:
        assert got["rng_by_rank"] == want["rng_by_rank"], ("rng", *said)


class References:
    """Failure-free runs, each trained once per session, keyed by what decides their bits."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._runs = {}

    def _get(self, key, make):
        if key not in self._runs:
            self._runs[key] = make(self._tmp.mktemp("ref"))
        return self._runs[key]

    def train(self, recipe, *overrides):
        """(out dir, report, CompletedProcess) of `recipe` with `overrides`, without spares."""
        def make(tmp):
            out, rep, r = train(tmp, "ref", recipe, *overrides, "checkpointless.spares=0")
            assert rep["recoveries"] == [] and rep["status"] == "ok", rep
            assert_replicas_agree(rep)
            return out, rep, r
        return self._get(("train", recipe, _key(overrides)), make)

    def supervised(self, argv, *options, nproc=4, env=None):
        """The report of `argv` under the supervisor, with `options` and `env`, without spares."""
        def make(tmp):
            rep = supervised(tmp, "ref", argv, *options, "--spares", "0", nproc=nproc, env=env)
            assert rep["recoveries"] == [] and rep["status"] == "ok", rep
            final_digest(rep)
            return rep
        key = ("supervised", tuple(map(str, argv)), _key(options), nproc,
               tuple(sorted((env or {}).items())))
        return self._get(key, make)


def _key(overrides) -> tuple:
    """Overrides as a key: in any order, and without the spares (they do not change the bits)."""
    return tuple(sorted(o for o in overrides if not str(o).startswith("checkpointless.spares=")))


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    return References(tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_llama_30_steps(references):
    """(out, report, CompletedProcess) of tiny-llama, 1 node x 4 workers, 30 steps, no failure."""
    return references.train("tiny-llama", *TINY_30)


@pytest.fixture(scope="session")
def tiny_llama_30_steps_digest(tiny_llama_30_steps):
    """The bits that several fault tests must end with."""
    return tiny_llama_30_steps[1]["params_sha256"]


@pytest.fixture(scope="session")
def fsdp_12_steps(references):
    """(output dir, report) of tiny-llama under fsdp, 4 workers, 12 steps, checkpoints every 4,
    no failure: the bits every fsdp fault test must end with, and the disk state the fallback
    and resume tests start from."""
    out, rep, _ = references.train("tiny-llama", *FSDP_12)
    assert rep["steps_completed"] == 12
    return out, rep


def assert_moved_or_hosted(rep, moved: set, processes: int) -> None:
    """The lost ranks went to the spare node (`moved`: cause, failed node, replacement node); or,
    when no spare was warm yet at the decision (the spare node's workers still importing on a
    loaded machine), ddp's default shrink (exact: the same bits) hosted them on the survivors
    and the job grew back to `processes` when the spare was ready."""
    recs = rep["recoveries"]
    if not any(r.get("shrunk") for r in recs):
        assert {(r["cause"], r["failed_node"], r["replacement_node"]) for r in recs} == moved
        return
    assert {(r["cause"], r["failed_node"]) for r in recs} == {m[:2] for m in moved}, recs
    assert rep["shrinks"] and rep["grows"][-1]["to_processes"] == processes, rep["grows"]
