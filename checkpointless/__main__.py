"""Run any training script under the checkpointless supervisor.

    python -m checkpointless --nproc 4 --spares 1 [--fault kill:2:5] script.py [script args]

The script calls `checkpointless.join()` instead of `init_process_group`. The run's report (world
size, steps, recoveries, goodput, each rank's result) is printed and written to --report.
"""
from __future__ import annotations

import argparse
import json
import sys

from .faults import parse_faults
from .supervisor import JobFailed, Supervisor, SupervisorConfig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m checkpointless", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, required=True, help="active workers (the world size)")
    p.add_argument("--spares", type=int, default=1, help="hot spares started beside them")
    p.add_argument("--no-refill", action="store_true", help="do not replace a used spare")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0,
                   help="seconds of training-loop silence before a lagging worker is hung")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"])
    p.add_argument("--host", default="127.0.0.1", help="address of the coordination store")
    p.add_argument("--port", type=int, default=0, help="port of the store (0: any free one)")
    p.add_argument("--seed", type=int, default=0, help="base of the per-step seeds")
    p.add_argument("--fault", action="append", default=[], metavar="KIND:RANK:STEP",
                   help="inject a fault (kill, hang or raise); repeatable")
    p.add_argument("--report", default=None, help="write the JSON report here")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    try:
        faults = [f.__dict__ for f in parse_faults(a.fault)]
    except ValueError as exc:
        p.error(str(exc))
    if a.nproc < 1 or a.spares < 0:
        p.error(f"--nproc={a.nproc} must be >= 1 and --spares={a.spares} >= 0")
    cfg = SupervisorConfig(nproc=a.nproc, spares=a.spares, refill=not a.no_refill,
                           heartbeat_timeout_s=a.heartbeat_timeout, backend=a.backend,
                           host=a.host, port=a.port, seed=a.seed, faults=faults)
    try:
        report = Supervisor([sys.executable, a.script, *a.args], cfg).run()
    except JobFailed as exc:
        print(f"[checkpointless] job failed: {exc}", file=sys.stderr)
        return 1
    report.pop("step_times", None)
    text = json.dumps(report, indent=2)
    if a.report:
        with open(a.report, "w") as f:
            f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
