"""The supervisor/worker protocol: every store key, environment variable and default, once.

The supervisor and its workers talk through one TCPStore hosted by the supervisor (it outlives any
worker) and through a few environment variables set when a worker process is started (those, and
their readers, in environment.py; every name re-exported here). Everything either side reads or
writes in the store is named here, so a reader can see the whole conversation in one page.
What grows with ranks goes to the rank's own node (its node store, below); what reaches the
coordinator grows with nodes, or happens once per generation:

    supervisor                                   worker
    ----------                                   ------
    spec             (job settings, JSON)  --->  read once in join()
                                           <---  ready/<wid>      warmed up, waiting for a rank
    plan/<g>         (generation g: world  --->  a rank waits on it (one key, no polling) in
      size, nodes with members)                  its node store, where the node's agent copies
    plan/<g>/<k>     (node k's part: who         it with the node's part; then reads both in one
      joined or left there, members)             call: who joined, who left, members on node k
    gen              (newest generation)
                                           <---  barrier/<g>/<k>  node store: members arrived;
                                                 the node's last adds once to barrier/<g>, the
                                                 job's last sets barrier/<g>/done (a newer plan
                                                 sets it stale); every member waits for it in
                                                 its node store (the agent copies it there too)
                                           <---  hb/<wid>         node store, from a background
                                                 thread: heartbeat {t, step, gen, phase}
                                           <---  steps/<s>, last_step  rank 0, background: step
                                                 s ran t0..t1; the newest committed
                                           <---  rec/<g>/<rank>   how generation g was entered
                                           <---  recfirst/<g>/<r> first step committed in g
                                           <---  error/<wid>, errors/who, errors   an
                                                 exception of its own: who, then the count
                                           <---  diverged/<wid>   its replica left the majority
    lost             (counter)             --->  a worker was declared lost (before its plan)
    preempt          (a step)              --->  stop before this step (SIGTERM somewhere)
                                           <---  result/<rank>, done/<wid>, done
    shutdown                               --->  the job is over

The node store: every node agent hosts a small TCPStore for its workers (their heartbeats, the
plans and barrier outcomes the agent copies from the job's store, the barrier's first gathering),
so a new generation wakes one waiter per node in the job's store, not one per rank; on the
coordinator's node, and on one machine, the supervisor's store is that node's store.

Many machines: every node but the coordinator's runs an agent (agent.py) that the coordinator
(cluster.py) talks to through keys of its own, one set per node k. The agent judges its own
workers (exits, heartbeats, stopped processes) and reports one record per node, so the
coordinator's steady load grows with nodes, not ranks:

    coordinator                                  agent (node k)
    -----------                                  --------------
                                           <---  node/k/hello     {host, procs, pid}
    node/k/cmd/<i>   (the i-th command)    --->  spawn {wid, slot, spare} | kill {wid}
    bell/<b>/<j>     (group b got commands) -->  an agent thread blocks on its group's next ring
                                           <---  node/k/pid/<wid>
                                           <---  node/k/health    {seq, beats, stopped,
                                                 exited}: every node_beat_s, and at once on an
                                                 exit, then node_events (counter) moves
    node/k/health    "fenced: <why>"       --->  kill every local worker, exit 3
                     "shutdown"            --->  stop every local worker, exit 0
                     (the coordinator's word replaces the record; the agent writes each record
                     with a compare_set that expects its last one, so one call writes it or
                     answers the word, and a fenced node writes no more)
"""
from __future__ import annotations

import json

from .environment import *  # noqa: F401,F403  (the worker's environment: environment.py)
from .settings import DEFAULTS

