"""The goodput simulator's inputs (goodput_sim.py runs them): each default with where it comes
from (a published failure log, a measurement here, or a stated assumption), and `Inputs`, whose
unset fields are derived from the job's size by `resolved()`. Stdlib only."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

# Llama 3 405B pre-training: 419 unexpected interruptions in 54 days on 16,384 GPUs (Meta, "The
# Llama 3 Herd of Models", 2024, section 3.3.4, table 5). Per GPU, so it scales to any job.
LLAMA3_PER_GPU_HOUR = 419 / (54 * 24 * 16384)
# Table 5 split by what a failure takes. Whole node (265 of 419): faulty GPU 148, GPU system
# processor 17, silent data corruption 6, GPU thermal interface and sensor 6 (a GPU to take out
# of service), network switch/cable 35, host maintenance 32, NIC 7, SSD 3, power supply 3, server
# chassis 2, IO expansion board 2, CPU 2, system memory 2. One process (154): software bug 54,
# dependency 2, NCCL watchdog timeouts 7, GPU HBM3 memory 72, GPU SRAM memory 19 (a memory error
# kills the process; the driver retires the bad row and the GPU serves again after a GPU reset:
# our judgement, the table does not say how each was fixed).
NODE_SHARE = 265 / 419
# Rack-wide share of node failures: an assumption. Table 5 does not say how many of its 35 switch
# and cable interruptions took more than one node; all 35 would be 35/265 = 13%. We take 5%.
RACK_SHARE = 0.05
NODES_PER_RACK = 2  # Llama 3 section 3.3.1: each rack hosts 16 GPUs in two servers, one ToR switch
REFILL_H = 24.0  # time to repair or replace a node and return it to the pool: an assumption
# Measured here (docs/log.md, `make train`, 2026-11-30): a killed process detected 0.06 s after.
DETECT_PROCESS_S = 0.06
# docs/multinode.md: a node is lost when its beat has not moved for node_timeout_s (default 3 s).
DETECT_NODE_S = 3.0
# Decision to barrier at thousands of ranks, measured by the scale harness (docs/scale.md,
# 2026-12-03): 0.16 s at 1,024 simulated ranks, 0.76-0.90 s at 4,096 on two shared cores. Taken
# as 1 s, the rounded bound, for every size: no larger size could be measured here.
CONTROL_PLANE_S = 1.0
BYTES_PER_PARAM = 16  # bf16 weights and grads, fp32 master and two Adam moments
FLOPS_PER_GPU = 4e14  # H100 bf16 dense ~989 TFLOP/s at ~40% utilisation (assumed, as model.py)
WRITE_BPS_PER_GPU = 1e9  # checkpoint write bandwidth per GPU (assumed, as model.py)
LINK_BPS = 50e9  # GPU-to-GPU bandwidth of the peer state transfer (assumed, as model.py)
# Steady overhead of in-process recovery, by default the step boundary's own cost over the step:
# 1.04-1.41 ms a step, `python -m launcher.bench.boundary 1500` after issue 20's redesign
# (docs/log.md, 2026-12-01; the larger figure used). It leaves out what peer replication of the
# state costs at scale, not measured here. The whole-loop figure on the 2-core machine, +1.8%
# (`make bench`, docs/log.md, 2026-11-30, noise about +-3% at a 0.23 s step), is the
# pessimistic alternative: `--overhead 0.018`.
BOUNDARY_S = 1.41e-3
CHECKPOINT_MIN = 60.0  # in-process's durable checkpoint interval: an assumption (hourly)


def by_scale(gpus: int, points) -> float:
    """Log-linear through (GPUs, value) points, held flat outside them."""
    if gpus <= points[0][0]:
        return points[0][1]
    for (g0, v0), (g1, v1) in zip(points, points[1:]):
        if gpus <= g1:
            return v0 + (v1 - v0) * math.log(gpus / g0) / math.log(g1 / g0)
    return points[-1][1]


# Communicator rebuild at scale, not measurable on this machine: model.py's assumption (1 s at 8,
# 2 s at 1,024 and 5 s at 16,384 GPUs, taken from NVIDIA's published costs), not a measurement.
REGROUP_POINTS = [(8, 1.0), (1024, 2.0), (16384, 5.0)]
# Restart minutes: model.py's 10/15/30 at those sizes, on AWS HyperPod's "15-30 minutes or more".
RESTART_POINTS = [(8, 10.0), (1024, 15.0), (16384, 30.0)]


@dataclass
class Inputs:
    nodes: int = 128
    gpus_per_node: int = 8
    params: float = 70e9
    tokens_per_step: float = 4e6
    step_s: float | None = None  # None: 6 * params * tokens / (GPUs * FLOPS_PER_GPU)
    failures_per_gpu_hour: float = LLAMA3_PER_GPU_HOUR
    node_share: float = NODE_SHARE
    rack_share: float = RACK_SHARE
    nodes_per_rack: int = NODES_PER_RACK
    refill_h: float = REFILL_H
    detect_process_s: float = DETECT_PROCESS_S
    detect_node_s: float = DETECT_NODE_S
    control_plane_s: float = CONTROL_PLANE_S
    regroup_s: float | None = None  # None: by_scale(REGROUP_POINTS)
    transfer_s: float | None = None  # None: state per GPU / LINK_BPS
    save_s: float | None = None  # None: state per GPU / WRITE_BPS_PER_GPU
    checkpoint_min: float = CHECKPOINT_MIN
    restart_min: float | None = None  # None: by_scale(RESTART_POINTS)
    overhead: float | None = None  # None: BOUNDARY_S / step
    standalone_coordinator: bool = False
    restart_interval_s: float | None = None  # None: Young's interval for the whole failure rate
    days: float = 365.0

    def resolved(self) -> "Inputs":
        """A copy with every derived default filled in."""
        g = self.gpus
        state = BYTES_PER_PARAM * self.params / g
        mtbf_s = 3600 / (self.failures_per_gpu_hour * g)
        save = self.save_s if self.save_s is not None else state / WRITE_BPS_PER_GPU
        step = self.step_s if self.step_s is not None \
            else 6 * self.params * self.tokens_per_step / (g * FLOPS_PER_GPU)
        return replace(
            self, step_s=step,
            overhead=self.overhead if self.overhead is not None else BOUNDARY_S / step,
            regroup_s=self.regroup_s if self.regroup_s is not None
            else by_scale(g, REGROUP_POINTS),
            transfer_s=self.transfer_s if self.transfer_s is not None else state / LINK_BPS,
            save_s=save,
            restart_min=self.restart_min if self.restart_min is not None
            else by_scale(g, RESTART_POINTS),
            restart_interval_s=self.restart_interval_s if self.restart_interval_s is not None
            else young_interval_s(save, mtbf_s))

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's checkpoint interval: the one that minimises save cost plus work lost."""
    return math.sqrt(2 * save_s * mtbf_s)
