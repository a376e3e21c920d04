"""The fused ops. ``mg.ops.<op>(..., topology=, dtype=)`` builds the op's TaskGraph.

One op, one file; adding an op adds its file and one import line below.
"""

from __future__ import annotations

from . import tiles  # noqa: F401  (generic kinds: gemm, reduce, copy)
from .allgather_gemm import allgather_gemm
from .attention import attention
from .concat import concat
from .elementwise import elementwise
from .gemm import gemm
from .gemm_allreduce import gemm_allreduce
from .gemm_reduce_scatter import gemm_reduce_scatter
from .layer_norm import layer_norm
from .matmul import matmul
from .matmul_glu import matmul_glu
from .moe_dispatch_combine import moe_dispatch_combine
from .registry import OPS, OpDef, get_op, op_names
from .relayout import relayout
from .ring_attention import ring_attention
from .rms_norm import rms_norm
from .row_reduce import row_reduce
from .softmax import softmax

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
    "attention",
    "concat",
    "elementwise",
    "layer_norm",
    "matmul",
    "matmul_glu",
    "relayout",
    "rms_norm",
    "row_reduce",
    "softmax",
]
