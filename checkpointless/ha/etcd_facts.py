"""What must outlive the coordinator, kept in etcd: the job's facts, written only by the holder of
the coordinator's role (leadership.py) and read by whoever takes the role next.

Kept under one prefix per job (`<prefix>/...`):
- `spec`: the job's Spec (what every worker reads once);
- `coordinator`: the role's key (leadership.Role): the holder's node and its store's address;
- `plan/<g>`: generation g's whole map (worker id -> rank and node), for the newest two
  generations (a takeover publishes the newest again, as a change from the one before);
- `gen`, `lost`, `next_wid`: the newest generation, the workers declared lost so far, the next
  worker id to hand out;
- `fence/<k>`: node k was declared lost (its agent, reading this, stops its processes);
- `moves/<token>`: each takeover (who, from which node, when, how long it took);
- `record/...`: the run's record so far (step times, failures, recoveries; control/ledger.py), so
  that a report written after a takeover counts from the launch;
- `done`: the job ended ("ok", "preempted before step N (why)", or "failed: why"): no candidate
  takes the role after it, and a new launch under the same prefix clears it only when it resumes
  (checkpoint.resume=auto), else is refused until the keys are removed.

Every write goes through the role's fence (`Role.write`): a deposed coordinator changes nothing.
The supervisor sees only the interface of control/facts.py, which this implements; on one
machine (a TCPStore coordinator) it is `NoFacts`.
"""
from __future__ import annotations

import json
import time

from ..control.facts import Deposed, Known, NoFacts
from .etcd import Etcd, EtcdError, EtcdUnavailable
from .leadership import Fenced, Role


class JobFacts(NoFacts):
    """The facts of one job in etcd, written by `role`'s holder."""
    durable = True

    def __init__(self, etcd: Etcd, prefix: str, role: Role):
        self.etcd, self.prefix, self.role = etcd, prefix.rstrip("/"), role
        # this holder's take of the role, for the report: its node, token and when it took it
        self.taking = {"node": role.me.get("node"), "token": role.token,
                       "t_taken": role.taken_at}

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def _write(self, name: str, value: str) -> None:
        """Write through the role's fence. While etcd answers nothing (its members starting
        again after a preemption's SIGTERM, a new etcd leader) it is tried again as long as
        the role's lease may still hold: the write is fenced either way."""
        while True:
            try:
                return self.role.write(self.key(name), value)
            except EtcdUnavailable as exc:
                if not self.role.held():
                    raise Deposed(f"the coordinator cannot record the job's facts in etcd "
                                  f"({exc})") from None
                time.sleep(0.1)
            except (Fenced, EtcdError) as exc:
                raise Deposed(f"the coordinator cannot record the job's facts in etcd ({exc})") \
                    from None

    def known(self) -> Known:
        k = Known()
        for e in self.etcd.get_prefix(self.prefix + "/"):
            name = e.key[len(self.prefix) + 1:]
            if name == "spec":
                k.spec = e.value.decode()
            elif name == "gen":
                k.gen = int(e.value)
            elif name == "lost":
                k.lost = int(e.value)
            elif name == "next_wid":
                k.next_wid = int(e.value)
            elif name == "done":
                k.done = e.value.decode()
            elif name == "notices":
                k.notices = int(e.value)
            elif name.startswith("plan/"):
                k.plans[int(name[5:])] = json.loads(e.value)
            elif name.startswith("fence/"):
                k.fenced[int(name[6:])] = e.value.decode()
            elif name.startswith("moves/"):
                k.moves.append(json.loads(e.value))
            elif name.startswith("record/"):
                k.record[name[7:]] = e.value.decode()
        k.moves.sort(key=lambda m: m.get("token", 0))
        return k

    def finish(self, outcome: str) -> None:
        """The job is over: said once, so that no candidate left takes the role to start it
        again (a new launch under the same prefix is refused until the keys are removed)."""
        try:
            self._write("done", outcome)
        except Deposed:
            pass

    def record_spec(self, spec_json: str) -> None:
        self._write("spec", spec_json)

    def record_plan(self, plan, lost: int, next_wid: int) -> None:
        """Generation `plan.gen`'s map, then the counters, then `gen` (a reader that finds gen g
        finds its plan); the plan two generations back is dropped."""
        self._write(f"plan/{plan.gen}", json.dumps(
            {"ranks": {str(w): r for w, r in plan.ranks.items()},
             "nodes": {str(w): plan.node_of(w) for w in plan.ranks},
             "world_size": plan.world_size,
             # a shrunk job's placement: a coordinator taking over publishes it again
             "hosts": {str(w): list(h) for w, h in plan.hosts.items()},
             "logical_world": plan.logical_world}))
        self._write("lost", str(lost))
        self._write("next_wid", str(next_wid))
        self._write("gen", str(plan.gen))
        if plan.gen >= 2:
            try:
                self.etcd.delete(self.key(f"plan/{plan.gen - 2}"))
            except (EtcdUnavailable, EtcdError):
                pass

    def record_fence(self, node: int, why: str) -> None:
        self._write(f"fence/{node}", why)

    def record_move(self, move: dict) -> None:
        self._write(f"moves/{move['token']}", json.dumps(move))

    def record_notices(self, n: int) -> None:
        self._write("notices", str(n))

    def record(self, name: str, value: str) -> bool:
        """One entry of the run's record (`record/<name>`, control/ledger.py). Unlike the
        facts above, one that etcd does not take now is tried again at the coordinator's next
        copy, so a moment without etcd's leader deposes nobody; a stale holder is deposed."""
        try:
            self.role.write(self.key(f"record/{name}"), value)
            return True
        except Fenced as exc:
            raise Deposed(f"the coordinator cannot record the job's facts in etcd ({exc})") \
                from None
        except (EtcdUnavailable, EtcdError):
            return False
