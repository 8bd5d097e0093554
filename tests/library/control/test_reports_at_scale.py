"""A worker's report of its own exception, or an audit's finding, costs the coordinator a few
store calls whatever the ranks (checkpointless/protocol/membership.py's tell and told), not one
per rank: at 16,384 ranks that was 16,384 round trips before the decision. In-process, over a
real store, with the supervisor's own code on a stand-in supervisor."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from checkpointless import protocol  # noqa: E402
from checkpointless.control.job_state import JobState  # noqa: E402
from checkpointless.control.losses import LossFinder  # noqa: E402
from checkpointless.protocol import membership  # noqa: E402
from checkpointless.worker.failures import report_error  # noqa: E402

RANKS = 4096


class Counted:
    """A store client whose calls are counted."""

    def __init__(self, store):
        self._store, self.calls = store, 0

    def __getattr__(self, name):
        attr = getattr(self._store, name)

        def call(*a, **k):
            self.calls += 1
            return attr(*a, **k)
        return call


class _Pool:
    def __init__(self):
        self.killed = []

    def kill(self, w):
        self.killed.append(w.wid)


@pytest.fixture
def stores():
    server, own = membership.host("127.0.0.1")
    yield server, Counted(membership.connect("127.0.0.1", server.port))
    del own, server


def _supervisor(store):
    """The supervisor's loss finder (control/losses.py) over `store`, RANKS ranks active."""
    ranks = {wid: wid for wid in range(RANKS)}
    pool = _Pool()
    pool.workers = {wid: SimpleNamespace(wid=wid) for wid in ranks}
    return LossFinder(SimpleNamespace(audit_every=1), JobState(nproc=RANKS, store=store,
                                                                ranks=ranks), pool, None, None,
                      None)


def _errors(sup):
    return sup.reported_errors([])


def test_a_reported_exception_costs_a_few_calls_whatever_the_ranks(stores):
    server, store = stores
    sup = _supervisor(store)
    worker = membership.connect("127.0.0.1", server.port)
    try:
        raise RuntimeError("NCCL watchdog timeout")
    except RuntimeError as exc:
        report_error(worker, 1234, exc)
    store.calls = 0
    (lost,) = _errors(sup)
    assert lost[0].wid == 1234 and sup.pool.killed == [1234]
    # the counter, the list, the one worker's own key: not one per rank (4,096 before)
    assert store.calls <= 4, store.calls
    del sup.ranks[1234]  # handled: the supervisor took it out of the membership
    for wid in (17, 4095):  # two more, together: both found, the first not again
        try:
            raise ValueError(f"worker {wid}")
        except ValueError as exc:
            report_error(worker, wid, exc)
    store.calls = 0
    assert sorted(w.wid for w, _ in _errors(sup)) == [17, 4095]
    assert store.calls <= 5, store.calls
    assert _errors(sup) == []  # nothing new: the counter alone


def test_a_report_without_the_list_is_still_found_by_looking_at_every_rank(stores):
    """A store without append, or a worker of an older release: the counter moved, the list
    falls short of it, and the coordinator looks at every rank as it did before."""
    server, store = stores
    sup = _supervisor(store)
    store.set(protocol.error_key(99), json.dumps({"t": 0, "error": "boom"}))
    store.add(protocol.ERRORS, 1)
    store.calls = 0
    (lost,) = _errors(sup)
    assert lost[0].wid == 99
    assert store.calls > RANKS  # every rank's key, one call each


def test_an_audit_finding_costs_a_few_calls_whatever_the_ranks(stores):
    server, store = stores
    sup = _supervisor(store)
    auditor = membership.connect("127.0.0.1", server.port)
    auditor.set(protocol.sdc_key(2048), json.dumps(
        {"wid": 2048, "rank": 2048, "step": 14, "last_passed": 8, "rewind_to": 9, "auditor": 5}))
    membership.tell(auditor, protocol.SDC, 2048)
    membership.tell(auditor, protocol.SDC, 2048)  # a second auditor accuses it too: two reports
    store.calls = 0
    (lost,) = sup.accused([])
    assert lost[0].wid == 2048 and sup.pool.killed == [2048]
    # the counter, the list, the finding, the error written for the report
    assert store.calls <= 5, store.calls
