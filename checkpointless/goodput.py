"""Goodput: computed in report.py (goodput_from_steps); this name stays for its importers."""
from .report import goodput_from_steps

__all__ = ["goodput_from_steps"]
