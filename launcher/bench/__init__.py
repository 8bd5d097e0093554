"""Goodput benchmark: checkpointless against checkpoint-restart, side by side, in one run.

    make bench                                   (defaults: tiny-llama, 4 workers + 1 spare,
    python -m launcher bench bench.mtbf_s=60      one failure a minute, about 10 minutes)

These modes train the same recipe, seed and step count (fsdp and fsdp-replicated: see modes.py):
  off             the recipe loop under torchrun, no fault tolerance, no failure
  on              under the checkpointless supervisor with a spare, no failure (steady overhead)
  plain           a torch-only loop under torchrun (torch's DDP, or FSDP2 under
                  distributed.strategy=fsdp): what a user would run instead. It takes turns
                  with off and on in the paired run by default (bench.paired_plain), and the
                  report prints the recipe loop's step time over it; bench.modes=off,on,plain
                  adds its own run and table row
  checkpointless  as `on`, with workers SIGKILLed on a seeded schedule
  restart         torchrun with --max-restarts: every failure restarts all workers, which resume
                  from the newest disk checkpoint, saved every tau steps (Young's optimum)

The parts, each a module (arrows are imports; there are no cycles):
  command   bench(args): runs the modes in order          -> everything below
  config    BenchConfig, `bench.*` keys, the mode list
  modes     the recipe of each mode; a supervised run     -> failures
  baseline  the torchrun baseline: command, run, workers  -> failures, model
  paired    off, on (and plain) taking turns              -> modes, baseline, records
  plain_loop the plain mode's worker (torch only)         -> launcher.train.loop, launcher.data.prepare
  failures  the seeded failure schedule and the killer    -> records
  records   figures from step records (metrics.jsonl)     -> checkpointless.control.goodput
  report    the tables and bench.json                     -> config, model, plot
  plot      steps over time, failures marked
  model     the goodput model at cluster scale, arithmetic only
"""
from launcher.bench.command import bench

__all__ = ["bench"]
