"""The fused ops. ``mg.ops.<op>(..., topology=, dtype=)`` builds the op's TaskGraph.

One op, one file; adding an op adds its file and one import line below.
"""

from __future__ import annotations

from . import tiles  # noqa: F401  (generic kinds: gemm, reduce, copy)
from .gemm_allreduce import gemm_allreduce
from .registry import OPS, OpDef, get_op, op_names

__all__ = ["OPS", "OpDef", "get_op", "op_names", "gemm_allreduce"]
