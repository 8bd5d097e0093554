"""Who sends what to whom in a restore: pure functions over what the members told each other.

restore.py gathers each member's facts (steps committed, snapshots, copies held) and calls these;
every member computes the same answer from the same facts, so no one decides for the others.
"""
from __future__ import annotations

def stage_ranks(state, world: int) -> list[list[int]]:
    """The ranks of each pipeline stage (one list of all without pipeline parallel)."""
    pp = int(getattr(state.spec, "pp_size", 1) or 1)
    per = world // pp
    return [list(range(s * per, (s + 1) * per)) for s in range(pp)]


def replicated_step(steps: list[int], stages: list[list[int]]) -> int:
    """The step every replicated member resumes at: the newest committed by any member, which
    each pipeline stage must hold somewhere (its state is its own). A stage can only lag when
    two failures struck the two sides of a step's last pipeline collective at once; a member
    past it cannot go back without snapshots, and the run stops saying so."""
    newest = [max(steps[r] for r in ranks) for ranks in stages]
    if min(newest) < 0:
        raise RuntimeError("no member of the new generation holds training state"
                           + (f" of pipeline stage {newest.index(min(newest))}"
                              if len(stages) > 1 else ""))
    if len(set(newest)) > 1:
        raise RuntimeError(f"pipeline stages committed different steps ({newest} by stage): "
                           "the members ahead cannot go back under ddp; resume from a durable "
                           "checkpoint (checkpoint.interval)")
    return newest[0]


def assign_sources(receivers: list[int], sources: list[int]) -> dict[int, int]:
    """Pair each receiver with a source, spreading receivers evenly over the sources."""
    if receivers and not sources:
        raise RuntimeError("no healthy worker holds the state: nothing to copy from")
    return {r: sources[i % len(sources)] for i, r in enumerate(sorted(receivers))}


def _reaches(info: dict, s: int) -> bool:
    """A member with state can be brought to step `s` by itself (it is there, or rolls back)."""
    return info["completed"] >= 0 and not info.get("built") and \
        (info["completed"] == s or s in info["own"])


def _built_at(info: dict, s: int) -> bool:
    """A replacement from before the first commit holds its own build of step `s`'s slice: the
    last resort for that slice (a copy or a twin, where one exists, is what the lost rank held)."""
    return bool(info.get("built")) and info["completed"] == s


def restorable_step(infos: list[dict], twins: list[list[int]] | None = None) -> int | None:
    """The newest step to which every member's slice can be brought.

    `infos[r]` = {"completed": steps done by rank r (-1: a spare, holds nothing),
                  "built": r is a replacement from before the first commit (its own build),
                  "own": steps of r's own snapshots, "held": {rank: steps of its copies}};
    `twins[r]`: the ranks whose live slice is r's (HSDP's replica groups), none without them.
    A member with state can be at s if it completed exactly s or snapshotted s; any rank can
    be at s if a twin can by itself, or a member with state holds a copy of its slice at s.
    """
    twins = twins or [[] for _ in infos]
    with_state = [r for r, i in enumerate(infos) if i["completed"] >= 0]
    candidates = {i["completed"] for i in infos if i["completed"] >= 0}
    candidates |= {s for i in infos for s in i["own"]}

    def sendable(f: int, s: int) -> bool:
        return any(_reaches(infos[t], s) for t in twins[f]) or \
            any(s in infos[h]["held"].get(str(f), []) for h in with_state)

    for s in sorted(candidates, reverse=True):
        if all(_reaches(i, s) or sendable(r, s) or _built_at(i, s)
               for r, i in enumerate(infos)):
            return s
    return None


def pick_senders(infos: list[dict], step: int,
                 twins: list[list[int]] | None = None) -> dict[int, tuple[int, str]]:
    """For each rank that cannot reach `step` by itself (a spare, or under HSDP a survivor a
    step ahead or behind without the snapshot), who sends its slice: {rank: (sender, how)},
    how "twin" (the sender's live state, HSDP) or "held" (a copy in its host memory). Twins are
    preferred (nothing to keep), and the load is spread: the least busy sender first."""
    twins = twins or [[] for _ in infos]
    load: dict[int, int] = {}
    out = {}
    for f, info in enumerate(infos):
        if _reaches(info, step):
            continue
        options = [(h, "twin") for h in twins[f] if _reaches(infos[h], step)]
        if not options:
            options = [(h, "held") for h, i in enumerate(infos) if i["completed"] >= 0
                       and step in i["held"].get(str(f), [])]
        if not options and _built_at(info, step):
            continue  # it keeps its own build
        h, how = min(options, key=lambda o: (load.get(o[0], 0), o[0]))
        load[h] = load.get(h, 0) + 1
        out[f] = (h, how)
    return out


def pick_holders(infos: list[dict], step: int) -> dict[int, int]:
    """For each spare's rank, a member holding its slice at `step`, spreading the load."""
    return {f: h for f, (h, _) in pick_senders(infos, step).items()}
