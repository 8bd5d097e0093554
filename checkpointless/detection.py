"""Failure detection: telling a dead or hung peer from a slow one.

Three signals, fastest first:
  * a worker process exits: the supervisor sees it at once (it sleeps on the processes' pidfds);
  * a survivor's collective fails because a peer vanished: gloo reports it at once, and the
    survivor learns from the supervisor's record that a peer was lost (see failures.py);
  * a worker hangs (alive, not progressing): its training-loop heartbeat goes silent. Silence alone
    is not proof, since healthy workers blocked in a collective with the hung one go silent too, so
    a silent worker is declared hung only when it is behind the others or its process is stopped.
"""
from __future__ import annotations

import json
import time

from . import protocol


def beat(store, worker_id: int, step: int, gen: int, phase: str) -> None:
    store.set(protocol.heartbeat_key(worker_id),
              json.dumps({"t": time.time(), "step": step, "gen": gen, "phase": phase}))


def read_beat(store, worker_id: int):
    key = protocol.heartbeat_key(worker_id)
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
    """Workers silent longer than `timeout_s` that are stopped, or behind while the whole job
    has stalled.

    `beats` maps worker id to its last heartbeat ({t, step, ...}); workers with no beat yet are
    still warming up and are not judged. A worker beats at the start of each step, so in lockstep
    one rank may be a beat ahead of another for a whole step: "behind" means something only once
    every worker has been silent past the timeout (a stalled job), never while a step merely
    takes longer than the timeout (a large model, a loaded machine).
    """
    now = time.time() if now is None else now
    live = {w: b for w, b in beats.items() if b is not None and b.get("phase") != "done"}
    if not live:
        return []
    silent = {w for w, b in live.items() if now - b["t"] > timeout_s}
    stalled = silent == set(live)
    lead = max(b["step"] for b in live.values())
    return [w for w in sorted(silent)
            if process_stopped(pids.get(w, -1)) or (stalled and live[w]["step"] < lead)]
