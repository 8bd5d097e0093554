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

The parts, each a module (imports run down this list; tests/test_layers.py checks no cycle):
  command        bench(args): runs the modes in order, then the paired run, then the report
  config         BenchConfig, the `bench.*` keys, the mode list
  modes          the recipe of each mode; a supervised run
  shrink         the shrink modes (checkpointless.shrink)
  baseline       the torchrun baseline: command, run, workers; the consistency and copy probes
  paired         off, on (and plain) taking turns: the steady overhead
  plain_loop     the plain mode's worker (torch only)
  failures       the seeded failure schedule and the thread that carries it out
  records        figures from step records (metrics.jsonl)
  report         the tables and bench.json; compared: one mode read against another
  plot           steps over time, failures marked
  model          the goodput model at cluster scale, through goodput_sim (its inputs in
                 goodput_inputs; `python -m launcher.bench.goodput_sim`)
  boundary, regroup, data_rate    probes of their own: the step boundary's cost, forming a
                 group by world size, how fast raw text is prepared
  scale/         the control plane at thousands of simulated ranks (`python -m launcher.bench.scale`)
"""
from launcher.bench.command import bench

__all__ = ["bench"]
