"""A replacement rank 0 gives W&B the steps its predecessor logged but W&B never wrote.

W&B's local writer (wandb-core, a process of its own) writes the run's record to disk every few
seconds and, when the process that logs dies, exits without writing what it still holds: a
rank 0 killed mid-run loses its last steps from W&B, offline (where that record is all there is)
and online alike. The launcher writes every committed step to metrics.jsonl first, flushed, so
the replacement rank 0, before it logs its own first step, logs the steps W&B lacks from there:
  * online, W&B's resumed run says which step it expects next (`run.step`): every earlier step
    from metrics.jsonl that it lacks, none twice;
  * offline, the earlier offline records of the same run id, in `logging.dir`/wandb, say which
    steps they hold (read here: W&B ships no reader of its .wandb files in Python).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK = 32768  # the .wandb file's block size (a LevelDB-style log)
FIELDS = ("loss", "lr", "grad_norm", "tokens_per_s")  # what the loop logs per step


def offline_history(path: Path) -> list[dict]:
    """The history rows of an offline W&B run file: after a 7-byte header (":W&B", magic,
    version), protobuf records in chunks of <crc32, length, kind> headers in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb
    data, rows, pos, parts = path.read_bytes(), [], 7, b""
    if data[:4] != b":W&B":
        return rows
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header: padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0 or len(chunk) < length:  # the end of what was written
            break
        parts = chunk if kind in (1, 2) else parts + chunk  # full or first; middle or last
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(parts)
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                             for i in rec.history.item})
    return rows


def steps_held(run, logging_dir: str) -> set[int] | None:
    """The steps with a loss that W&B already holds for this run (None: cannot tell)."""
    if getattr(run.settings, "_offline", False):
        held = set()
        mine = Path(run.dir).resolve().parent  # this process's own offline-run folder
        for folder in Path(logging_dir, "wandb").glob(f"offline-run-*-{run.id}*"):
            if folder.resolve() == mine:
                continue
            for f in folder.glob("run-*.wandb"):
                held |= {int(r["_step"]) for r in offline_history(f) if "loss" in r}
        return held
    step = getattr(run, "step", None)
    return None if step is None else set(range(int(step)))


def refill(run, logging_dir: str, metrics_file: Path, first_step: int, before_step: int) -> int:
    """Log to `run` the steps of this launch (from `first_step`) below `before_step` that
    metrics.jsonl has and W&B lacks, in order; returns how many. Online, W&B holds every step
    below the one it expects, so only later ones are given (it refuses earlier ones)."""
    held = steps_held(run, logging_dir)
    if held is None or not metrics_file.exists():
        return 0
    lines = {}
    for line in metrics_file.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut by the kill
            continue
        if "step" in rec and first_step <= rec["step"] < before_step and \
                rec["step"] not in held:
            lines[rec["step"]] = rec
    for step in sorted(lines):
        run.log({k: lines[step][k] for k in FIELDS if k in lines[step]}, step=step, commit=True)
    return len(lines)
