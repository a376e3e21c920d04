"""The persistent Triton megakernel (backend="triton"): encode, kernel, runtime."""

from __future__ import annotations

from .encode import Layout, RankTables, encode_rank, layout
from .runtime import TritonRuntime, assemble_local, local_shards, run_in_process, supported_kinds

__all__ = [
    "Layout",
    "RankTables",
    "encode_rank",
    "layout",
    "TritonRuntime",
    "supported_kinds",
    "local_shards",
    "assemble_local",
    "run_in_process",
]
