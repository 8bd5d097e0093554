"""Node health: is this machine fit to train? Checked as a launcher starts, and in every spare as
it warms up and while it waits, so that an unhealthy spare is never promoted.

Checks (`checkpointless.health.*`, Spec.health; each off at its zero default):
  * `command`: a script of the user's (as Slurm's HealthCheckProgram), run through the shell with
    CL_DEVICE_SLOT set; a non-zero exit is unhealthy, its last line of output the reason;
  * `min_free_memory_gb`: the host's available memory (MemAvailable), for the plan's host rows;
  * `min_free_disk_gb` at `disk_path`: room for checkpoints and the data cache;
  * on GPUs (`gpu`, on by default), through NVML (the `nvidia-ml-py` package): uncorrected ECC
    errors, XID errors seen since the last check, hardware or thermal throttling, and
    `min_free_device_memory_gb`. Where there is no GPU (or no NVML), they are skipped and
    `check` says so once in its notes.

`check` returns the problems found (empty: healthy) and notes; `HealthWatch` runs it in a spare
(first before the spare says it is ready, then every `every_s` until it holds a rank) and writes
each outcome to the store under `protocol.health_key(wid)`, where the supervisor reads it before it
hands the spare a rank (policy.healthy_spares).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time

from .. import protocol

DEFAULTS = {"command": None, "timeout_s": 30.0, "every_s": 10.0, "min_free_memory_gb": 0.0,
            "min_free_disk_gb": 0.0, "disk_path": ".", "gpu": True,
            "min_free_device_memory_gb": 0.0}
GB = 1024 ** 3


def settings(given: dict | None) -> dict:
    """The health settings with every default filled in."""
    return {**DEFAULTS, **(given or {})}


def enabled(given: dict | None) -> bool:
    """Whether anything is checked here: a command, a threshold, or NVML's GPU checks."""
    h = settings(given)
    if h["command"] or h["min_free_memory_gb"] > 0 or h["min_free_disk_gb"] > 0:
        return True
    if not h["gpu"]:
        return False
    import torch
    if not torch.cuda.is_available():
        return False
    try:
        import pynvml
        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount() > 0
    except Exception:  # noqa: BLE001  no NVML, or no device
        return False


def free_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def check(given: dict | None, slot: int | None = None, gpu_state: dict | None = None):
    """(problems, notes) of this node for device `slot` (None: every device)."""
    h = settings(given)
    problems, notes = [], []
    if h["min_free_memory_gb"] > 0:
        free = free_memory_bytes() / GB
        if free < h["min_free_memory_gb"]:
            problems.append(f"host memory: {free:.1f} GB available, below "
                            f"checkpointless.health.min_free_memory_gb={h['min_free_memory_gb']:g}")
    if h["min_free_disk_gb"] > 0:
        path = h["disk_path"] or "."
        os.makedirs(path, exist_ok=True)
        free = shutil.disk_usage(path).free / GB
        if free < h["min_free_disk_gb"]:
            problems.append(f"disk: {free:.1f} GB free at {path}, below "
                            f"checkpointless.health.min_free_disk_gb={h['min_free_disk_gb']:g}")
    if h["command"]:
        problems += _command(h["command"], h["timeout_s"], slot)
    if h["gpu"]:
        p, n = _gpu(h, slot, gpu_state if gpu_state is not None else {})
        problems, notes = problems + p, notes + n
    return problems, notes


