"""A gated linear unit in one GEMM op: ``out = silu(a @ b) * (a @ b2)``.

A Llama-style MLP computes ``act(gate_proj(x)) * up_proj(x)``: two GEMMs that each write an
``[M, F]`` activation, then a pointwise pass that reads both and writes a third. This op (the
tracer fuses the pattern into it: mgraph/trace/glu.py) computes both products of one output tile
in one ``gemm_glu`` task, from the same A tile, and applies SiLU and the product in the
epilogue: the gate and up activations never reach memory, and the pointwise pass is gone.

Layouts as ``matmul``'s (``shard="none"``: ``b``/``b2`` replicated, ``a`` keeps whole rows;
``shard="cols"``: ``b``, ``b2`` and ``out`` sharded along N). The megakernel's block is the GEMM
block (BM x BN); a ``gemm_glu`` block is BM x BN/2 output columns with one BM x BN/2
accumulator per product, so it holds as many registers and loads as many B bytes per K step as
a BM x BN ``gemm`` block, and writes half as many columns.

Measured (benchmarks/NOTES.md v14, one H200, the Llama layer): SLOWER than the two GEMMs and the
pointwise pass it replaces, 4.20 against 3.51 ms for the whole layer's megakernel. The sm_90
code of its K loop waits for both products' MMAs to finish every step (``wgmma.wait_group 0``),
where gemm's keeps one step in flight; so ``mg.compile`` fuses only with ``glu=True``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..builder import GraphBuilder, piece, shard_range
from ..errors import ShapeError
from ..graph import Task
from ..kinds import Role, define_kind
from ..layout import Layout, check_layout, layout_runs, runs_pieces
from ..topology import Topology
from .abi import F_NWRITE, F_READ0, F_WRITE0, HAVE_TRITON
from .collectives import check_options, grouped, tile_grid, tile_region
from .registry import OpDef
from .tilewise import parse_shape

__all__ = ["matmul_glu", "GEMM_GLU"]

OP = "matmul_glu"
matmul_glu = OpDef(OP, dims=("M", "N", "K"), inputs=("a", "b", "b2"), outputs=("out",))
GEMM_GLU = define_kind(
    "gemm_glu", [Role.COMPUTE], "out = silu(A @ B) * (A @ B2), both products fp32-accumulated"
)


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
    world = topology.world_size
    check_options(OP, tile, 1)
    nd = parse_shape(OP, M, K, shape)
    if shard == "cols":
        if N % world:
            raise ShapeError(
                f"{OP}: N={N} is not divisible by the world size {world}",
                hint=f"a column-parallel linear shards its output features: use a multiple of {world}",
            )
    elif shard == "none":
        lay = Layout.from_json(layout)
        check_layout(nd, lay, world, OP, "choose the token count as a multiple of the world size")
        if lay.kind == "shard" and lay.dim == len(nd) - 1:
            raise ShapeError(
                f"{OP}: a is sharded along K, so every rank would hold partial products",
                hint="a gated unit needs whole products before its SiLU: gather K first",
            )
    else:
        raise ShapeError(f"{OP}: shard={shard!r} must be 'none' or 'cols'")
    return {"a": (M, K), "b": (K, N), "b2": (K, N), "out": (M, N)}


@matmul_glu.reference
def _reference(a: torch.Tensor, b: torch.Tensor, b2: torch.Tensor, **_: object) -> dict:
    x = a.float()
    return {"out": (F.silu(x @ b.float()) * (x @ b2.float())).to(a.dtype)}


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
    world = b.world
    b.global_input("a", (M, K))
    b.global_input("b", (K, N))
    b.global_input("b2", (K, N))
    b.global_output("out", (M, N))
    nd = parse_shape(OP, M, K, shape)
    lay = Layout.from_json(layout)
    for r in b.topo.ranks:
        if shard == "cols":
            cols = shard_range(N, r, world)
            a = b.bound_buffer("a", r, "a", [piece((M, K))])
            gate = b.bound_buffer("b", r, "b", [piece((K, N), d1=cols)])
            up = b.bound_buffer("b2", r, "b2", [piece((K, N), d1=cols)])
            out = b.bound_buffer("out", r, "out", [piece((M, N), d1=cols)], role="output")
        else:
            runs = layout_runs(nd, lay, r, world)
            a = b.bound_buffer("a", r, "a", runs_pieces(runs))
            gate = b.bound_buffer("b", r, "b", [piece((K, N))])
            up = b.bound_buffer("b2", r, "b2", [piece((K, N))])
            out_pieces = tuple(((r0, r1), (0, N)) for r0, r1, _, _ in runs)
            out = b.bound_buffer("out", r, "out", out_pieces, role="output")
        bm, bn = min(tile[0], out.rows), min(tile[1], out.cols)
        # bands of tile rows, column by column (gemm's L2-friendly order)
        for t in grouped(tile_grid(out.rows, out.cols, bm, bn)):
            b.task(
                r,
                Role.COMPUTE,
                GEMM_GLU.name,
                [
                    a.region((t[0], t[1]), (0, K)),
                    gate.region((0, K), (t[2], t[3])),
                    up.region((0, K), (t[2], t[3])),
                ],
                [tile_region(out, t)],
                name=f"matmul_glu r{r} [{t[0]}:{t[1]},{t[2]}:{t[3]}]",
            )


@GEMM_GLU.cpu
def _glu_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    a, gate, up = (x.float() for x in reads)
    out = F.silu(a @ gate) * (a @ up)
    for w in writes:
        w.copy_(out)


@GEMM_GLU.flops
def _glu_flops(reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict):
    (m, k), (_, n) = reads[0], reads[1]
    return 4.0 * m * n * k


if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .abi import buffer_base, load_region
    from .tilewise import block_ptrs, row_operand, vec_width

    _READ0, _WRITE0, _NWRITE = tl.constexpr(F_READ0), tl.constexpr(F_WRITE0), tl.constexpr(F_NWRITE)

    @GEMM_GLU.triton
    @triton.jit
    def gemm_glu_tile(tp, regions, bufaddr, bufrows, bufcols, ad0, a0_slot, DT: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """silu(A @ B) * (A @ B2) over the task's region, block by block (BM x BN/2 output
        columns a block, one fp32 accumulator per product), K as gemm_tile reads it (a masked
        short last step). The products never leave registers: the epilogue applies SiLU and
        the product in fp32 and stores once, 16 bytes at a time where the region allows."""
        HB: tl.constexpr = BN // 2
        r0 = tl.load(tp + _READ0)
        a_slot, am0, am1, ak0, ak1 = load_region(regions, r0)
        g_slot, gk0, gk1, gn0, gn1 = load_region(regions, r0 + 1)
        u_slot, uk0, uk1, un0, un1 = load_region(regions, r0 + 2)
        if a_slot == a0_slot:
            ad = ad0
        else:
            a_cols = tl.load(bufcols + a_slot)
            ad = tl.make_tensor_descriptor(buffer_base(bufaddr, a_slot, DT),
                                           [tl.load(bufrows + a_slot), a_cols], [a_cols, 1],
                                           [BM, BK])
        g_cols = tl.load(bufcols + g_slot)
        gd = tl.make_tensor_descriptor(buffer_base(bufaddr, g_slot, DT),
                                       [tl.load(bufrows + g_slot), g_cols], [g_cols, 1], [BK, HB])
        u_cols = tl.load(bufcols + u_slot)
        ud = tl.make_tensor_descriptor(buffer_base(bufaddr, u_slot, DT),
                                       [tl.load(bufrows + u_slot), u_cols], [u_cols, 1], [BK, HB])
        ksize = ak1 - ak0
        kfull = ksize - ksize % BK
        w0 = tl.load(tp + _WRITE0)
        nwrite = tl.load(tp + _NWRITE)
        nbn = tl.cdiv(gn1 - gn0, HB)
        for blk in range(0, tl.cdiv(am1 - am0, BM) * nbn):
            sm = (blk // nbn) * BM
            sn = (blk % nbn) * HB
            accg = tl.zeros((BM, HB), dtype=tl.float32)
            accu = tl.zeros((BM, HB), dtype=tl.float32)
            for kk in range(0, kfull, BK):
                x = ad.load([am0 + sm, ak0 + kk])
                accg = tl.dot(x, gd.load([gk0 + kk, gn0 + sn]), accg)
                accu = tl.dot(x, ud.load([uk0 + kk, un0 + sn]), accu)
            if kfull < ksize:  # the short last K step, both operands masked to K
                kin = tl.arange(0, BK) < ksize - kfull
                x = tl.where(kin[None, :], ad.load([am0 + sm, ak0 + kfull]), 0.0).to(DT)
                y = tl.where(kin[:, None], gd.load([gk0 + kfull, gn0 + sn]), 0.0).to(DT)
                z = tl.where(kin[:, None], ud.load([uk0 + kfull, un0 + sn]), 0.0).to(DT)
                accg = tl.dot(x, y, accg)
                accu = tl.dot(x, z, accu)
            out = (accg * tl.sigmoid(accg) * accu).to(DT)
            for q in range(nwrite):
                ca, cpitch, cvec = row_operand(regions, bufaddr, bufcols, w0 + q, DT)
                _, cm0, cm1, cn0, cn1 = load_region(regions, w0 + q)
                ca = ca + (sm.to(tl.int64) * cpitch + sn) * (DT.primitive_bitwidth // 8)
                om = tl.arange(0, BM)
                on = tl.arange(0, HB)
                if cvec:
                    tl.store(block_ptrs(ca, cpitch, om, on, DT, True), out,
                             mask=(om < cm1 - cm0 - sm)[:, None]
                             & (on < vec_width(cn1 - cn0 - sn, DT, True))[None, :])
                else:
                    tl.store(block_ptrs(ca, cpitch, om, on, DT, False), out,
                             mask=(om < cm1 - cm0 - sm)[:, None] & (on < cn1 - cn0 - sn)[None, :])
