"""Every protocol default, the job's Spec and the supervisor's configuration, once each.

The recipe schema, the CLI and the supervisor read their defaults here; `protocol` re-exports
them with the keys, so either import works.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields


@dataclass(frozen=True)
class Defaults:
    """Every protocol default, once: the schema, the CLI and SupervisorConfig read them here."""
    spares: int = 1  # warm spare processes per node
    refill: bool = True  # start a new spare after one is used
    heartbeat_timeout_s: float = 10.0  # training-loop silence before a lagging worker is hung
    pg_timeout_s: float = 300.0  # last-resort timeout of a collective (hangs are caught sooner)
    spare_wait_s: float = 600.0  # how long a lost rank may wait for a spare to warm up
    # how long a first-generation worker may take from its launch to its first heartbeat (its
    # imports, model build or load, the first group): past it, it is hung and replaced
    startup_timeout_s: float = 600.0
    # how long a worker whose collective failed waits for the supervisor to confirm that a peer
    # was lost; unconfirmed, the error is the worker's own and is reported as such
    confirm_s: float = 5.0
    # a replacement that dies before completing its first step this many times in a row stops
    # the run with its own error (a crash loop is a bug, not a run of bad luck)
    max_replacement_failures: int = 2
    # steps between checks that every replica holds the same parameters (0: only at the end)
    consistency_every: int = 50
    replication_factor: int = 2  # copies of each rank's shard under fsdp (own + peers)
    replication_interval: int = 1  # steps between peer copies
    replication_offset: int = 1  # ranks between a shard and its first copy (ring: the next)
    backend: str = "gloo"  # the process groups' backend when none is asked for
    heartbeat_every_s: float = 0.5  # how often a worker waiting in recovery still beats
    # the supervisor's loop: its longest sleep (process exits wake it at once, pidfd), so the
    # period of its store checks (reported errors, done, preemption, nodes' beats)
    poll_s: float = 0.1
    beats_every_s: float = 0.5  # how often the supervisor reads the workers' heartbeats
    remote_poll_s: float = 0.05  # its longest sleep with workers on other nodes (their exits)
    spare_poll_s: float = 0.05  # how often a lost rank waiting for a spare looks again
    node_beat_s: float = 0.5  # how often a node's agent writes its health record
    health_every_s: float = 0.25  # how often the coordinator reads every node's health record
    gather_window_s: float = 0.02  # failures seen this close together join one generation
    refill_delay_s: float = 3.0  # a refill waits this long when spares suffice for now
    exit_poll_s: float = 0.02  # how often a wait for a process's exit looks again (no pidfd)
    join_poll_s: float = 0.1  # how often a wait for nodes to join, or for etcd's quorum, looks
    shutdown_poll_s: float = 0.05  # how often the end of a job looks for its processes gone
    store_retry_s: float = 0.2  # an agent's wait before it asks an unreachable store again
    reconnect_step_s: float = 0.05  # a relay connecting again waits tries x this, at most 1 s
    # a process that signalled itself (SIGKILL, SIGSTOP) waits this long for the signal to land:
    # it can take effect a few ms after kill() returns, and nothing may progress meanwhile
    signal_settle_s: float = 5.0
    # a node whose launcher is silent this long is lost; below confirm_s, so that survivors whose
    # collectives failed with the node's workers hear of the loss before they give up waiting
    node_timeout_s: float = 3.0
    # a worker that died after reporting its result is lost only if another rank's result is
    # still missing this long after (below confirm_s, for the same reason as node_timeout_s)
    result_grace_s: float = 1.0
    # a straggler: a worker whose own time per step (pace.py) stays above factor x its peers'
    # median for window consecutive steps; evict (a ready spare takes its rank), report or off
    straggler_factor: float = 1.5
    straggler_window: int = 10
    straggler_action: str = "evict"
    # steps between audits by replay (audit.py): an idle spare recomputes one sampled rank's
    # step and compares its gradient digest; 0: no audits
    audit_every: int = 0
    # with no spare ready for a lost rank (worker/logical.py): exact (the survivors host its
    # logical rank; every reduction sums logical ranks in one fixed order, the failure-free run's
    # too, so a shrunk run keeps its bits), fast (today's collectives; the batch is kept, the
    # bits may differ), off (wait spare_wait_s for a spare, then stop)
    shrink: str = "off"
    # the replay rehearsal (worker/rehearsal.py): early in a run one step is run twice, the
    # state put back between, and the two compared bit for bit; warn (say a difference), strict
    # (stop the run on one) or off
    replay_check: str = "warn"


DEFAULTS = Defaults()


def default_replication() -> dict:
    """Spec.replication when nothing is asked: {factor, interval, offset}."""
    return {"factor": DEFAULTS.replication_factor, "interval": DEFAULTS.replication_interval,
            "offset": DEFAULTS.replication_offset}


def recovery_timeout_s(heartbeat_timeout_s: float) -> float:
    """How long a rank waits for the next plan after a failure before it gives up."""
    return 4 * heartbeat_timeout_s + 60


@dataclass
class Spec:
    """The job's settings every worker reads from the store in join()."""
    backend: str = DEFAULTS.backend
    seed: int = 0
    heartbeat_timeout_s: float = DEFAULTS.heartbeat_timeout_s
    pg_timeout_s: float = DEFAULTS.pg_timeout_s
    confirm_s: float = DEFAULTS.confirm_s
    consistency_every: int = DEFAULTS.consistency_every
    faults: list = field(default_factory=list)
    replication: dict = field(default_factory=default_replication)
    workers_per_node: int = 1  # processes sharing this node's memory (active + spares)
    ranks_per_node: int = 1  # active ranks per node: ranks k*n .. k*n+n-1 train on one node
    health: dict = field(default_factory=dict)  # node checks of every spare (health.py)
    # HSDP: ranks per replica group (dp_shard x tp), the groups the copies (mesh.py); 0: no groups
    shard_size: int = 0
    tp_size: int = 1  # ranks per tensor-parallel group, tp innermost (mesh.py)
    pp_size: int = 1  # pipeline stages, outermost: world/pp consecutive ranks each (mesh.py)
    audit_every: int = DEFAULTS.audit_every  # steps between audits by a spare's replay (audit.py)
    shrink: str = DEFAULTS.shrink  # exact, fast or off: no spare ready (worker/logical.py)
    replay_check: str = DEFAULTS.replay_check  # warn, strict or off (worker/rehearsal.py)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text) -> "Spec":
        return cls(**json.loads(text))


