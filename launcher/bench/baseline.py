"""The checkpoint-restart baseline: the training loop under torchrun, nothing else.

With failures it runs with `--max-restarts`: torchrun's agent sees a worker die, stops the others
and starts all of them again; they resume from the newest disk checkpoint
(`checkpoint.resume=auto`), written every tau steps, tau being Young's interval for the measured
save cost. Without failures (`off`) it is the reference speed.
"""
from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from launcher.bench.failures import Killer
from launcher.bench.model import young_interval_s


RECIPE_LOOP = "launcher.train.loop"
PLAIN_LOOP = "launcher.bench.plain_loop"  # the `plain` mode: torch's DDP or FSDP2, nothing else


def torchrun_cmd(cfg, out: Path, max_restarts: int, module: str = RECIPE_LOOP) -> list[str]:
    # a 0.1 s monitor interval: torchrun notices a dead worker as soon as it can
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(cfg.workers), "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
            "-m", module, str(out / "recipe.yaml")]


def tree_pids(root: int) -> list[int]:
    """`root` and every process below it."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            for t in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{t}/children") as f:
                    todo += [int(x) for x in f.read().split()]
        except OSError:
            continue
    return out


def torchrun_workers(agent_pid: int) -> dict[int, int]:
    """rank -> pid of the training workers torchrun's agent is running now."""
    out = {}
    for pid in tree_pids(agent_pid)[1:]:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"launcher.train.loop" in cmd:
            for e in env:
                if e.startswith(b"RANK="):
                    out[int(e[5:])] = pid
    return out


def run_torchrun(cfg, out: Path, killer_plan=None, steps: int = 0,
                 module: str = RECIPE_LOOP) -> tuple[int, list[dict], float]:
    """Run out/recipe.yaml under torchrun with `module` as the worker, killing workers on
    `killer_plan` if given; returns (exit code, kills, seconds)."""
    cmd = torchrun_cmd(cfg, out, cfg.max_restarts if killer_plan else 0, module)
    t0 = time.time()
    with open(out / "torchrun.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        killer = None
        if killer_plan:
            killer = Killer(out, lambda: torchrun_workers(proc.pid), killer_plan,
                            steps or cfg.steps)
            killer.start()
        try:
            rc = proc.wait(timeout=cfg.mode_timeout_s)
        except subprocess.TimeoutExpired:  # failures outpaced restarts: report what was done
            print(f"[bench] stopping after {cfg.mode_timeout_s:.0f} s: restarts cannot keep "
                  "up with the failures", flush=True)
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
        if killer:
            killer.stop.set()
            killer.join()
    return rc, (killer.kills if killer else []), time.time() - t0


def checkpoint_every(save_s: float, mtbf_s: float, step_s: float) -> int:
    """Young's interval in steps (at least one)."""
    return max(1, round(young_interval_s(save_s, mtbf_s) / step_s))


def measure_save_cost(rc_cfg, repeats: int = 5) -> float:
    """Seconds one synchronous checkpoint of this recipe's full state takes (model + AdamW)."""
    import tempfile

    import torch

    model, tok = recipe_model(rc_cfg)
    opt = torch.optim.AdamW(model.parameters())
    ids = torch.randint(0, len(tok), (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # so the optimizer state has its moments, as in a real checkpoint
    costs = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(repeats):
            t = time.time()
            # what a restart-based job's synchronous save does: the whole state, one file,
            # written to disk before training goes on
            path = os.path.join(d, f"step-{i:08d}.pt")
            with open(path, "wb") as f:
                torch.save({"step": i, "model": model.state_dict(),
                            "optimizer": opt.state_dict()}, f)
                f.flush()
                os.fsync(f.fileno())
            os.unlink(path)
            costs.append(time.time() - t)
    return statistics.median(costs)


def recipe_model(rc_cfg):
    """(model, tokenizer) as the recipe builds them, on the CPU of this process."""
    from omegaconf import OmegaConf

    from models import build_model, build_tokenizer
    tok = build_tokenizer(rc_cfg.tokenizer.kind, rc_cfg.tokenizer.id or rc_cfg.model.id)
    model = build_model(rc_cfg.model.name, rc_cfg.model.init, rc_cfg.model.id,
                        OmegaConf.to_container(rc_cfg.model.config), vocab_size=len(tok))
    return model, tok


def measure_grad_copy(rc_cfg, threads: int, repeats: int = 21) -> dict:
    """The copy the overlapped buckets no longer make, per worker and step.

    The old flat all-reduce summed a copy of the gradients and copied every parameter's slice of
    the sum back into its `.grad`; the buckets hand out views of the sum instead. What that saves
    is one pass over the gradients: trainable parameters x element size bytes (counted from the
    model), and the time of that copy-back, timed here as it was done (a `copy_` per parameter
    from one flat buffer) with a worker's thread count."""
    import torch
    model, _ = recipe_model(rc_cfg)
    grads = [torch.zeros_like(p) for p in model.parameters() if p.requires_grad]
    flat = torch.cat([g.reshape(-1) for g in grads])
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            times.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    return {"trainable_params": flat.numel(),
            "bytes_per_step": sum(g.numel() * g.element_size() for g in grads),
            "copy_s_median": round(statistics.median(times), 6)}


def measure_consistency(rc_cfg, threads: int, repeats: int = 21) -> dict:
    """What a replica consistency check costs a worker: the integer checksum of its parameters,
    timed here with a worker's thread count (the all-gather of one integer per rank after it is
    one small message), and that cost spread over `checkpointless.consistency_every` steps."""
    import torch

    from checkpointless.worker.consistency import params_checksum
    model, _ = recipe_model(rc_cfg)
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            params_checksum([model])
            times.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(before)
    every = int(rc_cfg.checkpointless.consistency_every)
    check = statistics.median(times)
    return {"every_steps": every, "check_s_median": round(check, 6),
            "per_step_s": round(check / every, 7) if every > 0 else 0.0}
