"""Typed records that cross processes (filled in below)."""
from __future__ import annotations
