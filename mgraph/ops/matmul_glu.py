"""A gated linear unit in one GEMM op: ``out = silu(a @ gate) * (a @ up)``.

A Llama-style MLP computes ``act(gate_proj(x)) * up_proj(x)``: two GEMMs that each write an
``[M, F]`` activation, then a pointwise pass that reads both and writes a third. This op (the
tracer fuses the pattern into it with ``mg.compile(..., glu=True)``: mgraph/trace/glu.py)
computes both products of one output tile in one ``gemm_glu`` task and applies SiLU and the
product in the epilogue: the gate and up activations never reach memory, and the pointwise pass
is gone.

The weights come PACKED, ``w`` of shape ``[K, 2N]``: for each block of ``GLU_BLOCK`` (128)
output columns, that block of ``gate`` then the same block of ``up`` (``pack_glu``). A task's B
tile is then one contiguous ``[K, 2 x 128]`` region, so a ``gemm_glu`` block is exactly a gemm
block (ONE 128 x 256 dot a K step, gemm's pipelined loop, its descriptor reuse); the epilogue
splits the accumulator's two halves. N (each rank's N under ``shard="cols"``) must be a
multiple of 128. Layouts as ``matmul``'s (``shard="none"``: ``w`` replicated, ``a`` keeps whole
rows; ``shard="cols"``: ``w`` and ``out`` sharded along N, each rank's packed columns
contiguous).

Measured (benchmarks/NOTES.md v14-v15, one H200, the Llama layer): the first form of this op (two
weights, two 128 x 128 dots a K step) made the layer SLOWER, 4.20 against 3.51 ms: its K loop
waited for both products' MMAs to finish every step. This packed form too, 4.383 against 3.688
ms, and every other GEMM kind in its kernel ~25% slower: it had its own body, a second copy of
gemm's pipelined K loop inlined into the megakernel, for which ptxas (Triton 3.6) ran out of
registers and then serialised EVERY wgmma of the kernel (info C7512). So gemm's body runs
``gemm_glu`` tasks now (tiles.gemm_tile, the unit as its epilogue; both kinds one dispatch
branch): in the sm_90 code of the layer's kernel the K loop is there once, as pipelined as in
the kernel without this op (4 HGMMA a K step, one wait to depth 1), and a kernel without
``gemm_glu`` tasks compiles to the same code as before. Timed in this form (NOTES v15 call 5):
still slower, 3.788 against 3.537 ms; its tasks take 231 us against 190 for the unfused
gate/up tasks of the same flops, and the other GEMM kinds 4-8% longer in its kernel (the
epilogue on a 128 x 256 fp32 accumulator is the likely cost, not examined). So ``mg.compile``
fuses only with ``glu=True``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..builder import GraphBuilder, piece
from ..errors import ShapeError
from ..graph import Buffer, Task
from ..kinds import Role, define_kind
from ..topology import Topology
from .abi import HAVE_TRITON
from .collectives import grouped, tile_grid, tile_region
from .matmul import bind_linear, check_linear
from .registry import OpDef

__all__ = ["matmul_glu", "GEMM_GLU", "GLU_BLOCK", "pack_glu", "unpack_glu"]

OP = "matmul_glu"
matmul_glu = OpDef(OP, dims=("M", "N", "K"), inputs=("a", "w"), outputs=("out",))
GEMM_GLU = define_kind(
    "gemm_glu", [Role.COMPUTE],
    "out = silu(A @ gate) * (A @ up) from packed [gate | up] blocks of B, fp32-accumulated",
)
# Output columns per packed block: half the megakernel's GEMM block (encode.MAX_BLOCK[1] = 256),
# so one block of w is one gemm B tile. (Also the width the block's epilogue stores.)
GLU_BLOCK = 128


def pack_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``[K, 2N]``: per GLU_BLOCK output columns, that block of ``gate`` then of ``up`` (both
    ``[K, N]``, N a multiple of GLU_BLOCK)."""
    k, n = gate.shape
    nb = n // GLU_BLOCK
    return torch.stack([gate.reshape(k, nb, GLU_BLOCK), up.reshape(k, nb, GLU_BLOCK)],
                       dim=2).reshape(k, 2 * n)


