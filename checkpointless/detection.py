"""Failure detection: telling a dead or hung peer from a bug of one's own.

Three signals, fastest first:
  * a worker process exits: the supervisor sees it at its next poll (tens of milliseconds);
  * a survivor's collective fails because a peer vanished: gloo reports it at once;
  * a worker hangs (alive, not progressing): its training-loop heartbeat goes silent. Silence alone
    is not proof, since healthy workers blocked in a collective with the hung one go silent too, so
    a silent worker is declared hung only when it is behind the others or its process is stopped.
"""
from __future__ import annotations

import json
import time

# Text that the gloo and NCCL backends put in the errors raised when a peer vanished or the group
# was aborted. A collective failing for any of these reasons means "a peer died", not "I am broken".
_PEER_FAILURE_MARKERS = (
    "gloo", "nccl", "connection reset", "connection closed", "connection refused", "broken pipe",
    "socket timeout", "timed out", "abort", "processgroup", "peer",
)


def is_peer_failure(exc: BaseException) -> bool:
    try:
        import torch.distributed as dist
        if isinstance(exc, dist.DistError):
            return True
    except Exception:  # pragma: no cover - torch without distributed
        pass
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(m in text for m in _PEER_FAILURE_MARKERS)


def beat(store, worker_id: int, step: int, gen: int, phase: str) -> None:
    store.set(f"hb/{worker_id}", json.dumps({"t": time.time(), "step": step, "gen": gen,
                                             "phase": phase}))


def read_beat(store, worker_id: int):
    key = f"hb/{worker_id}"
    return json.loads(store.get(key)) if store.check([key]) else None


def process_stopped(pid: int) -> bool:
    """True when the process is stopped (SIGSTOP, a debugger, a frozen container)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state in ("T", "t")
    except (OSError, IndexError):
        return False


def find_hung(beats: dict[int, dict], pids: dict[int, int], timeout_s: float,
              now: float | None = None) -> list[int]:
    """Workers silent longer than `timeout_s` that are behind the others or stopped.

    `beats` maps worker id to its last heartbeat ({t, step, ...}); workers with no beat yet are
    still warming up and are not judged.
    """
    now = time.time() if now is None else now
    live = {w: b for w, b in beats.items() if b is not None}
    if not live:
        return []
    lead = max(b["step"] for b in live.values())
    hung = []
    for w, b in live.items():
        if now - b["t"] <= timeout_s or b.get("phase") == "done":
            continue
        if b["step"] < lead or process_stopped(pids.get(w, -1)):
            hung.append(w)
    return hung