def _command(command: str, timeout_s: float, slot: int | None) -> list[str]:
    env = dict(os.environ)
    if slot is not None:
        env[protocol.ENV_DEVICE_SLOT] = str(slot)
    try:
        r = subprocess.run(command, shell=True, capture_output=True, text=True,
                           timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return [f"health command {command!r} did not finish within {timeout_s:g} s "
                "(checkpointless.health.timeout_s)"]
    if r.returncode == 0:
        return []
    said = (r.stdout + r.stderr).strip().splitlines()
    return [f"health command {command!r} exited {r.returncode}" +
            (f": {said[-1]}" if said else "")]


def _gpu(h: dict, slot: int | None, state: dict):
    """NVML's checks; `state` keeps what must persist between checks (the XID event set)."""
    import torch
    if not torch.cuda.is_available():
        return [], ["health: no GPU here: the GPU checks (ECC, XID, throttling, device memory) "
                    "are skipped"]
    try:
        import pynvml
    except ImportError:
        return [], ["health: NVML not available (pip install nvidia-ml-py): the GPU checks "
                    "(ECC, XID, throttling, device memory) are skipped"]
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except pynvml.NVMLError:
        return [], ["health: no GPU here: the GPU checks (ECC, XID, throttling, device memory) "
                    "are skipped"]
    problems = []
    for i in range(count) if slot is None else [slot % max(1, count)]:
        d = pynvml.nvmlDeviceGetHandleByIndex(i)
        try:
            ecc = pynvml.nvmlDeviceGetTotalEccErrors(d, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                     pynvml.NVML_VOLATILE_ECC)
            if ecc:
                problems.append(f"GPU {i}: {ecc} uncorrected ECC errors since the driver loaded")
        except pynvml.NVMLError:  # ECC off or not supported on this device
            pass
        bad = getattr(pynvml, "nvmlClocksThrottleReasonHwSlowdown", 0x8) | \
            getattr(pynvml, "nvmlClocksThrottleReasonHwThermalSlowdown", 0x40)
        try:
            reasons = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(d)
            if reasons & bad:
                problems.append(f"GPU {i}: clocks throttled by the hardware (reasons "
                                f"{reasons:#x}: slowdown or thermal)")
        except pynvml.NVMLError:
            pass
        if h["min_free_device_memory_gb"] > 0:
            free = pynvml.nvmlDeviceGetMemoryInfo(d).free / GB
            if free < h["min_free_device_memory_gb"]:
                problems.append(f"GPU {i}: {free:.1f} GB free, below checkpointless.health."
                                f"min_free_device_memory_gb={h['min_free_device_memory_gb']:g}")
        problems += _xids(pynvml, d, i, state)
    return problems, []


def _xids(pynvml, handle, i: int, state: dict) -> list[str]:
    """XID errors since the previous check (the first check registers for them)."""
    key = f"xid{i}"
    try:
        if key not in state:
            state[key] = pynvml.nvmlEventSetCreate()
            pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError,
                                            state[key])
            return []
        found = []
        while True:
            try:
                e = pynvml.nvmlEventSetWait(state[key], 0)
            except pynvml.NVMLError_Timeout:
                return found
            found.append(f"GPU {i}: XID {e.eventData} reported")
    except pynvml.NVMLError:  # events not supported here (some virtualized devices)
        return []


def record(store, wid: int, problems: list[str]) -> None:
    store.set(protocol.health_key(wid),
              json.dumps({"ok": not problems, "problems": problems, "t": time.time()}))


class HealthWatch:
    """A spare's checks: once now (before it says it is ready), then every `every_s` on a thread
    of its own, until `stop()` (it took a rank)."""

    def __init__(self, store_connect, wid: int, given: dict, slot: int | None):
        self.connect, self.wid, self.given, self.slot = store_connect, wid, given, slot
        self._stop = threading.Event()
        self._gpu: dict = {}

    def first(self, store) -> None:
        problems, _ = check(self.given, self.slot, self._gpu)  # the launcher said the notes
        record(store, self.wid, problems)
        if problems:
            print(f"[checkpointless] spare worker {self.wid} is unhealthy: "
                  f"{'; '.join(problems)}", flush=True)
        threading.Thread(target=self._run, daemon=True, name="checkpointless-health").start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        every = settings(self.given)["every_s"]
        try:
            store = self.connect()
            while not self._stop.wait(every):
                record(store, self.wid, check(self.given, self.slot, self._gpu)[0])
        except Exception:  # noqa: BLE001  the store is gone: the job is over
            return
