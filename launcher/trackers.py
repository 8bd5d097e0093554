"""Experiment trackers through accelerate (`logging.trackers`): every committed step's figures,
each validation, and each recovery as a marked event with its phases, written by rank 0.

A step is logged once, when it commits: a step cut short by a failure and redone is logged in its
final attempt only. When rank 0 itself is replaced, the replacement opens the same run again
(the same `logging.dir` for file-based trackers) and goes on from the agreed step.
"""
from __future__ import annotations


class Trackers:
    """Owns accelerate's tracker objects on rank 0."""

    def __init__(self, cfg):
        from accelerate.tracking import LOGGER_TYPE_TO_CLASS
        self.trackers = []
        for name in cfg.logging.trackers:
            kwargs = {"logging_dir": cfg.logging.dir} if name == "tensorboard" else {}
            tracker = LOGGER_TYPE_TO_CLASS[name](cfg.run.name, **kwargs)
            if hasattr(tracker, "start"):  # accelerate opens a tracker's run here, lazily
                tracker.start()
            self.trackers.append(tracker)
        self.gen_seen: int | None = None

    def log(self, values: dict, step: int) -> None:
        for t in self.trackers:
            t.log(values, step=step)

    def recovery(self, job, step: int) -> None:
        """After the first step committed in a new generation (past the first), log how that
        generation was entered: the step it resumed at, the time to regroup and to move the
        state, the bytes this rank received."""
        if self.gen_seen is None:
            self.gen_seen = job.gen  # a replacement rank 0 logs the recovery that made it
            if job.gen == 0:
                return
        elif job.gen == self.gen_seen:
            return
        self.gen_seen = job.gen
        info = job.last_recovery or {}
        values = {"recovery/generation": job.gen,
                  "recovery/resumed_step": info.get("resumed_step", step)}
        if "t_group" in info and "t_plan" in info:
            values["recovery/regroup_s"] = info["t_group"] - info["t_plan"]
        if "t_ready" in info and "t_group" in info:
            values["recovery/state_transfer_s"] = info["t_ready"] - info["t_group"]
        if "bytes_received" in info:
            values["recovery/bytes_received"] = info["bytes_received"]
        self.log(values, step)

    def finish(self) -> None:
        for t in self.trackers:
            t.finish()
