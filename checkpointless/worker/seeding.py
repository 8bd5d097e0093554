"""Per-step seeds: the random numbers of a step depend on (seed, step, rank, micro-batch) only."""
from __future__ import annotations

import hashlib
import random

import torch


def step_seed(seed: int, step: int, rank: int, micro: int = 0) -> int:
    """A seed that depends only on (seed, step, rank, micro-batch), never on process history.

    Seeding every step this way makes dropout and sampling identical whichever process runs the
    rank, so a spare redoing a step draws the same random numbers as the worker it replaced.
    """
    h = hashlib.sha256(f"{seed}/{step}/{rank}/{micro}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def seed_all(s: int) -> int:
    """Seed torch, Python's random and NumPy (when installed) with `s`."""
    torch.manual_seed(s)
    random.seed(s)
    try:
        import numpy as np
        np.random.seed(s % (2 ** 32))
    except ImportError:
        pass
    return s
