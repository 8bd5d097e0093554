"""A candidate for the coordinator's role under checkpointless.coordinator=etcd.

    python -m launcher.run.etcd_coordinator RECIPE_FILE NODE_ADDR      (started by launcher/run/etcd_node.py)

Every node's launcher starts one. It waits in the election (checkpointless/ha/leadership.py); the one
that holds the role runs the supervisor with its store on NODE_ADDR:distributed.master_port and
every node served by an agent: the job's start when etcd holds no generation yet, else a
takeover (checkpointless/control/takeover.py). It writes report.json as the job ends, with the
coordinator's moves, then says in etcd that the job is over (`done`), so that no candidate left
starts it again. A holder that loses its role (its lease
ran out: its node was cut off, or etcd lost its quorum) stops at once and writes nothing.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from omegaconf import OmegaConf


FIRST_HOLDER_WAIT_S = 10.0  # how long a candidate other than node 0's leaves it to start a job


def _wait_for_a_holder(role, timeout_s: float) -> None:
    """Until someone holds `role` (node 0's candidate, as a rule), or `timeout_s` passed."""
    from checkpointless.ha import EtcdError, EtcdUnavailable
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if role.holder()[0] is not None:
                return
        except (EtcdUnavailable, EtcdError):  # its members still forming a quorum
            pass
        time.sleep(0.2)


def main(argv: list[str]) -> int:
    recipe_file, addr = Path(argv[0]), argv[1]
    cfg = OmegaConf.load(recipe_file)
    d, c = cfg.distributed, cfg.checkpointless
    from checkpointless.ha import Etcd, JobFacts, Role

    from launcher.run.etcd_node import endpoints_of, prefix_of

    prefix = prefix_of(cfg)
    etcd = Etcd(endpoints_of(cfg), timeout_s=1.0)
    held: dict = {}  # the supervisor, once this node runs one

    def lost(why: str) -> None:
        print(f"[coordinator] node {d.node_rank} lost the coordinator's role: {why}",
              file=sys.stderr, flush=True)
        if held.get("sup") is not None:
            held["sup"].depose(why)
        else:
            os._exit(5)

    _stop_on_signals(held, d.node_rank)
    role = Role(etcd, f"{prefix}/coordinator",
                {"node": d.node_rank, "host": addr, "port": d.master_port},
                ttl_s=c.etcd.ttl_s, on_lost=lost)
    facts = JobFacts(etcd, prefix, role)
    if facts.known().done:  # this launch's job is over: its last coordinator said so
        return 0
    if facts.known().gen < 0 and d.node_rank > 0:
        # a new job: node 0's candidate first, so that the coordinator starts where users look
        # for it (any node takes it over later). The others wait for a holder, not a fixed
        # time: on a loaded machine node 0's first call to an etcd still forming took more than
        # the second it was given, and the job began on node 1 (seen in the tests). Node 0
        # missing at the start delays it by at most FIRST_HOLDER_WAIT_S
        _wait_for_a_holder(role, FIRST_HOLDER_WAIT_S + min(d.node_rank, 4) * 1.0)
    role.campaign()
    facts.taking.update(token=role.token, t_taken=role.taken_at)
    known = facts.known()
    if known.done:  # the role came free because the job ended
        role.resign()
        return 0
    return _run_as_holder(cfg, recipe_file, addr, role, facts, known.gen < 0,
                          on_supervisor=lambda s: held.__setitem__("sup", s))


def _run_as_holder(cfg, recipe_file: Path, addr: str, role, facts, fresh: bool,
                   on_supervisor) -> int:
    """Supervise the job while this node holds the role, then write its report."""
    from checkpointless.control import JobFailed, Supervisor

    from launcher.run.report import build_report, log, metrics_line
    from launcher.run.supervise import supervisor_config

    d = cfg.distributed
    out = Path(cfg.run.output_dir)
    print(f"[coordinator] node {d.node_rank} holds the coordinator's role (token {role.token})"
          f", its store on {addr}:{d.master_port}" + ("" if fresh else ": taking over"),
          flush=True)
    if fresh and cfg.checkpoint.resume != "auto":
        (out / "metrics.jsonl").write_text("")  # a new run starts a new metrics file
    sup_cfg = supervisor_config(cfg)
    sup_cfg.standalone, sup_cfg.host, sup_cfg.port = True, addr, d.master_port
    sup = Supervisor([sys.executable, "-m", "launcher.train.loop", str(recipe_file)], sup_cfg,
                     log=log, on_straggler=metrics_line(out), facts=facts)
    on_supervisor(sup)
    t0 = time.time()
    try:
        run = sup.run()
    except JobFailed as exc:
        if sup.deposed:
            print(f"[coordinator] node {d.node_rank} stopped, writing nothing: {exc}. If no "
                  "other node took over (etcd lost its quorum), resume from the newest durable "
                  "checkpoint with checkpoint.resume=auto", file=sys.stderr, flush=True)
            os._exit(5)
        print(f"[coordinator] run failed: {exc}. Resume from the newest durable checkpoint "
              "with checkpoint.resume=auto", file=sys.stderr, flush=True)
        if exc.report is not None:
            report = build_report(cfg, exc.report, t0, status="failed", error=str(exc))
            report["coordinator_moves"] = sup.moves
            (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        facts.finish(f"failed: {exc}")
        role.resign()
        return 1
    # every rank's result reached this coordinator's store: the job ended under it, even if
    # its lease lapses now (the launchers stop their etcd members as the job ends)
    if sup.moves and sup.moves[0].get("start"):  # after a takeover, wall_s from the launch
        t0 = min(t0, sup.moves[0].get("t_taken") or t0)
    preempted = sup.preempted_at is not None
    report = build_report(cfg, run, t0, status="preempted" if preempted else "ok")
    report["coordinator_moves"] = sup.moves
    outcome = "ok"
    if preempted:
        report["preempted"] = {"why": sup.stop_asked, "stopped_before_step": sup.preempted_at}
        outcome = f"preempted before step {sup.preempted_at} ({sup.stop_asked})"
    agree = len(set(report["params_sha256_by_rank"].values())) == 1
    if not agree:
        report.update(status="failed", error="ranks ended with different params_sha256")
        outcome = "failed: replicas disagree"
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"[coordinator] done: {report['steps_completed']} steps, params_sha256 "
          f"{str(report['params_sha256'])[:16]}, {len(sup.moves) - 1} coordinator move(s)"
          + (f", {outcome}" if preempted else "") + f", report {out / 'report.json'}",
          flush=True)
    facts.finish(outcome)  # every node's launcher reads it: 143 when preempted
    role.resign()
    return 0 if agree else 1


def _stop_on_signals(held: dict, node: int) -> None:
    """SIGTERM or SIGINT reaching the candidate itself (a preemption that signals every
    process of the job, or one sent to it by hand) stops the job at a step boundary, as one
    reaching its launcher does; a candidate that does not coordinate leaves it to its
    launcher, whose agent asks the coordinator."""
    def handler(sig, _frame):
        if held.get("sup") is not None:
            held["sup"].request_stop(f"{signal.Signals(sig).name} on node {node}")

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except BaseException:  # noqa: BLE001  said here: the exit below would swallow it
        import traceback
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # threads blocked in the store must not be unwound at exit
