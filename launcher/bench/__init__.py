"""Goodput benchmark: checkpointless against checkpoint-restart, side by side, in one run.

    make bench                                   (defaults: tiny-llama, 4 workers + 1 spare,
    python -m launcher bench bench.mtbf_s=60      one failure a minute, about 10 minutes)

Four modes train the same recipe, seed and step count:
  off             plain loop under torchrun, no fault tolerance, no failure (the reference speed)
  on              under the checkpointless supervisor with a spare, no failure (steady overhead)
  checkpointless  as `on`, with workers SIGKILLed on a seeded schedule
  restart         torchrun with --max-restarts: every failure restarts all workers, which resume
                  from the newest disk checkpoint, saved every tau steps (Young's optimum)

The parts, each a module (arrows are imports; there are no cycles):
  command   bench(args): runs the modes in order          -> everything below
  config    BenchConfig, `bench.*` keys, the mode list
  modes     the recipe of each mode; a supervised run     -> failures
  baseline  the torchrun baseline: command, run, workers  -> failures, model
  paired    off and on taking turns, for the overhead     -> modes, baseline, records
  failures  the seeded failure schedule and the killer    -> records
  records   figures from step records (metrics.jsonl)     -> checkpointless.goodput
  report    the tables and bench.json                     -> config, model, plot
  plot      steps over time, failures marked
  model     the goodput model at cluster scale, arithmetic only
"""
from .command import bench

__all__ = ["bench"]
