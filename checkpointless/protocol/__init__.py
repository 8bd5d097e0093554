"""What the two sides of a job say to each other: the store's keys and the workers' environment
(keys.py), the defaults, the job's Spec and the supervisor's configuration (settings.py), the
generation handshake (membership.py), the typed records that cross processes (records.py) and the
fault grammar (faults.py). It imports nothing else of checkpointless, so both the training
process (worker/) and the control plane (control/) build on it without seeing each other.

`from checkpointless import protocol; protocol.plan_key(g)` reads a key here as before.
"""
from . import faults, keys, layout, membership, records, replay, settings
from .faults import Fault, FaultError, parse_fault, parse_faults, split_fault
from .keys import *  # noqa: F401,F403  (every key and helper: keys.__all__)
from .keys import __all__ as _keys
from .layout import Layout
from .settings import DEFAULTS, Defaults, Spec, SupervisorConfig, default_replication, recovery_timeout_s

__all__ = [*_keys, "DEFAULTS", "Defaults", "Spec", "SupervisorConfig", "default_replication",
           "recovery_timeout_s", "Fault", "FaultError", "parse_fault", "parse_faults", "split_fault",
           "faults", "keys", "layout", "membership", "records", "settings", "Layout"]
