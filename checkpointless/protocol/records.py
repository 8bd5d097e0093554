"""The typed messages a node's agent and the coordinator exchange through the store.

- `NodeCommand`: what the coordinator asks an agent to do (start a worker, kill one, end the
  job), one JSON value per command key (keys.node_cmd_key), read in order.
- `NodeWord`: what the coordinator writes over a node's health record (keys.node_health_key)
  to tell it something: it is fenced, the job stopped, or the job is over. An agent's own record
  is a JSON object (`NodeRecord`); anything else in that key is a word.
- `AgentExit`: how an agent's process ends, which its launcher turns into its own exit code.
"""
from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field


class AgentExit(enum.IntEnum):
    OK = 0  # the job is over
    FENCED = 3  # the coordinator (or etcd's fence) cut this node out: its workers hold no rank
    COORDINATOR_LOST = 4  # the job stopped, or its coordinator is gone for good


class NodeOp(str, enum.Enum):
    SPAWN = "spawn"
    KILL = "kill"
    SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class NodeCommand:
    op: NodeOp
    wid: int | None = None  # spawn, kill
    slot: int | None = None  # spawn
    spare: bool = False  # spawn
    why: str | None = None  # shutdown of a job that failed

    def to_json(self) -> str:
        d = {k: v for k, v in asdict(self).items() if v is not None}
        d["op"] = self.op.value
        return json.dumps(d)

    @classmethod
    def parse(cls, raw) -> "NodeCommand":
        d = json.loads(raw)
        return cls(op=NodeOp(d.pop("op")), **d)


class Word(str, enum.Enum):
    RUN = "run"  # no word: the agent's own record stands
    FENCED = "fenced"
    STOPPED = "stopped"
    SHUTDOWN = "shutdown"


@dataclass(frozen=True)
class NodeWord:
    kind: Word
    why: str = ""

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.why}" if self.why else self.kind.value

    @classmethod
    def parse(cls, text: str) -> "NodeWord | None":
        """The word in a node's health key; None when the key holds the agent's own record."""
        if is_record(text):
            return None
        kind, _, why = text.partition(": ")
        return cls(Word(kind), why)


RUN = NodeWord(Word.RUN)


def is_record(raw) -> bool:
    """An agent's own health record (a JSON object), as opposed to the coordinator's word."""
    return (raw.decode() if isinstance(raw, bytes) else raw).startswith("{")


@dataclass
class NodeRecord:
    """A node's health record, written by its agent every node_beat_s."""
    seq: int
    t: float
    beats: dict = field(default_factory=dict)  # wid -> [step, age_s, gen, phase, pace]
    stopped: list = field(default_factory=list)  # wids whose processes are stopped (SIGSTOP)
    exited: dict = field(default_factory=dict)  # wid -> exit code, every exit so far
    final: bool = False  # the agent is leaving, its workers stopped

    def to_json(self) -> str:
        # by hand, not dataclasses.asdict: asdict deep-copies every beat, and an agent writes
        # one record per node_beat_s (a third of its CPU per record went there)
        return json.dumps({"seq": self.seq, "t": self.t, "beats": self.beats,
                           "stopped": self.stopped, "exited": self.exited, "final": self.final})

    @classmethod
    def parse(cls, raw) -> "NodeRecord":
        return cls(**json.loads(raw))


SILENT = NodeRecord(seq=-1, t=0)  # written for a node a takeover never heard: it never changes


@dataclass
class Entered:
    """A member's record of entering a generation (keys.entered_key), written once its state is
    restored: how it was restored, and when each phase ended. The supervisor's report reads
    every member's to time the recovery (control/report.py recovery_entry)."""
    worker_id: int
    resumed_step: int
    t_plan: float  # the plan was published
    t_group: float  # this member's new process group was formed
    t_ready: float  # its state was restored
    grads_kept: bool = False  # it redoes the interrupted step from the gradients it kept
    steps_by_rank: list = field(default_factory=list)  # each member's committed steps
    pairs: dict = field(default_factory=dict)  # rank that received -> rank that served it
    source: int | None = None  # the rank this member received from, if any
    bytes_sent: int = 0
    bytes_received: int = 0
    transfer_s: float = 0.0
    restored_from: str = "peer_memory"  # or "durable_checkpoint", or "build" (lost at step 0)
    steps_redone: int = 0
    sent_from: dict = field(default_factory=dict)  # rank that received -> how it was served
    resharded: list | None = None  # [chunks before, after]: every slice cut anew (fsdp, hsdp)
    start_broadcast_from: int | None = None  # the first generation's source of the state

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def parse(cls, raw) -> "Entered":
        return cls(**json.loads(raw))
