"""metrics.jsonl, the progress bar and the trackers, written by rank 0 (the recipe loop and the
torch-only baseline of the benchmark both use it)."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


class Metrics:
    """metrics.jsonl lines and the progress bar, written by rank 0 only. Given the loop's
    Accelerator, lines are printed and figures logged to the trackers through it; without one
    (the torch-only baseline, launcher/bench/plain_loop.py) lines are printed, nothing tracked."""

    def __init__(self, cfg, out_dir: Path, start_step: int, accelerator=None,
                 replacement: bool = False):
        self.cfg = cfg
        self.print = accelerator.print if accelerator is not None else print
        self.file = open(out_dir / "metrics.jsonl", "a")
        self.bar = None
        if cfg.trainer.progress_bar:
            from tqdm import tqdm
            self.bar = tqdm(total=cfg.trainer.max_steps, initial=start_step, unit="step",
                            dynamic_ncols=True, mininterval=1.0, file=sys.stdout)
        self.tokens_per_step = (cfg.trainer.micro_batch_size * cfg.trainer.grad_accum_steps *
                                cfg.data.seq_len * cfg.distributed.num_processes)
        self.window_t, self.window_steps = time.time(), 0
        self.trackers = None
        if cfg.logging.trackers and accelerator is not None:
            from launcher.train.trackers import Trackers
            self.trackers = Trackers(cfg, accelerator, replacement, out_dir / "metrics.jsonl")

    def step(self, step: int, loss: float, lr: float, grad_norm: float, t0: float, t1: float):
        self.window_steps += 1
        rec = {"step": step, "loss": round(loss, 6), "lr": lr, "grad_norm": round(grad_norm, 6),
               "t_start": round(t0, 6), "t_end": round(t1, 6)}
        if step % self.cfg.trainer.log_every == 0 or step == self.cfg.trainer.max_steps - 1:
            elapsed = time.time() - self.window_t
            rec["tokens_per_s"] = round(self.window_steps * self.tokens_per_step / elapsed, 1)
            self.window_t, self.window_steps = time.time(), 0
            if self.bar is None:
                self.print(f"step {step} loss {loss:.4f} lr {lr:.2e} "
                           f"tok/s {rec['tokens_per_s']:.0f}", flush=True)
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.trackers:
            self.trackers.log({k: rec[k] for k in ("loss", "lr", "grad_norm", "tokens_per_s")
                               if k in rec}, step)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{self.tokens_per_step / (t1 - t0):.0f}",
                                 refresh=False)

    def record(self, rec: dict) -> None:
        """A line that is not a step's (a validation result)."""
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.trackers:
            self.trackers.log({k: v for k, v in rec.items() if k != "eval_after_steps"},
                              rec["eval_after_steps"])
        line = (f"validation after {rec['eval_after_steps']} steps: loss {rec['eval_loss']:.4f}, "
                f"perplexity {rec['eval_ppl']:.2f} ({rec['eval_tokens']} tokens)")
        if self.bar is None:
            self.print(line, flush=True)
        else:
            self.bar.write(line)

    def replay(self, verdict: dict, step: int) -> None:
        """The replay check's verdict (checkpointless/worker/rehearsal.py), once, to the
        trackers: replay/replayable (1 or 0; not logged when unchecked) and replay/mismatches.
        (report.json's `replay` holds it whole; metrics.jsonl keeps to steps and evaluations.)"""
        if self.trackers and verdict.get("replayable") is not None:
            self.trackers.log({"replay/replayable": int(bool(verdict["replayable"])),
                               "replay/mismatches": len(verdict.get("mismatches") or [])}, step)

    def close(self):
        if self.trackers:
            self.trackers.finish()
        if self.bar is not None:
            self.bar.close()
        self.file.close()
