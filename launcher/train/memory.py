"""What a worker's memory held, for report.json's `memory`: its resident set once the imports are
done (the baseline), its peak, and the bytes of model state and peer replicas it kept.

Resident set figures come from the kernel (/proc/self/status: VmRSS now, VmHWM the high-water
mark since the process started), so they count everything the process touched: Python, torch,
the data cache, tensors, and allocator slack. The peak above the baseline is what training added.
"""
from __future__ import annotations

import resource

_baseline: int | None = None


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    kb = _status_kb("VmRSS")
    return kb * 1024 if kb is not None else peak_rss_bytes()


def peak_rss_bytes() -> int:
    kb = _status_kb("VmHWM")
    if kb is None:  # no /proc: ru_maxrss is the same high-water mark, in KiB on Linux
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * 1024


def mark_baseline() -> None:
    """Call once the heavy imports are done and before the model is built."""
    global _baseline
    if _baseline is None:
        _baseline = rss_bytes()


def _local_bytes(t) -> int:
    from checkpointless.worker import local_part  # lazily, as torch: see mark_baseline
    t = local_part(t)
    return t.numel() * t.element_size()


def held(model, optimizer, replica_bytes: int | None, snapshot_bytes: int | None = None) -> dict:
    """This rank's figures. Call at the end of training, before anything gathers the full state
    (the peak is read then: `peak_rss_bytes` is training's, not the end-of-run gather's)."""
    import torch
    params = sum(_local_bytes(p) for p in model.parameters())
    optim = sum(_local_bytes(v) for st in optimizer.state.values() for v in st.values()
                if isinstance(v, torch.Tensor))
    return {"baseline_rss_bytes": _baseline, "peak_rss_bytes": peak_rss_bytes(),
            "param_bytes": params, "optimizer_state_bytes": optim,
            "model_state_bytes": params + optim, "replica_bytes": replica_bytes or 0,
            "snapshot_bytes": snapshot_bytes or 0}
