"""The waits of a node's door (node_door.py): the keys its local clients wait for, each waited
for once upstream however many clients wait for it, and the checks that say which keys came.

torch's server keeps one count of awaited keys per connection, set by its newest wait, and
answers a wait when the count reaches 0. So the door waits for each missing key alone: the newest
leaves the count at 1, and a byte comes as soon as any of the keys appears. Which one, `check`s
say (one per key); then each key still missing is waited for again, a key that appeared
meanwhile answering at once. A wake-up byte may come between any two answers, so before calls
that expect one the door cancels the waits armed so far (`cancel_due`) and arms them again
behind those calls (`arm_calls`)."""
from __future__ import annotations

from . import store_wire as w
from .door_parts import Client, Wait


class DoorWaits:
    """The door's waits and their checks; it queues calls through the door's `_unsent`, answers
    through its clients' `out`, and lets a client's held calls go on through `_release`."""

    def __init__(self, door):
        self.door = door
        self.by_keys: dict[bytes, Wait] = {}  # those not over
        self.checking = 0  # checks out for the waits
        self.present: dict[bytes, bool] = {}  # their answers
        self.woke = False  # a wake-up byte came while checks were out
        self.armed: set[bytes] = set()  # keys waited for upstream since the last CANCEL_WAIT
        self.to_arm: set[bytes] = set()  # keys to wait for upstream at the end of the turn

    def wait(self, c: Client, call: bytes) -> None:
        key = call[1:]
        wt = self.by_keys.get(key)
        self.door.stats["waits"] += 1
        if wt is None:
            wt = self.by_keys[key] = Wait(call)
            self.check(wt.keys)  # there already: answered in one round trip; else armed then
        else:
            self.door.stats["waits_shared"] += 1
        wt.clients.append(c)
        c.waiting = wt

    def unwait(self, c: Client) -> None:
        wt, c.waiting = c.waiting, None
        if wt is not None and c in wt.clients:
            wt.clients.remove(c)
            if not wt.clients:  # nobody waits for it any more
                self.by_keys.pop(wt.call[1:], None)

    def check(self, keys) -> None:
        for k in keys:
            self.checking += 1
            self.door._unsent.append((k, w.one_key(w.CHECK, k), "b"))

    def checked(self, key: bytes, there: bool) -> None:
        """A check's answer: once all are in, the waits whose keys all came are answered and
        the keys still missing are armed."""
        self.present[key] = there
        self.checking -= 1
        if self.checking:
            return
        missing = set()
        for wt in list(self.by_keys.values()):
            if all(self.present.get(k) for k in wt.keys):
                self._answer(wt)
            else:
                missing.update(k for k in wt.keys if self.present.get(k) is False)
        self.present.clear()
        self.to_arm.update(missing)
        if self.woke:  # a byte came while these checks were out: look again
            self.woken(again=True)

    def _answer(self, wt: Wait) -> None:
        self.by_keys.pop(wt.call[1:], None)
        for c in wt.clients:
            c.out.append(w.STOP_WAITING)
            self.door._outq.add(c)
            c.waiting = None
            self.door._release(c)

    def woken(self, again: bool = False) -> None:
        """A wake-up came (`again`: while checks were out): the checks say which keys are in."""
        self.woke = self.checking > 0
        if not self.woke:
            self.check(self.waited())

    def waited(self) -> set[bytes]:
        return {k for wt in self.by_keys.values() for k in wt.keys}

    # ---- around the upstream connection ------------------------------------------------------
    def reconnected(self) -> None:
        """A new upstream connection: the keys still missing are armed once checked there."""
        self.woke = False
        self.check(self.waited())

    def reset(self) -> None:
        """The upstream connection is gone: nothing is armed or checked there any more."""
        self.armed.clear()
        self.to_arm.clear()
        self.checking, self.woke = 0, False
        self.present.clear()

    def cancel_due(self, unsent) -> bool:
        """True when a CANCEL_WAIT must go up before the `unsent` calls: one of them expects an
        answer while waits are armed (their bytes, if any, come before the cancel's own). The
        keys still waited for, and not checked among those calls, are armed again behind them."""
        if not (self.armed and any(shape for _, _, shape in unsent)):
            return False
        checked = {o for o, _, _ in unsent if isinstance(o, bytes)}  # keys
        self.to_arm |= (self.armed & self.waited()) - checked
        self.armed = set()
        return True

    def arm_calls(self) -> bytes:
        """The WAIT calls for the keys to arm, sent behind the turn's calls (whose answers come
        first)."""
        calls = b"".join(w.one_key(w.WAIT, k) for k in self.to_arm)
        self.armed |= self.to_arm
        self.to_arm = set()
        return calls
