"""The training process: joining a job, the step boundary, recovery inside the healthy workers,
peer-to-peer state transfer and redundancy, the bit-exact gradient reduction, on-disk checkpoints.
It imports protocol/ and nothing of the control plane (control/, ha/): a worker never needs the
code that supervises it.

Besides the public API in `checkpointless`, the launcher's training side uses the names below.
"""
from . import durable, health
from .consistency import params_checksum
from .digest import StateDigest, model_sha256, state_sha256
from .durable import ShardedCheckpoints
from .redundancy import KEEP, ROLLBACK_KEEP
from .mesh import Layout
from .seeding import seed_all
from .tensors import full_tensor, is_dtensor, local_part, local_tensor

__all__ = ["durable", "health", "params_checksum", "StateDigest", "model_sha256", "state_sha256",
           "ShardedCheckpoints", "KEEP", "ROLLBACK_KEEP", "Layout", "full_tensor", "is_dtensor",
           "local_part", "local_tensor", "seed_all"]

# logical ranks (issue 40): a fixed logical world on however many processes host it
from .logical import Placement, logical_all_reduce, logical_all_reduce_grads  # noqa: E402

__all__ += ["Placement", "logical_all_reduce", "logical_all_reduce_grads"]

# under fsdp: FSDP2's reduce-scatter in logical order, and clipping on whole gradients
from .fsdp_logical import LogicalFSDP, exact_clip_grad_norm_  # noqa: E402

__all__ += ["LogicalFSDP", "exact_clip_grad_norm_"]
