"""Experiment trackers through the loop's Accelerator (`logging.trackers`): every committed step's
figures, each validation, and each recovery as a marked event with its phases, written by rank 0
(accelerate's main process) with `accelerator.init_trackers` and `accelerator.log`.

A step is logged once, when it commits: a step cut short by a failure and redone is logged in its
final attempt only. When rank 0 itself is replaced, the replacement's Accelerator opens the same
run again (the same `logging.dir` for file-based trackers, the same W&B run id, the MLflow run its
predecessor created, whose id rank 0 keeps in the job's store: see launcher/train/accelerator.py) and
goes on from the agreed step.

MLflow without MLFLOW_TRACKING_URI writes to a file store in `logging.dir`/mlruns (MLflow 3 asks
for MLFLOW_ALLOW_FILE_STORE=true to use one; it is set only for that default).
"""
from __future__ import annotations

import json
import os
import queue
import threading
import time
from datetime import timedelta
from pathlib import Path

from checkpointless import protocol

from launcher.train.accelerator import tracker_kwargs


def _job_store():
    """The job's store, under the supervisor (None under torchrun: no replacement to tell)."""
    if not os.environ.get("CL_STORE_PORT"):
        return None
    from checkpointless.protocol import membership
    return membership.connect(os.environ["CL_STORE_HOST"], int(os.environ["CL_STORE_PORT"]))


def _job_store_get(key: str) -> str | None:
    store = _job_store()
    if store is None or not store.check([key]):
        return None
    return store.get(key).decode()


def _job_store_set(key: str, value: str) -> None:
    store = _job_store()
    if store is not None:
        store.set(key, value)


class Trackers:
    """accelerate's trackers on rank 0, and which recoveries were logged."""

    def __init__(self, cfg, accelerator, replacement: bool = False, metrics_file=None):
        self.accelerator = accelerator
        self.cfg, self.metrics_file = cfg, metrics_file
        # a replacement rank 0 first gives W&B what its predecessor's W&B lost (wandb_refill.py)
        self._refill = replacement and "wandb" in cfg.logging.trackers and metrics_file
        mlflow_run = None
        if "mlflow" in cfg.logging.trackers:
            if not os.environ.get("MLFLOW_TRACKING_URI"):
                uri = (Path(cfg.logging.dir).resolve() / "mlruns").as_uri()
                os.environ.update(MLFLOW_TRACKING_URI=uri, MLFLOW_ALLOW_FILE_STORE="true")
            mlflow_run = _job_store_get(protocol.tracker_run_key("mlflow"))
        # the Accelerator was built with log_with=logging.trackers, logging_dir=logging.dir
        accelerator.init_trackers(cfg.run.name, init_kwargs=tracker_kwargs(cfg, mlflow_run))
        if "mlflow" in cfg.logging.trackers and mlflow_run is None:
            for tracker in accelerator.trackers:  # the next rank 0 continues this run
                if tracker.name == "mlflow":
                    _job_store_set(protocol.tracker_run_key("mlflow"), tracker.active_run.info.run_id)
        self.gen_seen: int | None = None
        self.stragglers: queue.SimpleQueue = queue.SimpleQueue()  # entries not yet logged
        if os.environ.get("CL_STORE_PORT"):  # under the supervisor: follow its stragglers
            threading.Thread(target=self._follow_stragglers, args=(time.time(),), daemon=True,
                             name="trackers-stragglers").start()

    def log(self, values: dict, step: int) -> None:
        if self._refill:
            self._refill = False
            self._refill_wandb(step)
        # W&B writes a step's row once a later step arrives (the recovery's figures join the
        # row of the step they are logged at); what a kill loses, the next rank 0 gives again
        self.accelerator.log(values, step=step)

    def _refill_wandb(self, step: int) -> None:
        from launcher.train.wandb_refill import refill
        first = _job_store_get(protocol.FIRST_STEP)
        for tracker in self.accelerator.trackers:
            if tracker.name == "wandb":
                n = refill(tracker.run, self.cfg.logging.dir, self.metrics_file,
                           int(first) if first else 0, step)
                if n:
                    self.accelerator.print(f"[trackers] W&B lacked {n} step(s) its previous rank "
                                           "0 had logged: given again from metrics.jsonl",
                                           flush=True)

    def _follow_stragglers(self, since: float) -> None:
        """Block on the supervisor's next straggler line (no store call per step) and queue
        it for the training thread; a replacement rank 0 skips those logged before it came."""
        from checkpointless.protocol import membership
        try:
            store = membership.connect(os.environ["CL_STORE_HOST"],
                                       int(os.environ["CL_STORE_PORT"]))
            i = 0
            while True:
                key = protocol.straggler_key(i)
                store.wait([key], timedelta(days=1))
                entry = json.loads(store.get(key))
                if entry["t"] >= since:
                    self.stragglers.put(entry)
                i += 1
        except Exception:  # noqa: BLE001  the store is gone: the job is over
            return

    def recovery(self, job, step: int) -> None:
        """After the first step committed in a new generation (past the first), log how that
        generation was entered: the step it resumed at, the time to regroup and to move the
        state, the bytes this rank received. Any straggler found or dealt with since the last
        step is logged too."""
        while not self.stragglers.empty():
            e = self.stragglers.get()
            self.log({"straggler/rank": e["rank"], "straggler/factor": e["factor"],
                      "straggler/from_step": e["from_step"],
                      "straggler/evicted": int(e["action"] == "evicted")}, step)
        if self.gen_seen is None:
            self.gen_seen = job.gen  # a replacement rank 0 logs the recovery that made it
            if job.gen == 0:
                return
        elif job.gen == self.gen_seen:
            return
        self.gen_seen = job.gen
        info = job.last_recovery or {}
        values = {"recovery/generation": job.gen, "recovery/processes": job.world_size,
                  "recovery/resumed_step": info.get("resumed_step", step)}
        if "t_group" in info and "t_plan" in info:
            values["recovery/regroup_s"] = info["t_group"] - info["t_plan"]
        if "t_ready" in info and "t_group" in info:
            values["recovery/state_transfer_s"] = info["t_ready"] - info["t_group"]
        if "bytes_received" in info:
            values["recovery/bytes_received"] = info["bytes_received"]
        self.log(values, step)

    def finish(self) -> None:
        # not accelerator.end_training(): it would destroy the process group, which the job
        # still needs for the final digest and leaves itself in job.finish()
        for tracker in self.accelerator.trackers:
            tracker.finish()
