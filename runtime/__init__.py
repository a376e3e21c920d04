"""Execution side of mgraph, installed as ``mgraph.runtime``."""

from __future__ import annotations

from .memory import allocate, gather_outputs, region_view, shard_inputs
from .sequential import run_sequential

__all__ = ["allocate", "shard_inputs", "gather_outputs", "region_view", "run_sequential"]
