import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # before any Hugging Face import: nothing is downloaded
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


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


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama_30_steps_digest(tmp_path_factory):
    """params_sha256 of tiny-llama, 1 node x 4 workers, 30 steps, no failure: the bits that
    several fault tests must end with (trained once per session)."""
    import json
    import subprocess
    out = tmp_path_factory.mktemp("tiny-llama-30")
    r = subprocess.run([sys.executable, "-m", "launcher", "train", "tiny-llama",
                        "checkpointless.spares=0", "trainer.max_steps=30",
                        "trainer.progress_bar=false", f"run.output_dir={out / 'out'}",
                        f"data.cache_dir={out / 'cache'}"], cwd=ROOT,
                       env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((out / "out" / "report.json").read_text())["params_sha256"]


FSDP_12 = ("distributed.strategy=fsdp", "trainer.max_steps=12", "checkpoint.interval=4",
           "checkpoint.keep=3")


@pytest.fixture(scope="session")
def fsdp_12_steps(tmp_path_factory):
    """(output dir, report) of tiny-llama under fsdp, 4 workers, 12 steps, checkpoints every 4,
    no failure: the bits every fsdp fault test must end with (trained once per session), and
    the disk state the fallback and resume tests start from."""
    from tests.test_train_e2e import assert_replicas_agree, train
    tmp = tmp_path_factory.mktemp("fsdp_ref")
    out, rep, _ = train(tmp, "ref", "tiny-llama", *FSDP_12, "checkpointless.spares=0")
    assert_replicas_agree(rep)
    assert rep["steps_completed"] == 12
    return out, rep
