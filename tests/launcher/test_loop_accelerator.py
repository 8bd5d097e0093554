"""The recipe loop's Accelerator (launcher/train/accelerator.py), built the way a worker builds it: on a
process group that exists already (join formed it), in a fresh process, fast."""
import json
import os
import subprocess
import sys

from tests.conftest import ROOT

# a worker's start, in a fresh process: the recipe (sys.argv[3]: its thread count), set-up, and
# the process group join would have formed
PREAMBLE = r"""
import json, sys, types, torch, torch.distributed as dist
from launcher.recipe.load import load
from launcher.train.model_setup import setup
cfg = load("tiny-llama", ["distributed.threads_per_worker=" + sys.argv[3],
                          "distributed.num_processes=2", "trainer.precision=bf16",
                          "trainer.grad_accum_steps=3", "run.output_dir=" + sys.argv[1]])
_, device = setup(cfg)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0,
                        world_size=1)
"""

WORKER = PREAMBLE + r"""

class Job:  # what build_accelerator reads of a supervised job
    rank, world_size, is_replacement = 0, 1, False

    def process_env(self):  # as checkpointless.Job places rank 0 of 2 on one node
        return {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1"}

from launcher.train.accelerator import Autocast, build_accelerator, start_line
acc = build_accelerator(cfg, Job(), device)
autocast = Autocast(acc)
dtypes = []
for _ in range(2):  # reusable, as launcher/train/evaluate.py uses it
    with autocast:
        dtypes.append(str(torch.nn.Linear(4, 4)(torch.ones(1, 4)).dtype))
print(json.dumps({"threads": torch.get_num_threads(), "device": str(acc.device),
                  "mixed_precision": acc.mixed_precision, "dtypes": dtypes,
                  "accum": acc.gradient_accumulation_steps, "main": acc.is_main_process,
                  "scaler": acc.scaler is not None, "line": start_line(cfg, acc)}))
"""


def run_worker(code: str, tmp_path, threads: int) -> dict:
    """Run `code` (PREAMBLE + what it checks) in a fresh process on a free port, without the
    launcher's variables; the JSON of its last line."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK",
                                                           "WORLD_SIZE", "LOCAL_RANK")}
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(port), str(threads)],
                       cwd=ROOT, env=dict(env, PYTHONPATH=str(ROOT)), capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_accelerator_uses_the_existing_group_and_keeps_the_workers_threads(tmp_path):
    got = run_worker(WORKER, tmp_path, threads=2)
    # accelerate, with OMP_NUM_THREADS unset, would have set cores / local processes = 1
    assert got["threads"] == 2
    assert got["device"] == "cpu" and got["mixed_precision"] == "bf16" and got["main"]
    assert got["dtypes"] == ["torch.bfloat16", "torch.bfloat16"]
    assert got["accum"] == 3 and not got["scaler"]
    # checkpointless.shrink=auto is exact under ddp: every reduction by logical rank
    assert "averaged by checkpointless over the logical ranks in one fixed order" in got["line"]
