"""A goodput model at cluster scale, fed with what the benchmark measured. A model, not a
measurement: arithmetic only; report.py prints every input beside the result, and the assumed
ones say so.

    restart:        waste = C/tau + (R_restart + tau/2)/M,   tau = sqrt(2*C*M) (Young)
    checkpointless: waste = R_cl/M + overhead,   R_cl = detect + regroup + transfer + step/2
    goodput = 1 - waste
"""
from __future__ import annotations

import math

BYTES_PER_PARAM = 16  # bf16 weights and grads, fp32 master and two Adam moments
FLOPS_PER_GPU = 4e14  # H100 bf16 dense ~989 TFLOP/s at ~40% utilisation (assumed)
WRITE_BPS_PER_GPU = 1e9  # checkpoint write bandwidth each GPU gets from storage (assumed)
LINK_BPS = 50e9  # GPU-to-GPU bandwidth for the peer state transfer (assumed)
DETECT_S = 0.1  # exits are seen within one supervisor poll (see the report's detect_s)

# name, parameters, GPUs, spares, tokens per step, MTBF hours (source), restart minutes,
# regroup seconds (communicator rebuild at that scale, assumed from NVIDIA's published costs)
SCENARIOS = [
    ("Llama-3-8B, 8 GPUs", 8e9, 8, 1, 0.5e6,
     1000 / 4.4 * 24, "Meta: 2.3-6.5 failures per 1000 node-days (4.4 used), 1 node", 10, 1.0),
    ("Llama-3-70B, 1,024 GPUs", 70e9, 1024, 8, 4e6,
     7.9, "Meta: measured MTTF of a 1024-GPU job", 15, 2.0),
    ("405B, 16,384 GPUs", 405e9, 16384, 64, 16e6,
     54 * 24 / 419, "Llama 3: 419 interruptions in 54 days", 30, 5.0),
]


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's checkpoint interval: the one that minimises save cost plus work lost."""
    return math.sqrt(2 * save_s * mtbf_s)


def scenario(name, params, gpus, spares, tokens, mtbf_h, source, restart_min, regroup_s,
             detect_s, overhead):
    m = mtbf_h * 3600
    state_per_gpu = BYTES_PER_PARAM * params / gpus
    c = state_per_gpu / WRITE_BPS_PER_GPU
    tau = young_interval_s(c, m)
    step_s = 6 * params * tokens / (gpus * FLOPS_PER_GPU)
    r_restart = restart_min * 60
    waste_rs = c / tau + (r_restart + tau / 2) / m
    r_cl = detect_s + regroup_s + state_per_gpu / LINK_BPS + step_s / 2
    waste_cl = r_cl / m + max(0.0, overhead)
    return {
        "scenario": name, "mtbf_h": round(mtbf_h, 2), "mtbf_source": source,
        "state_per_gpu_gb": round(state_per_gpu / 1e9, 2), "checkpoint_s": round(c, 2),
        "young_tau_min": round(tau / 60, 1), "step_s": round(step_s, 2),
        "restart_recovery_min": restart_min, "checkpointless_recovery_s": round(r_cl, 2),
        "goodput_restart": round(1 - waste_rs, 4), "goodput_checkpointless": round(1 - waste_cl, 4),
        "spare_gpu_share": round(spares / (gpus + spares), 4),
    }


def model_rows(overhead: float) -> list[dict]:
    """Every scenario, with the steady overhead measured here."""
    return [scenario(*s, detect_s=DETECT_S, overhead=overhead) for s in SCENARIOS]