@dataclass
class SupervisorConfig:
    """What the supervisor is asked to run: world size, spares, timeouts, faults, replication.

    The one configuration object: built from a recipe's checkpointless section or the CLI's
    arguments by name (`of`), and the only source of the Spec every worker reads (`spec`), whose
    fields carry the same names."""
    nproc: int
    spares: int = DEFAULTS.spares
    refill: bool = DEFAULTS.refill
    heartbeat_timeout_s: float = DEFAULTS.heartbeat_timeout_s
    backend: str = DEFAULTS.backend
    host: str = "127.0.0.1"
    port: int = 0
    seed: int = 0
    faults: list = field(default_factory=list)
    pg_timeout_s: float = DEFAULTS.pg_timeout_s
    spare_wait_s: float = DEFAULTS.spare_wait_s
    startup_timeout_s: float = DEFAULTS.startup_timeout_s
    confirm_s: float = DEFAULTS.confirm_s
    max_replacement_failures: int = DEFAULTS.max_replacement_failures
    consistency_every: int = DEFAULTS.consistency_every
    poll_s: float = DEFAULTS.poll_s  # longest sleep of the monitoring loop (exits wake it at once)
    # niceness of a refill while it warms up. Lockstep workers lose the same CPU time to a
    # warm-up whatever its priority; a low one only stretches it (nice 10 behind 4 busy workers
    # on 2 cores: minutes), leaving the job without a spare for longer. So none by default.
    refill_nice: int = 0
    enabled: bool = True
    # many machines (cluster.py): active nodes of nproc / nodes workers (+ `spares` each), spare
    # nodes of as many spares, a node lost after node_timeout_s of silence
    nodes: int = 1
    spare_nodes: int = 0
    standalone: bool = False  # no workers here: every node, 0 included, has its own agent
    node_timeout_s: float = DEFAULTS.node_timeout_s
    replication: dict = field(default_factory=default_replication)
    straggler_factor: float = DEFAULTS.straggler_factor
    straggler_window: int = DEFAULTS.straggler_window
    straggler_action: str = DEFAULTS.straggler_action  # evict, report or off
    health: dict = field(default_factory=dict)  # node checks (health.py; {}: its defaults)
    metrics_port: int = 0  # >0: the coordinator serves Prometheus' /metrics there (prometheus.py)
    tokens_per_step: int = 0  # what one step trains on, all ranks (tokens per second; 0: not said)
    shard_size: int = 0  # HSDP: ranks per replica group (mesh.py); 0: no replica groups
    tp_size: int = 1  # ranks per tensor-parallel group (mesh.py); 1: none
    pp_size: int = 1  # pipeline stages (mesh.py); 1: none
    audit_every: int = DEFAULTS.audit_every  # steps between audits by replay (0: none)
    shrink: str = DEFAULTS.shrink  # exact, fast or off: a lost rank with no spare ready
    replay_check: str = DEFAULTS.replay_check  # warn, strict or off (worker/rehearsal.py)
    shrink_max_hosted: int = 0  # most logical ranks one process may host (0: no limit)
    shrink_min_processes: int = 1  # fewer would be left: wait for a spare instead (fsdp and
    # hsdp: 2, or what the launcher's memory plan leaves room for on a device)

    @classmethod
    def of(cls, settings, **given) -> "SupervisorConfig":
        """Every field found under its own name in `settings` (a mapping: a recipe's
        checkpointless section, the CLI's arguments), then `given`."""
        found = {f.name: settings[f.name] for f in fields(cls) if f.name in settings}
        return cls(**{**found, **given})

    @property
    def per_node(self) -> int:
        return self.nproc // self.nodes

    def spec(self) -> Spec:
        """What every worker reads: the fields shared with Spec, and the shape of a node."""
        shared = {f.name: getattr(self, f.name) for f in fields(Spec)
                  if hasattr(self, f.name)}
        return Spec(**shared, workers_per_node=self.per_node + self.spares,
                             ranks_per_node=self.per_node)
