"""Measure what a failure at each start-up phase and inside each recovery phase costs, for
docs/recovery.md: tiny-llama, 4 workers, spares as needed, one run per line.

    HF_HUB_OFFLINE=1 .venv/bin/python tests/support/scripts/measure_clustered.py OUT_DIR

Each line: the case, whether the run ended with the failure-free bits, and for each recovery the
failed rank, the step it resumed at, where the state came from, and its phases (seconds).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from tests.conftest import FSDP_12, final_digest, train  # noqa: E402
from tests.scenarios.test_startup_kills import FRESH, train_killing_at_start  # noqa: E402

DDP_12 = ("trainer.max_steps=12",)


def line(name: str, rep: dict, want: str) -> str:
    same = "same bits" if final_digest(rep) == want else "DIFFERENT BITS"
    recs = "; ".join(
        f"rank {r['failed_rank']} -> step {r['resumed_step']} from {r['restored_from']}: "
        f"{r['recovery_s']:.2f} s (detect {r['phases_s']['detection']:.2f}, spare wait "
        f"{r['phases_s']['spare_wait']:.2f}, regroup {r['phases_s']['regroup']:.2f}, transfer "
        f"{r['phases_s']['state_transfer']:.2f}, resume {r['phases_s']['resume']:.2f})"
        for r in rep["recoveries"])
    return f"{name}: {rep['status']}, {same}; {recs}"


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    refs = {}
    for kind, runs in (("ddp", DDP_12), ("fsdp", FSDP_12)):
        _, rep, _ = train(out / "ref", kind, "tiny-llama", *runs, "checkpointless.spares=0")
        refs[kind] = final_digest(rep)
    injected = [
        ("ddp", "kill:2:0@init", 1), ("ddp", "kill:1:0@join", 1),
        ("fsdp", "kill:2:0@init", 1), ("fsdp", "kill:1:0@join", 1),
        ("ddp", "kill:2:6,kill:1:6@regroup", 2), ("ddp", "kill:2:6,kill:1:6@join", 2),
        ("ddp", "kill:2:6,kill:2:6@receive", 2), ("ddp", "kill:2:6,kill:0:6@send", 2)]
    for i, (kind, faults, spares) in enumerate(injected):
        runs = DDP_12 if kind == "ddp" else FSDP_12
        _, rep, _ = train(out, f"f{i}", "tiny-llama", *runs, f"faults=[{faults}]",
                          f"checkpointless.spares={spares}")
        print(line(f"{kind} faults=[{faults}]", rep, refs[kind]), flush=True)
    for i, (kind, delay) in enumerate([("ddp", 0.3), ("ddp", 4.0), ("fsdp", 4.0)]):
        runs = DDP_12 if kind == "ddp" else FSDP_12
        rep, steps, _ = train_killing_at_start(out, f"k{i}", 2, delay, *runs,
                                               "checkpointless.spares=1", env=FRESH)
        print(line(f"{kind} fresh worker 2 SIGKILLed {delay} s after it appeared "
                   f"({steps} steps logged)", rep, refs[kind]), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
