"""Typed failures: a peer's loss is a fact the supervisor records, never words in an error.

Gloo raises a plain RuntimeError when a peer's connection closes, the same type a user's own bug
raises, so an exception's type or text cannot say whose fault it is. Two rules decide instead:

  * Where this library communicates (gradient all-reduce, state transfer, replica exchange, the
    agreement), a failed call is wrapped at the call site in a `PeerFailure` subclass.
  * Any other exception in a step (the user's code, FSDP's collectives inside backward) counts as
    a peer failure only if the supervisor has declared a worker lost since this generation began,
    or publishes a newer plan. An error raised from inside torch.distributed waits up to
    `confirm_s` for that record, since the survivors' error can beat the supervisor's notice by a
    few milliseconds; every other error is the worker's own and is reported at once.

A `PeerFailure` that the supervisor never confirms is not swallowed either: it is reported as the
worker's own error, with its traceback, within `confirm_s`.
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
import traceback

from .. import protocol
from ..protocol import membership
from .pace import waiting


class PeerFailure(RuntimeError):
    """A collective or transfer failed because the membership changed under it."""


class PeerLost(PeerFailure):
    """A call to a peer failed (connection closed or reset): the peer died or left."""


class GroupAborted(PeerFailure):
    """The watch thread aborted the process group because a newer generation was published."""


class MembershipMoved(PeerFailure):
    """Raised instead of waiting on a peer that has already gone into recovery."""


class Evicted(RuntimeError):
    """This worker was left out of the new membership (the supervisor declared it failed)."""


@contextlib.contextmanager
def communicating(what: str):
    """Around this library's own calls to peers: any error of theirs is a `PeerLost`.

    Inside, the only thing that can fail is the communication itself (buffers are allocated and
    checked before), so the call site, not the message, says what kind of failure it is. The
    time inside is the thread's waiting on peers, not its own work (pace.py)."""
    try:
        with waiting():
            yield
    except PeerFailure:
        raise
    except RuntimeError as exc:
        raise PeerLost(f"{what} failed: {exc}") from exc


def raised_in_torch_distributed(exc: BaseException) -> bool:
    """True when torch.distributed raised it: the innermost frame of the traceback lies in torch
    and a frame of torch.distributed is on the way to it (a collective called by the user's code,
    by FSDP inside backward, or by a DTensor's full_tensor(), which waits through torch._ops),
    not the user's own code."""
    tb, names = exc.__traceback__, []
    while tb is not None:
        name = tb.tb_frame.f_globals.get("__name__", "")
        if name != "checkpointless.worker.pace":  # the timer around torch's Work.wait is not a cause
            names.append(name)
        tb = tb.tb_next
    if not names or not (names[-1] == "torch" or names[-1].startswith("torch.")):
        return False
    return any(n.startswith("torch.distributed") for n in names)


def is_peer_failure(exc: BaseException, loss_seen, confirm_s: float) -> bool:
    """Whether `exc`, raised on this worker, is the consequence of a peer's loss.

    `loss_seen()` is True once the supervisor has declared a worker lost in this generation (or
    moved on to a newer one). An error of torch.distributed's own may wait up to `confirm_s`
    for it; no other error waits."""
    if not isinstance(exc, Exception):
        return False  # KeyboardInterrupt, SystemExit: never recovered
    if loss_seen():
        return True
    if not (isinstance(exc, PeerFailure) or raised_in_torch_distributed(exc)):
        return False
    deadline = time.time() + confirm_s
    pause = 0.002
    while time.time() < deadline:
        time.sleep(pause)
        if loss_seen():
            return True
        pause = min(0.05, pause * 2)
    return False


# the exceptions handed to the supervisor (at most one: see report_error), kept alive so that
# no later object takes an id of theirs
_REPORTED: list = []


def report_error(store, worker_id: int, exc: BaseException) -> None:
    """Hand the supervisor this worker's own exception, traceback included, at once (the first
    one: what follows from it says less)."""
    if not isinstance(exc, Exception):
        return
    try:
        if store.check([protocol.error_key(worker_id)]):
            return
    except Exception:
        return
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        store.set(protocol.error_key(worker_id), json.dumps({"t": time.time(), "error": text}))
        membership.tell(store, protocol.ERRORS, worker_id)
        _REPORTED.append(exc)
    except Exception:
        pass


def _was_reported(exc: BaseException | None) -> bool:
    """`exc`, or one it was raised from or while handling, reached the supervisor."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if any(e is exc for e in _REPORTED):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


def report_uncaught(store, worker_id: int, printed_by_supervisor=lambda: True) -> None:
    """An exception that ends the script outside a step (building a wrapper, loading data after
    join) reaches the supervisor with its traceback too, not only as an exit code.

    One traceback per error: what reached the supervisor is printed by it, once, as "rank N
    raised:" with the traceback (`printed_by_supervisor()`: while this worker holds a rank; a
    spare's is printed here); this process prints what it could not hand over."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        report_error(store, worker_id, value)
        if not (_was_reported(value) and printed_by_supervisor()):
            previous(kind, value, tb)

    sys.excepthook = hook
