"""Failure detection: telling a dead or hung peer from a slow one.

Three signals, fastest first:
  * a worker process exits: the supervisor sees it at once (it sleeps on the processes' pidfds);
  * a survivor's collective fails because a peer vanished: gloo reports it at once, and the
    survivor learns from the supervisor's record that a peer was lost (see failures.py);
  * a worker hangs (alive, not progressing): its training-loop heartbeat goes silent. Silence alone
    is not proof, since healthy workers blocked in a collective with the hung one go silent too, so
    a silent worker is declared hung only when it is behind the others or its process is stopped.

The heartbeats are written by each worker's reporter thread (reporter.py) into its node's store;
the node's agent reads them there (with which processes are stopped) and reports them in its
health record, and the supervisor reads its own node's directly.
"""
from __future__ import annotations

import json
import time

from . import policy
from .. import protocol


def read_beat(store, worker_id: int):
    return protocol.read_json(store, protocol.heartbeat_key(worker_id))


# A stopped process writes no heartbeat (a live worker's reporter beats at least every 0.5 s), and
# being stopped matters only for a worker silent for heartbeat_timeout_s: /proc is read only for
# workers whose beat is older than this (a timeout below it is judged at this age instead).
STOPPED_AFTER_S = 1.0


def process_stopped(pid: int) -> bool:
    """True when the process is stopped (SIGSTOP, a debugger, a frozen container)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state in ("T", "t")
    except (OSError, IndexError):
        return False


def read_beats(store, worker_ids, beaten: set | None = None) -> dict:
    """worker id -> its last heartbeat (None: none yet). With `beaten` (kept by the caller: a
    heartbeat key, once written, stays), the workers known to beat are read in one multi_get,
    and each of the others (a spare, which beats only once it holds a rank) costs one check;
    those found beating are read in one more multi_get. `beaten` is updated with them.
    Without it, one check of them all and one multi_get when every one has beaten, else a check
    and a read per worker (as on a store without multi_get)."""
    if not hasattr(store, "multi_get"):
        out = {w: read_beat(store, w) for w in worker_ids}
        if beaten is not None:
            beaten.update(w for w, b in out.items() if b)
        return out
    if beaten is None:
        keys = [protocol.heartbeat_key(w) for w in worker_ids]
        if keys and store.check(keys):
            return {w: json.loads(v) for w, v in zip(worker_ids, store.multi_get(keys))}
        return {w: read_beat(store, w) for w in worker_ids}
    out: dict = {}
    known = [w for w in worker_ids if w in beaten]
    new = [w for w in worker_ids if w not in beaten
           and store.check([protocol.heartbeat_key(w)])]
    for group in (known, new):
        if group:
            values = store.multi_get([protocol.heartbeat_key(w) for w in group])
            out.update((w, json.loads(v)) for w, v in zip(group, values))
    beaten.update(new)
    return {w: out.get(w) for w in worker_ids}


def find_hung(beats: dict[int, dict], pids: dict[int, int], timeout_s: float,
              now: float | None = None) -> list[int]:
    """policy.find_hung, with a worker stopped when /proc says its pid (-1: not on this
    machine) is."""
    now = time.time() if now is None else now
    return policy.find_hung(beats, timeout_s, now,
                            stopped=lambda w: process_stopped(pids.get(w, -1)))
