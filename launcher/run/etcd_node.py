"""Every node's launcher under checkpointless.coordinator=etcd: no node is special.

Each launcher
1. starts its embedded etcd member (nodes 0, 1 and 2, when no cluster of the user's is named),
   its data under the run's output folder, and waits for etcd's quorum;
2. starts a candidate for the coordinator's role (`python -m launcher.run.etcd_coordinator`), which
   waits in the election (leadership.py) and, once it holds the role, runs the supervisor: at
   first the job's start, later a takeover (checkpointless/control/takeover.py);
3. serves as its node's agent (checkpointless/control/agent.py), reaching the coordinator's store through
   its door (store_door.py), which `role_watch.py` points at each new holder; its workers are
   given the door's port as the coordinator's, so that a move is only a pause to them.
Everything it starts dies with it (PR_SET_PDEATHSIG): a launcher SIGKILLed leaves nothing behind.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from checkpointless.ha import member as etcd_member
from checkpointless.protocol import membership
from checkpointless.control import NodeAgent
from checkpointless.ha import Etcd, EtcdError, EtcdUnavailable, parse_endpoints
from checkpointless.ha import MemberSpec
from checkpointless.control import start_process, stop_all
from checkpointless.ha import RoleWatch
from checkpointless.ha import StoreDoor

from launcher.run.exits import PREEMPTED, node_exit_said
from launcher.recipe.load import RecipeError


def prefix_of(cfg) -> str:
    """The job's keys in etcd: the recipe's, else one per run (and per Slurm job)."""
    e = cfg.checkpointless.etcd
    if e.prefix:
        return e.prefix.rstrip("/")
    job = os.environ.get("SLURM_JOB_ID")
    return f"/checkpointless/{cfg.run.name}" + (f"/{job}" if job else "")


def member_specs(cfg) -> list[MemberSpec]:
    """The embedded members: one on each of nodes 0, 1 and 2."""
    e = cfg.checkpointless.etcd
    hosts = [h.strip() for h in e.member_hosts.split(",") if h.strip()]
    if not hosts:
        from launcher.recipe.cluster_env import expand_nodelist
        hosts = expand_nodelist(os.environ.get("SLURM_JOB_NODELIST", ""))[:3]
    if len(hosts) != 3:
        raise RecipeError(f"checkpointless.etcd.member_hosts={e.member_hosts!r}: the embedded "
                          "etcd needs the addresses of nodes 0, 1 and 2")
    return [MemberSpec(f"node{i}", h, e.client_port, e.peer_port) for i, h in enumerate(hosts)]


def endpoints_of(cfg) -> list[str]:
    e = cfg.checkpointless.etcd
    if e.endpoints:
        return parse_endpoints(e.endpoints)
    return [m.client_url for m in member_specs(cfg)]


def own_address(cfg, endpoints: list[str]) -> str:
    """Where this node's store listens if it coordinates: the recipe's, else the address this
    node reaches etcd from (no packet is sent: a UDP socket only picks its route)."""
    if cfg.checkpointless.etcd.node_addr:
        return cfg.checkpointless.etcd.node_addr
    host = endpoints[0].split("://", 1)[-1].rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def start_member(cfg, out: Path) -> etcd_member.Kept | None:
    """This node's embedded member (nodes 0..2 without endpoints of the user's), its data a new
    cluster's under the output folder, started again if it stops (a preemption's SIGTERM)."""
    d, e = cfg.distributed, cfg.checkpointless.etcd
    if e.endpoints or d.node_rank >= 3:
        return None
    members = member_specs(cfg)
    me = members[d.node_rank]
    data = out / "etcd" / me.name
    shutil.rmtree(data, ignore_errors=True)  # a new launch is a new cluster
    print(f"[launcher] node {d.node_rank}: etcd member {me.name} on {me.host} "
          f"(clients :{me.client_port}, peers :{me.peer_port}), data in {data}", flush=True)
    return etcd_member.Kept(lambda: etcd_member.start(
        me, members, str(data), token=f"{cfg.run.name}-{d.master_port}",
        log_path=str(out / "etcd" / f"{me.name}.log")),
        log=lambda m: print(f"[launcher] node {d.node_rank}: {m}", file=sys.stderr, flush=True))


def run_node(cfg, recipe_file: Path, out: Path) -> None:
    """This node's launcher under coordinator=etcd; exits the process with 0 once the job is
    over, 143 when it was preempted (as `launcher train` does), 1 otherwise."""
    d, c = cfg.distributed, cfg.checkpointless
    k = d.node_rank
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    member = start_member(cfg, out)
    endpoints = endpoints_of(cfg)
    try:
        etcd_member.wait_healthy(endpoints, timeout_s=c.spare_wait_s)
    except TimeoutError as exc:
        say(f"[launcher] node {k}: {exc}")
        os._exit(1)
    addr = own_address(cfg, endpoints)
    etcd = Etcd(endpoints, timeout_s=1.0)
    why = ended_job(cfg, etcd)
    if why:
        say(f"[launcher] node {k}: {why}")
        _stop(member)
        os._exit(1)
    door = StoreDoor(log=say)
    candidate = start_process([sys.executable, "-m", "launcher.run.etcd_coordinator",
                               str(recipe_file), addr], dict(os.environ))
    agent = None

    def end(code: int, why: str) -> None:
        """Fenced, or cut off from etcd for good: stop everything here, whatever the agent's
        loop is blocked in."""
        say(f"[launcher] node {k}: {why}; stopping this node's processes. Resume from the "
            "newest durable checkpoint (checkpoint.resume=auto) if the job stopped")
        if agent is not None:
            stop_all(list(agent.workers.values()), grace_s=5.0)
        _stop(candidate, member)
        os._exit(1)

    watch = RoleWatch(etcd, prefix_of(cfg), k, door, give_up_s=c.node_timeout_s +
                      c.etcd.ttl_s + 5, log=say, on_end=end)
    per_node = d.num_processes // d.num_nodes
    here = per_node + (0 if k >= d.num_nodes else c.spares)
    print(f"[launcher] {cfg.run.name}: node {k} ({here} processes), coordinator chosen "
          f"through etcd at {','.join(endpoints)}", flush=True)
    store = membership.connect("127.0.0.1", door.port, timeout_s=120.0)
    agent = NodeAgent(store, k, [sys.executable, "-m", "launcher.train.loop", str(recipe_file)],
                      dict(os.environ), "127.0.0.1", door.port, c.node_timeout_s, log=say,
                      role_watch=watch)
    rc = agent.run(here)
    watch.stop()  # the job is over here: etcd's members going away now is no news
    if (watch.holder or {}).get("node") != k:  # a candidate only: nothing left for it to do
        _stop(candidate)
    why = node_exit_said(rc, "nothing can coordinate this node any more")
    # the coordinator, if it runs here, writes the report as the job ends: give it the time;
    # how it ended comes from etcd, while this node's member still helps its quorum answer
    outcome = _outcome(etcd, cfg, wait_s=30 if rc == 0 else 0)
    preempted = rc == 0 and outcome.startswith("preempted")
    print(f"[launcher] node {k}: {why}" + (f" ({outcome}; continue with "
                                           "checkpoint.resume=auto)" if preempted else ""),
          flush=True)
    deadline = time.time() + (30 if rc == 0 else 2)
    while candidate.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    if member is not None and rc == 0:
        time.sleep(1.0)  # the nodes without a member read the outcome before quorum goes
    _stop(candidate, member)
    sys.stderr.flush()
    os._exit(PREEMPTED if preempted else 0 if rc == 0 else 1)


def ended_job(cfg, etcd) -> str | None:
    """Why this launch cannot start under the job's prefix, or None. An earlier launch that
    ended (its `done` key) is cleared when this one resumes from its checkpoint
    (checkpoint.resume=auto): a preempted job is resubmitted under the same prefix (the same
    run, and under Slurm the same job id). Every node clears it in one transaction that holds
    only while `done` is the one it read, so a node arriving late deletes nothing the new job
    wrote."""
    prefix = prefix_of(cfg)
    done = etcd.get(prefix + "/done")
    if done is None:
        return None
    if cfg.checkpoint.resume == "auto":
        etcd.delete_prefix_if(prefix + "/", prefix + "/done", done.value)
        return None
    return (f"the job under checkpointless.etcd.prefix={prefix} in etcd is over "
            f"({done.value.decode()}): continue it with checkpoint.resume=auto, set "
            "checkpointless.etcd.prefix to a new one for a new launch, or remove the old keys "
            "(etcdctl del --prefix PREFIX)")


def _outcome(etcd, cfg, wait_s: float) -> str:
    """How the job ended, as its last coordinator wrote in etcd (`done`): "ok", "preempted
    ...", "failed: ..."; "" when it is not said within wait_s (or etcd does not answer)."""
    deadline = time.time() + wait_s
    while True:
        try:
            done = etcd.get(prefix_of(cfg) + "/done")
            if done is not None:
                return done.value.decode()
        except (EtcdUnavailable, EtcdError):
            pass
        if time.time() >= deadline:
            return ""
        time.sleep(0.2)


def _stop(*procs) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
