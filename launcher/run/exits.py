"""The launcher's exit codes, and what a node agent's exit code says."""
from __future__ import annotations

from checkpointless.protocol import records

AgentExit = records.AgentExit

PREEMPTED = 143  # 128 + SIGTERM: stopped on request, resumable (checkpoint.resume=auto)


def node_exit_said(rc: int, coordinator_lost: str) -> str:
    """A node agent's exit code in words; `coordinator_lost` is how this launcher puts code 4."""
    said = {AgentExit.OK: "the job is over",
            AgentExit.FENCED: "this node was fenced (declared lost)",
            AgentExit.COORDINATOR_LOST: coordinator_lost}
    return said.get(rc, f"exit {rc}")
