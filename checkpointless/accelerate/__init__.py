"""The drop-in `accelerate.Accelerator` (accelerator.py) and what it wraps around accelerate's
objects (wrappers.py). Importing this package imports accelerate; `import checkpointless` does not."""
from .accelerator import Accelerator

__all__ = ["Accelerator"]
