"""The environment of a worker process: the variables the supervisor sets as it starts one, and
the readers a worker uses (after a fork too) to find its store, its node, its device and its place.

Part of the protocol (keys.py re-exports every name here, so `protocol.worker_env` and
`protocol.keys.ENV_SPARE` read as before); the store's keys stay in keys.py."""
from __future__ import annotations

import os

# ---- what the supervisor sets for each process it starts --------------------------------------
ENV_PRELOAD = "CHECKPOINTLESS_FORKSERVER"  # "MODULE:FUNCTION"; unset, "" or "0": no fork server
ENV_ETCD = "CHECKPOINTLESS_ETCD"  # the etcd binary to run (unset: the one on PATH)
ENV_PREFIX = "CL_"  # every per-worker variable below starts with it (read after a fork)
ENV_STORE_HOST = "CL_STORE_HOST"  # address of the coordination store
ENV_STORE_PORT = "CL_STORE_PORT"  # its port
ENV_WORKER_ID = "CL_WORKER_ID"  # this process's id, unique over the job (spares included)
ENV_DEVICE_SLOT = "CL_DEVICE_SLOT"  # local device index; a replacement takes the lost one's slot
ENV_SPARE = "CL_SPARE"  # "1" in a process started as a hot spare
ENV_NODE = "CL_NODE"  # the node the process runs on
ENV_NODE_STORE_PORT = "CL_NODE_STORE_PORT"  # its node store on 127.0.0.1 (unset: the main store)


# ---- the worker's readers, and the environment it is started with ----------------------------
def worker_env(host: str, port: int, wid: int, slot: int, spare: bool, node: int = 0,
               node_store_port: int = 0) -> dict[str, str]:
    env = {ENV_STORE_HOST: host, ENV_STORE_PORT: str(port), ENV_WORKER_ID: str(wid),
           ENV_DEVICE_SLOT: str(slot), ENV_SPARE: "1" if spare else "0", ENV_NODE: str(node)}
    if node_store_port:
        env[ENV_NODE_STORE_PORT] = str(node_store_port)
    return with_worker_defaults(env)


def with_worker_defaults(env: dict) -> dict:
    """`env` with what every worker's environment gets unless the launcher's own sets it.

    torch's C++ side prints a 30-line stack for every store connection a failure closes (a lost
    peer, a group cut short, a partition), each handled and said in one line here;
    TORCH_CPP_LOG_LEVEL=WARNING shows them again. torch reads it once, as it loads: a fork
    server (forkserver.py) gets these defaults too, so that a worker's environment differs
    from its only in the per-worker keys (else a first worker starts a server of its own)."""
    if "TORCH_CPP_LOG_LEVEL" not in os.environ:
        env = {**env, "TORCH_CPP_LOG_LEVEL": env.get("TORCH_CPP_LOG_LEVEL", "ERROR")}
    return env


def supervised() -> bool:
    return ENV_STORE_HOST in os.environ


def device_slot() -> int:
    return int(os.environ.get(ENV_DEVICE_SLOT, "0"))


def started_as_spare() -> bool:
    return os.environ.get(ENV_SPARE) == "1"


def node_id() -> int:
    return int(os.environ.get(ENV_NODE, "0"))


def node_store_address(host: str, port: int, node_port: int) -> tuple[str, int]:
    """Where a worker finds its node's store: its agent serves it on loopback (node_port); on
    the coordinator's own node there is none, and the main store at host:port serves."""
    return ("127.0.0.1", node_port) if node_port else (host, port)


def node_store_port() -> int:
    """The port of this node's store on 127.0.0.1; 0 where the main store serves the node."""
    return int(os.environ.get(ENV_NODE_STORE_PORT, "0"))


def placement_env(spec, rank: int, world_size: int) -> dict[str, str]:
    """What tools built on torch.distributed read from the environment (accelerate), as
    this job places the process: RANK and WORLD_SIZE are the job's; LOCAL_RANK counts the
    node's active ranks (a spare that took over a node's first rank is its local main
    process, whatever device slot it holds) and LOCAL_WORLD_SIZE is their number. The group
    exists already: MASTER_ADDR only satisfies a multi-node check."""
    per_node = max(1, spec.ranks_per_node)
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size),
           "LOCAL_RANK": str(rank % per_node), "LOCAL_WORLD_SIZE": str(per_node)}
    if "MASTER_ADDR" not in os.environ:
        env["MASTER_ADDR"] = os.environ.get(ENV_STORE_HOST, "127.0.0.1")
    return env


__all__ = [n for n in dir() if not n.startswith("_") and n not in ("annotations", "os")]