# ---- store keys ------------------------------------------------------------------------------
SPEC = "spec"  # the job's Spec, JSON, written before any worker starts
GEN = "gen"  # newest published generation (a plan is written before gen moves)
LOST = "lost"  # counter: workers the supervisor declared lost so far
ERRORS = "errors"  # counter: exceptions reported (error/<wid> holds each, who(ERRORS) the wids)
DONE = "done"  # counter: workers that finished
FIRST_STEP = "first_step"  # the step this launch's step records start at (resume from disk)
FIRST_T = "first_t"  # when this launch's first step began (a rewind to it rewrites its record)
SHUTDOWN = "shutdown"  # set by the supervisor when the job is over
PREEMPT_ASK = "preempt_ask"  # set by a node agent that got SIGTERM/SIGINT: please stop the job
NODE_EVENTS = "node_events"  # counter: agents' health records that carry news (an exit)
LAST_STEP = "last_step"  # rank 0's newest committed step (with its step record)


def plan_key(gen: int) -> str:
    return f"plan/{gen}"


def plan_node_key(gen: int, node: int) -> str:
    """Node `node`'s part of generation `gen`'s plan: who joined or left there, its members."""
    return f"plan/{gen}/{node}"


def barrier_key(gen: int) -> str:
    """Counter on the main store: nodes whose members of generation `gen` all arrived."""
    return f"barrier/{gen}"


def barrier_node_key(gen: int, node: int) -> str:
    """Counter on node `node`'s store: its members of generation `gen` that arrived."""
    return f"barrier/{gen}/{node}"


def barrier_done_key(gen: int) -> str:
    """"go" once every member of `gen` arrived, or "stale" once a newer plan replaced it (set
    if absent, so exactly one of the two wins)."""
    return f"barrier/{gen}/done"


def group_prefix(gen: int) -> str:
    """Every generation's process group lives under its own prefix: no stale keys (or sockets)
    from a broken group can leak into the next one."""
    return f"pg/{gen}"


def ready_key(wid: int) -> str:
    return f"ready/{wid}"


def notice_key(i: int) -> str:
    """The supervisor's i-th notice to every worker, JSON, in order: {"kind": "preempt",
    "before_step"} (SIGTERM, SIGINT: every rank stops before that step) or {"kind": "leave",
    "wid", "gen", "before_step"} (that worker, a straggler, leaves at that step's boundary and
    the others wait there for the plan that replaces it). One thread per worker follows them."""
    return f"notice/{i}"


def straggler_key(i: int) -> str:
    """The supervisor's i-th straggler line (stragglers.py): an entry as it is found or dealt
    with, JSON with its time `t`; a loop's own trackers may follow them."""
    return f"straggler/{i}"


def health_key(wid: int) -> str:
    """A spare's newest health check (health.py): {ok, problems, t}."""
    return f"health/{wid}"


def heartbeat_key(wid: int) -> str:
    return f"hb/{wid}"


def error_key(wid: int) -> str:
    return f"error/{wid}"


def done_key(wid: int) -> str:
    return f"done/{wid}"


def result_key(rank: int) -> str:
    return f"result/{rank}"


def entered_key(gen: int, rank: int) -> str:
    return f"rec/{gen}/{rank}"


def first_commit_key(gen: int, rank: int) -> str:
    return f"recfirst/{gen}/{rank}"


def tracker_run_key(tracker: str) -> str:
    """The run id rank 0's experiment tracker opened (MLflow): a replacement rank 0 continues it."""
    return f"tracker_run/{tracker}"


def step_key(step: int) -> str:
    return f"steps/{step}"


def fault_claim_key(index: int) -> str:
    return f"fault/{index}/claimed"


def fault_time_key(wid: int) -> str:
    return f"fault_at/{wid}"


def diverged_key(wid: int) -> str:
    """Set by a worker whose parameters differ from the majority's, before it leaves."""
    return f"diverged/{wid}"


AUDITORS = "auditors"  # counter: spares that offered to audit (auditor/<i> says where each is)
AUDIT_DONE = "audit_done"  # the newest step an auditor finished judging
SDC = "sdc"  # counter: workers an audit found wrong (sdc/<wid> holds each finding, who(SDC) them)


