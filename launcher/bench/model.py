"""The goodput model the benchmark report prints at cluster scale: each scenario run through the
goodput simulator (goodput_sim.py) on one seeded trace, fed with the steady overhead the benchmark
measured. A simulation, not a measurement: report.py prints the inputs beside the result, and
docs/scale.md gives every other input of the simulator with its source."""
from __future__ import annotations

import random

__all__ = ["SCENARIOS", "model_rows", "scenario", "young_interval_s"]

DETECT_S = 0.1  # exits are seen within one supervisor poll (see the report's detect_s)
GPUS_PER_NODE = 8
EVENTS = 3000  # failures simulated per scenario: the goodput's statistical error is ~1/sqrt of it
SEED = 0

# name, parameters, GPUs, spare GPUs (whole nodes of 8 count as spare nodes), tokens per step,
# MTBF hours (source), restart minutes, regroup seconds (communicator rebuild at that scale,
# assumed from NVIDIA's published costs)
SCENARIOS = [
    ("Llama-3-8B, 8 GPUs", 8e9, 8, 1, 0.5e6,
     1000 / 4.4 * 24, "Meta: 2.3-6.5 failures per 1000 node-days (4.4 used), 1 node", 10, 1.0),
    ("Llama-3-70B, 1,024 GPUs", 70e9, 1024, 8, 4e6,
     7.9, "Meta: measured MTTF of a 1024-GPU job", 15, 2.0),
    ("405B, 16,384 GPUs", 405e9, 16384, 64, 16e6,
     54 * 24 / 419, "Llama 3: 419 interruptions in 54 days", 30, 5.0),
]


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's checkpoint interval (goodput_sim's)."""
    from launcher.bench import goodput_sim  # imported on use: `python -m launcher.bench.goodput_sim` runs it
    return goodput_sim.young_interval_s(save_s, mtbf_s)


def scenario(name, params, gpus, spares, tokens, mtbf_h, source, restart_min, regroup_s,
             detect_s, overhead):
    """One scenario through the simulator: the job's MTBF spread over its GPUs, split into
    process, node and rack failures as goodput_sim's defaults say."""
    from launcher.bench.goodput_sim import BYTES_PER_PARAM, Inputs, simulate, trace
    nodes = max(1, gpus // GPUS_PER_NODE)
    inp = Inputs(nodes=nodes, gpus_per_node=gpus // nodes, params=params,
                 tokens_per_step=tokens, failures_per_gpu_hour=1 / (mtbf_h * gpus),
                 detect_process_s=detect_s, regroup_s=regroup_s, restart_min=restart_min,
                 overhead=max(0.0, overhead), days=EVENTS * mtbf_h / 24).resolved()
    failures = trace(inp, random.Random(SEED))
    restart = simulate(inp, failures, None)
    cl = simulate(inp, failures, spares // GPUS_PER_NODE)
    r_cl = detect_s + inp.control_plane_s + regroup_s + inp.transfer_s + inp.step_s / 2
    return {
        "scenario": name, "mtbf_h": round(mtbf_h, 2), "mtbf_source": source,
        "state_per_gpu_gb": round(BYTES_PER_PARAM * params / gpus / 1e9, 2),
        "checkpoint_s": round(inp.save_s, 2),
        "young_tau_min": round(inp.restart_interval_s / 60, 1), "step_s": round(inp.step_s, 2),
        "restart_recovery_min": restart_min, "checkpointless_recovery_s": round(r_cl, 2),
        "goodput_restart": round(restart.goodput, 4), "goodput_checkpointless": round(cl.goodput, 4),
        "spare_gpu_share": round(spares / (gpus + spares), 4),
    }


def model_rows(overhead: float) -> list[dict]:
    """Every scenario, with the steady overhead measured here."""
    return [scenario(*s, detect_s=DETECT_S, overhead=overhead) for s in SCENARIOS]