def unpack_glu(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) of a packed ``[K, 2N]`` tensor (or a region of whole packed blocks)."""
    k, n2 = w.shape
    blocks = w.reshape(k, n2 // (2 * GLU_BLOCK), 2, GLU_BLOCK)
    return blocks[:, :, 0].reshape(k, n2 // 2), blocks[:, :, 1].reshape(k, n2 // 2)


@matmul_glu.shapes
def _shapes(
    topology: Topology,
    M: int,
    N: int,
    K: int,
    shard: str = "none",
    shape: Sequence[int] | None = None,
    layout: Sequence | None = None,
    tile: list[int] = (128, 128),
    **_: object,
) -> dict[str, tuple]:
    check_linear(OP, topology, M, N, K, shard, shape, layout, tile,
                 "a gated unit needs whole products before its SiLU: gather K first")
    world = topology.world_size
    local = N // world if shard == "cols" else N
    if local % GLU_BLOCK or tile[1] % GLU_BLOCK:
        raise ShapeError(
            f"{OP}: each rank's N ({local}) and the tile's columns ({tile[1]}) must be multiples "
            f"of {GLU_BLOCK} (the packed weight's block)",
            hint="use two linears and a pointwise product (mg.compile glu=False) for this size",
        )
    return {"a": (M, K), "w": (K, 2 * N), "out": (M, N)}


@matmul_glu.reference
def _reference(a: torch.Tensor, w: torch.Tensor, **_: object) -> dict:
    x = a.float()
    gate, up = unpack_glu(w.float())
    return {"out": (F.silu(x @ gate) * (x @ up)).to(a.dtype)}


@matmul_glu.lower
def _lower(
    b: GraphBuilder,
    M: int,
    N: int,
    K: int,
    shard: str = "none",
    shape: list[int] | None = None,
    layout: list | None = None,
    tile: list[int] = (128, 128),
) -> None:
    b.global_input("a", (M, K))
    b.global_input("w", (K, 2 * N))
    b.global_output("out", (M, N))

    def weight(r: int, cols: tuple[int, int] | None) -> Buffer:
        # the rank's packed columns: whole packed blocks, since N / world % GLU_BLOCK == 0
        packed = {"d1": (2 * cols[0], 2 * cols[1])} if cols else {}
        return b.bound_buffer("w", r, "w", [piece((K, 2 * N), **packed)])

    for r in b.topo.ranks:
        a, w, out = bind_linear(b, r, OP, M, N, K, shard, shape, layout, weight)
        bm, bn = min(tile[0], out.rows), min(tile[1], out.cols)
        # bands of tile rows, column by column (gemm's L2-friendly order)
        for t in grouped(tile_grid(out.rows, out.cols, bm, bn)):
            b.task(
                r,
                Role.COMPUTE,
                GEMM_GLU.name,
                [a.region((t[0], t[1]), (0, K)), w.region((0, K), (2 * t[2], 2 * t[3]))],
                [tile_region(out, t)],
                name=f"matmul_glu r{r} [{t[0]}:{t[1]},{t[2]}:{t[3]}]",
            )


@GEMM_GLU.cpu
def _glu_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    a = reads[0].float()
    gate, up = unpack_glu(reads[1].float())
    out = F.silu(a @ gate) * (a @ up)
    for w in writes:
        w.copy_(out)


@GEMM_GLU.flops
def _glu_flops(reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict):
    (m, k), (_, n2) = reads[0], reads[1]
    return 2.0 * m * n2 * k  # both products: n2 = 2 x the output columns


if HAVE_TRITON:
    from .tiles import gemm_tile

    # A gemm_glu block IS a gemm block (over the packed weight), so gemm's body runs these tasks
    # too, with the unit as its epilogue (tiles.glu_unit): the dispatch gives both kinds one
    # branch, so the kernel holds ONE copy of the pipelined K loop (the module docstring: why).
    GEMM_GLU.triton(gemm_tile)