def who(counter: str) -> str:
    return f"{counter}/who"  # the workers a counter of reports counts ("<wid> " each)


def auditor_key(i: int) -> str:
    """Where audit server i listens ({wid, host, port}); "" once its spare took a rank."""
    return f"auditor/{i}"


def audit_digest_key(step: int, rank: int) -> str:
    """The digest of rank's local gradient contribution at an audited step, by the rank."""
    return f"audit/{step}/{rank}"


def audit_pass_key(rank: int) -> str:
    """The newest step at which an audit found rank's contribution right."""
    return f"audit_pass/{rank}"


def sdc_key(wid: int) -> str:
    """Set by an auditor that found worker wid computing wrong: {rank, step, rewind_to, ...}."""
    return f"sdc/{wid}"


# the replay rehearsal (worker/rehearsal.py): each rank's finding, the job's verdict, and the
# mismatches the redo check found after recoveries
REPLAY = "replay/verdict"  # {checked_at_step, replayable, mismatches, reason, mode}, by rank 0
REPLAY_RANKS = "replay/ranks"  # counter: ranks whose rehearsal finding is in
REPLAY_STOP = "replay/stop"  # set by a rank whose rehearsal failed under strict: the run stops
REPLAY_REDO = "replay/redo"  # counter: redo mismatches (replay/redo/<i> holds each, from 1)


def replay_rank_key(rank: int) -> str:
    """One rank's rehearsal finding: {step, rank, differs: [what], ...}."""
    return f"replay/rank/{rank}"


def replay_redo_key(i: int) -> str:
    """The i-th mismatch the redo check found (from 1): {step, rank, what}."""
    return f"replay/redo/{i}"


def rewind_key(gen: int) -> str:
    """A generation's way back to a state known clean, from the supervisor: {"at_most": STEP,
    "why": ...}; every rank loads the newest durable checkpoint <= STEP."""
    return f"rewind/{gen}"


def replicas_prefix(gen: int) -> str:
    """The store prefix of generation `gen`'s peer-replica group (redundancy under fsdp)."""
    return f"replicas/{gen}"


def plain_prefix(restart) -> str:
    """The store prefix of torchrun's restart `restart` of a job without the supervisor."""
    return f"plainjob/restart{restart}"


# ---- node keys (agent.py <-> cluster.py) ------------------------------------------------------
def node_hello_key(node: int) -> str:
    return f"node/{node}/hello"


def node_health_key(node: int) -> str:
    """The node agent's one record of its workers (agent.py's health()), or the coordinator's
    word that replaced it: "fenced: <why>" (the node was declared lost), "shutdown" or
    "stopped: <why>" (the job is over)."""
    return f"node/{node}/health"


def node_cmd_key(node: int, i: int) -> str:
    return f"node/{node}/cmd/{i}"


NODES_PER_BELL = 64  # nodes that share a command bell (control/bells.py says why)


def bell_key(group: int, j: int) -> str:
    return f"bell/{group}/{j}"  # the j-th ring: set after the commands it announces


def bell_next_key(group: int) -> str:
    return f"bell/{group}"  # the number of the next ring (absent: 0), where an agent starts


def node_pid_key(node: int, wid: int) -> str:
    return f"node/{node}/pid/{wid}"


def read_json(store, key: str):
    """The JSON record under `key`, or None while there is none."""
    return json.loads(store.get(key)) if store.check([key]) else None


def replica_offset(placement: str, procs_per_node: int) -> int:
    """Distance on the rank ring between a shard and its first copy: the next rank (ring), or the
    same local rank on the next node (nodes), so that losing a node never takes a shard and all
    its copies at once."""
    if placement == "nodes":
        return procs_per_node
    return DEFAULTS.replication_offset


# what `from checkpointless import protocol` re-exports: every key and helper above, and the
# worker's environment (its variables and readers) taken from environment.py
__all__ = [n for n in dir() if not n.startswith("_") and
           n not in ("annotations", "json", "DEFAULTS")]
