"""The fused ops. ``mg.ops.<op>(..., topology=, dtype=)`` builds the op's TaskGraph.

One op, one file; adding an op adds its file and one import line below.
"""

from __future__ import annotations

from . import tiles  # noqa: F401  (generic kinds: gemm, reduce, copy)
from .allgather_gemm import allgather_gemm
from .gemm import gemm
from .gemm_allreduce import gemm_allreduce
from .gemm_reduce_scatter import gemm_reduce_scatter
from .moe_dispatch_combine import moe_dispatch_combine
from .registry import OPS, OpDef, get_op, op_names
from .ring_attention import ring_attention

__all__ = [
    "OPS",
    "OpDef",
    "get_op",
    "op_names",
    "gemm_allreduce",
    "gemm_reduce_scatter",
    "allgather_gemm",
    "gemm",
    "ring_attention",
    "moe_dispatch_combine",
]
