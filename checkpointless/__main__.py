"""Run any training script under the checkpointless supervisor.

    python -m checkpointless --nproc 4 --spares 1 [--fault kill:2:5] script.py [script args]

The script calls `checkpointless.join()` instead of `init_process_group`. The run's report (world
size, steps, recoveries, goodput, each rank's result) is printed and written to --report.
"""
from __future__ import annotations

import argparse
import json
import sys

from .protocol.faults import FaultError, parse_fault
from .protocol import DEFAULTS
from .control.supervisor import JobFailed, Supervisor, SupervisorConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m checkpointless", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, required=True, help="active workers (the world size)")
    p.add_argument("--spares", type=int, default=DEFAULTS.spares,
                   help="hot spares started beside them")
    p.add_argument("--no-refill", action="store_true", help="do not replace a used spare")
    p.add_argument("--heartbeat-timeout", type=float, default=DEFAULTS.heartbeat_timeout_s,
                   dest="heartbeat_timeout_s", metavar="HEARTBEAT_TIMEOUT",
                   help="seconds of training-loop silence before a lagging worker is hung")
    p.add_argument("--spare-wait", type=float, default=DEFAULTS.spare_wait_s,
                   dest="spare_wait_s", metavar="SPARE_WAIT",
                   help="seconds a lost rank may wait for a spare to warm up before the run stops")
    p.add_argument("--max-replacement-failures", type=int,
                   default=DEFAULTS.max_replacement_failures,
                   help="replacements of one rank dying before their first step, in a row, "
                        "before the run stops")
    p.add_argument("--consistency-every", type=int, default=DEFAULTS.consistency_every,
                   help="steps between checks that all replicas hold the same parameters "
                        "(0: only at the end)")
    p.add_argument("--audit-every", type=int, default=DEFAULTS.audit_every,
                   help="steps between audits: an idle spare replays one sampled rank's step "
                        "and compares its gradients (the script passes join(replay=...)); a "
                        "rank found wrong is evicted and the job rewinds to a durable checkpoint "
                        "(0: off)")
    p.add_argument("--replay-check", default=DEFAULTS.replay_check, dest="replay_check",
                   choices=["warn", "strict", "off"],
                   help="the replay rehearsal: the second step is run twice from the same state "
                        "and compared bit for bit; a difference (the script's step cannot be "
                        "redone exactly, so a recovery would change the bits) is said (warn) or "
                        "stops the run (strict); off: not checked")
    p.add_argument("--straggler-action", default=DEFAULTS.straggler_action,
                   choices=["evict", "report", "off"],
                   help="a rank slower than its peers: a ready spare takes it (evict), it is "
                        "only said (report), or nothing is judged (off)")
    p.add_argument("--straggler-factor", type=float, default=DEFAULTS.straggler_factor,
                   help="own time per step above this times the peers' median is slow")
    p.add_argument("--straggler-window", type=int, default=DEFAULTS.straggler_window,
                   help="consecutive slow steps before a rank is a straggler")
    p.add_argument("--health-command", default=None, metavar="COMMAND",
                   help="a node check run in each spare before it takes a rank (and every 10 s "
                        "while it waits): a non-zero exit keeps the spare from being promoted")
    p.add_argument("--metrics-port", type=int, default=0, metavar="PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (goodput, steps, "
                        "recoveries by cause and phase, spares, stragglers; needs "
                        "prometheus_client); 0: off")
    p.add_argument("--backend", default=DEFAULTS.backend, choices=["gloo", "nccl"])
    p.add_argument("--host", default="127.0.0.1", help="address of the coordination store")
    p.add_argument("--port", type=int, default=0, help="port of the store (0: any free one)")
    p.add_argument("--seed", type=int, default=0, help="base of the per-step seeds")
    p.add_argument("--fault", action="append", default=[], metavar="KIND:RANK:STEP[@PHASE]",
                   help="inject a fault (kill, hang, raise, corrupt) at a phase of the step "
                        "(step, backward, optimizer, random[:SEED], exchange, regroup, receive), "
                        "or slow:RANK:STEP[:FACTOR] (that rank's steps take FACTOR times as "
                        "long from STEP on); repeatable")
    p.add_argument("--report", default=None, help="write the JSON report here")
    p.add_argument("script")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return p


def _checked(p: argparse.ArgumentParser, argv) -> tuple[argparse.Namespace, list[dict]]:
    """The options, refused with the option, its value and the fix before any worker starts."""
    a = p.parse_args(argv)
    faults = []
    for text in a.fault or []:
        try:
            faults.append(parse_fault(text).__dict__)
        except FaultError as exc:  # its values: said with the fault as typed (there may be many)
            p.error(f"--fault {text}: {str(exc).removeprefix('faults: ')}")
        except ValueError as exc:  # its form: split_fault's message already quotes it
            p.error(str(exc))
    if a.straggler_factor <= 1 or a.straggler_window < 1:
        p.error(f"--straggler-factor={a.straggler_factor:g} must be > 1 and "
                f"--straggler-window={a.straggler_window} >= 1")
    if a.metrics_port:
        import importlib.util
        if importlib.util.find_spec("prometheus_client") is None:
            p.error(f"--metrics-port={a.metrics_port} needs the prometheus_client package: "
                    "pip install prometheus_client (or leave --metrics-port out)")
    if a.nproc < 1 or a.spares < 0:
        p.error(f"--nproc={a.nproc} must be >= 1 and --spares={a.spares} >= 0")
    return a, faults


def main(argv=None) -> int:
    a, faults = _checked(_parser(), argv)
    # every option under its field's name (nproc, spares, heartbeat_timeout_s, backend, ...)
    cfg = SupervisorConfig.of(vars(a), refill=not a.no_refill, faults=faults,
                              health={"command": a.health_command} if a.health_command else {})
    try:
        report = Supervisor([sys.executable, a.script, *a.args], cfg).run()
    except JobFailed as exc:
        print(f"[checkpointless] job failed: {exc}", file=sys.stderr)
        if a.report and exc.report is not None:
            exc.report.pop("step_times", None)
            with open(a.report, "w") as f:
                f.write(json.dumps(dict(exc.report, status="failed", error=str(exc)),
                                   indent=2) + "\n")
        return 1
    report.pop("step_times", None)
    agree = len({r.get("params_sha256") for r in report["results_by_rank"].values()}) <= 1
    text = json.dumps(dict(report, status="ok" if agree else "replicas_disagree"), indent=2)
    if a.report:
        with open(a.report, "w") as f:
            f.write(text + "\n")
    print(text)
    if not agree:  # replicas that drifted apart are never a success
        print("[checkpointless] ERROR: ranks ended with different params_sha256", file=sys.stderr)
        return 1
    replay = report.get("replay") or {}
    if replay.get("replayable") is False:  # never said to equal a run without failures
        print("[checkpointless] the bits of this run are NOT guaranteed to equal a run without "
              f"failures: {replay['reason']} (report: replay)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
