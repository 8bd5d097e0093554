"""The replay rehearsal's findings made into the job's verdict, its one message, and report.json's
`replay` (the worker's rank 0 and the supervisor's report judge alike; worker/rehearsal.py
rehearses and writes the findings under protocol.keys' replay keys)."""
from __future__ import annotations

from .keys import REPLAY, REPLAY_REDO, read_json, replay_rank_key, replay_redo_key

GATHER_S = 30.0  # how long rank 0 waits for every rank's finding (they end the step together)
MODES = ("warn", "strict", "off")
RULE = "README.md, 'A step must be replayable'"

# what differed -> why, in the order a step computes them (the first difference is named first)
CAUSES = {
    "params": "the model's parameters changed outside what protect() holds (a module not "
              "protected, or weights edited between steps)",
    "output": "the forward saw other inputs: a batch or a random value drawn outside the step "
              "(a prefetch of the next step's batch inside this one is the usual cause: draw "
              "the batch at the start of the step, or use job.batches()), a batch the step "
              "changes in place, or a nondeterministic forward kernel",
    "grads": "the backward computed other gradients from the same output: a nondeterministic "
             "kernel (torch.use_deterministic_algorithms(True) finds it) or work that differs "
             "between the two runs of the step",
    "state": "the update differed from the same gradients: state kept across steps that "
             "protect() does not hold (a learning-rate scheduler, an EMA, a step counter: "
             "protect it too)",
}


def judge(found: list[dict], world: int, mode: str) -> dict:
    """The job's verdict from the ranks' findings: {checked_at_step, replayable, mismatches,
    reason, mode}. `replayable` is None when the rehearsal was cut short or ranks are missing."""
    step = found[0]["step"] if found else None
    mismatches = [{"step": f["step"], "rank": f["rank"], "what": w}
                  for f in found for w in (f["differs"] or [])]
    cut = [f for f in found if f["differs"] is None]
    if mismatches:
        whats = [w for w in CAUSES if any(m["what"] == w for m in mismatches)]
        ranks = sorted({m["rank"] for m in mismatches})
        objects = sorted({o for f in found for o in f.get("objects") or []})
        return {"checked_at_step": step, "replayable": False, "mismatches": mismatches,
                "mode": mode, "ranks": ranks, "objects": objects,
                "reason": f"{CAUSES[whats[0]]}"}
    if cut or len(found) < world:
        why = cut[0]["why"] if cut else f"only {len(found)} of {world} ranks reported"
        return {"checked_at_step": step, "replayable": None, "mismatches": [], "mode": mode,
                "reason": f"not checked: {why}"}
    return {"checked_at_step": step, "replayable": True, "mismatches": [], "mode": mode,
            "reason": "the step gave the same bits when run again from the same state",
            # the most a rank spent on it: its snapshot, the first attempt, the put-back
            "cost_s": max(f.get("cost_s", 0.0) for f in found)}


def say(verdict: dict) -> str:
    """The one message a failed rehearsal prints."""
    ranks = verdict.get("ranks") or []
    whats = []
    for m in verdict["mismatches"]:
        if m["what"] not in whats:
            whats.append(m["what"])
    said = {"params": "the parameters its forward read", "output": "the model's output",
            "grads": "the gradients before the reduction", "state": "the state after the update"}
    which = ", ".join(said[w] for w in whats)
    objects = verdict.get("objects") or []
    stop = ("checkpointless.replay_check=strict: the run stops here" if verdict["mode"] ==
            "strict" else "the run goes on (replay_check=strict would stop it)")
    return (f"[checkpointless] replay check FAILED at step {verdict['checked_at_step']}: run "
            f"again from the same state, the step gave other bits on rank(s) "
            f"{', '.join(map(str, ranks))} ({which}"
            f"{'; objects: ' + ', '.join(objects) if objects else ''}). A recovery redoes a "
            "step this way, so after one this run would not end with the bits of a run without "
            "failures (nor does it exactly now: whatever the step does outside protect() was "
            f"done twice). Likely cause: {verdict['reason']}. See {RULE}; {stop}")


def replay_report(store, nproc: int, mode: str) -> dict:
    """report.json's `replay`: the rehearsal's verdict (rank 0's, or judged here from what the
    ranks left when rank 0 could not: protocol/replay.py) and every mismatch the redo check
    found after a recovery. `replayable`: True (checked: the same bits), False (a mismatch was
    seen: the bits are not guaranteed), None (not checked: off, cut short, or the run ended
    before the rehearsed step)."""
    verdict = read_json(store, REPLAY)
    if verdict is None:
        found = [f for r in range(nproc)
                 for f in [read_json(store, replay_rank_key(r))] if f]
        verdict = judge(found, nproc, mode) if found else {
            "checked_at_step": None, "replayable": None, "mismatches": [], "mode": mode,
            "reason": "not checked: replay_check=off" if mode == "off" else
            "not checked: no rank reached the rehearsed step (the launch's second) in the "
            "launch's first generation: the run was shorter, or a failure came first (only "
            "that generation rehearses; the redo check still watched every recovery)"}
    redo = [read_json(store, replay_redo_key(i))
            for i in range(1, int(store.add(REPLAY_REDO, 0)) + 1)]
    redo = [{**m, "check": "redo"} for m in redo if m]
    if redo:
        verdict = {**verdict, "replayable": False,
                   "mismatches": verdict.get("mismatches", []) + redo,
                   "reason": "a step redone after a recovery gave other bits than its first run "
                             "(a batch or a value drawn outside the step, state protect() does "
                             "not hold, or a nondeterministic kernel)"
                   if verdict.get("replayable") is not False else verdict["reason"]}
    return verdict

