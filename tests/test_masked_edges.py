"""Sizes that are not multiples of the tile: the last tile row and column are short (their
regions end at the true bounds) and every backend masks them, never pads and never rejects.

- every GEMM-based op on 2x2 (and the flat and one-node variants) on the reference backend,
  random inputs, against torch in float64;
- the Llama-8B dims that used to be refused at 2x8 (14336 / 16 = 896 columns per rank) lower;
- the megakernel's ``gemm`` tile body (mgraph/ops/tiles.py) on short regions, under
  TRITON_INTERPRET=1: this file re-runs itself in a subprocess (the flag must be set before
  triton is imported), calling the body from a small harness kernel.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import mgraph as mg
from helpers import rel_err, run_interpreted

# M=200, N=300, K=130 (132 where K is sharded over the 4 ranks): no dim is a multiple of a tile.
CASES = [
    ("gemm", dict(M=200, N=300, K=130, tile=[32, 128])),
    ("matmul", dict(M=200, N=300, K=130, tile=[128, 128])),
    ("matmul", dict(M=200, N=300, K=130, shard="cols", tile=[128, 32])),
    ("gemm_allreduce", dict(M=200, N=300, K=132, tile=[128, 128])),
    ("gemm_allreduce", dict(M=200, N=300, K=132, tile=[128, 128], algorithm="oneshot")),
    ("gemm_allreduce", dict(M=200, N=300, K=132, tile=[128, 128], hierarchical=False)),
    ("gemm_reduce_scatter", dict(M=200, N=300, K=132, tile=[32, 128])),
    ("gemm_reduce_scatter", dict(M=200, N=300, K=132, tile=[32, 128], hierarchical=False)),
    ("allgather_gemm", dict(M=200, N=300, K=130, tile=[32, 32])),
    ("allgather_gemm", dict(M=200, N=300, K=130, tile=[32, 32], hierarchical=False)),
    ("allgather_gemm", dict(M=200, N=300, K=130, tile=[32, 32], gather="peer", chunk_bytes=2000)),
]
ONE_NODE = [
    ("gemm_allreduce", dict(M=200, N=300, K=132, tile=[128, 128])),  # accumulate on 2 GPUs
    ("gemm_allreduce", dict(M=200, N=300, K=132, tile=[128, 128], algorithm="twoshot")),
    ("gemm_reduce_scatter", dict(M=200, N=300, K=132, tile=[32, 128])),  # accumulate
    ("gemm_reduce_scatter", dict(M=200, N=300, K=132, tile=[32, 128], algorithm="push")),
]


def _check(op_name: str, kw: dict, topology: str) -> None:
    op = mg.ops.get_op(op_name)
    graph = op(topology=topology, dtype=torch.float32, **kw)
    graph.validate()
    gemms = [t for t in graph.tasks if t.kind == "gemm"]
    bm, bn = kw["tile"]
    short = [t for t in gemms if t.writes[0].shape[0] < bm or t.writes[0].shape[1] < bn]
    assert short, "the case must have short edge tiles"
    assert all(t.writes[0].shape[0] <= bm and t.writes[0].shape[1] <= bn for t in gemms)
    inputs = op.random_inputs(graph, seed=3)
    for name, t in inputs.items():
        assert t.abs().sum() > 0, name
    got = mg.run(mg.schedule(graph), inputs, backend="reference").outputs["out"]
    want = inputs["a"].double() @ inputs["b"].double()
    assert rel_err(got, want) < 1e-5, (op_name, kw, topology, rel_err(got, want))


@pytest.mark.parametrize("op_name, kw", CASES, ids=lambda v: v if isinstance(v, str) else "")
def test_every_gemm_op_masks_edge_tiles_on_2x2(op_name, kw):
    _check(op_name, kw, "2x2")


@pytest.mark.parametrize("op_name, kw", ONE_NODE, ids=lambda v: v if isinstance(v, str) else "")
def test_one_node_algorithms_mask_edge_tiles(op_name, kw):
    _check(op_name, kw, "1x2")


def test_llama_8b_ffn_dims_lower_at_2x8():
    """14336 FFN columns over 16 ranks is 896 per rank: 3 tiles of 256 and one of 128."""
    up = mg.ops.allgather_gemm(M=4096, N=14336, K=4096, topology="2x8", dtype=torch.bfloat16)
    widths = {t.writes[0].shape[1] for t in up.tasks if t.kind == "gemm"}
    assert widths == {256, 128}, widths
    down = mg.ops.gemm_reduce_scatter(M=4096, N=4096, K=14336, topology="2x8",
                                      dtype=torch.bfloat16)
    assert {t.reads[0].shape[1] for t in down.tasks if t.kind == "gemm"} == {896}


def test_world_size_divisibility_stays_an_error():
    """A dim sharded over the ranks must split evenly: that is sharding, not tiling."""
    with pytest.raises(mg.ShapeError, match="world size 4"):
        mg.ops.gemm_allreduce(M=200, N=300, K=130, topology="2x2")
    with pytest.raises(mg.ShapeError, match="world size 4"):
        mg.ops.allgather_gemm(M=202, N=300, K=130, topology="2x2")


def test_gemm_tile_body_masks_short_regions_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = run_interpreted([__file__], env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {r["case"] for r in rows} == {"edge-tiles", "k-inside-buffer", "own-descriptors",
                                         "multi-block", "multi-block-k-inside"}
    for r in rows:
        assert r["error"] < 1e-5 and r["outside_untouched"], r


# -- the interpreter harness (run as a script, TRITON_INTERPRET=1) ------------------------------
if __name__ == "__main__":
    # Module level on purpose: a jit function resolves the names it calls in its module globals.
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    import triton
    import triton.language as tl

    from mgraph.ops.abi import (
        F_NPARAM,
        F_NREAD,
        F_NWRITE,
        F_PARAM0,
        F_READ0,
        F_WRITE0,
        TASK_FIELDS,
        buffer_base,
    )
    from mgraph.ops.tiles import gemm_tile

    BM, BN, BK = 128, 128, 64

    @triton.jit
    def harness(tasks, params, regions, bufaddr, bufrows, bufcols, a0_slot, b0_slot,
                NF: tl.constexpr, DT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr):
        # as the kernel does: the rank's usual A and B descriptors built once (slots 0 and 1)
        a_cols = tl.load(bufcols)
        ad0 = tl.make_tensor_descriptor(buffer_base(bufaddr, 0, DT), [tl.load(bufrows), a_cols],
                                        [a_cols, 1], [BM, BK])
        b_cols = tl.load(bufcols + 1)
        bd0 = tl.make_tensor_descriptor(buffer_base(bufaddr, 1, DT),
                                        [tl.load(bufrows + 1), b_cols], [b_cols, 1], [BK, BN])
        tp = tasks + tl.program_id(0) * NF
        gemm_tile(tp, params, regions, bufaddr, bufrows, bufcols, ad0, bd0, a0_slot, b0_slot,
                  DT, BM, BN, BK, False, False)

    def run(case: str, a: torch.Tensor, b: torch.Tensor, ks: int, tiles, own: bool) -> None:
        """C[tile] = A[tile rows, :ks] @ B[:ks, tile cols] for each tile, also stored into a
        second (peer) buffer D; every element outside the tiles must keep its NaN."""
        M, N = a.shape[0], b.shape[1]
        c = torch.full((M, N), float("nan"))
        d = torch.full((M, N), float("nan"))
        bufs = [a, b, c, d]
        regions, tasks = [], []
        for r0, r1, c0, c1 in tiles:
            first = len(regions)
            regions += [(0, r0, r1, 0, ks), (1, 0, ks, c0, c1), (2, r0, r1, c0, c1),
                        (3, r0, r1, c0, c1)]
            row = [0] * TASK_FIELDS
            row[F_READ0], row[F_NREAD], row[F_WRITE0], row[F_NWRITE] = first, 2, first + 2, 2
            row[F_PARAM0], row[F_NPARAM] = 0, 1  # params[0]: accumulate = 0 (plain stores)
            tasks.append(row)
        harness[(len(tasks),)](
            torch.tensor(tasks, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
            torch.tensor(regions, dtype=torch.int32),
            torch.tensor([t.data_ptr() for t in bufs], dtype=torch.int64),
            torch.tensor([t.shape[0] for t in bufs], dtype=torch.int32),
            torch.tensor([t.shape[1] for t in bufs], dtype=torch.int32),
            -1 if own else 0, -1 if own else 1,
            NF=TASK_FIELDS, DT=tl.float32, BM=BM, BN=BN, BK=BK,
        )
        want = a[:, :ks].double() @ b[:ks].double()
        covered = torch.zeros(M, N, dtype=torch.bool)
        for r0, r1, c0, c1 in tiles:
            covered[r0:r1, c0:c1] = True
        err = max(rel_err(out[covered], want[covered]) for out in (c, d))
        untouched = bool(c[~covered].isnan().all() and d[~covered].isnan().all())
        print(json.dumps({"case": case, "error": err, "outside_untouched": untouched}),
              flush=True)

    gen = torch.Generator().manual_seed(0)
    # TMA needs 16-byte row strides (K=136, N=300 in fp32), not whole tiles
    a, b = torch.randn(200, 136, generator=gen), torch.randn(136, 300, generator=gen)
    # a 2x3 grid of 128x128 tiles over 200x300 with K=136 (2 whole K steps and a tail of 8)
    edge = [(r, min(r + BM, 200), c, min(c + BN, 300)) for r in (0, 128) for c in (0, 128, 256)]
    run("edge-tiles", a, b, 136, edge, own=False)
    # K ends inside the buffers (100 of 136), which hold NaN past it: the tail must be masked.
    # Tiles end inside the buffers too (rows 0:100, cols 0:96), so the stores must be masked.
    a_nan, b_nan = a.clone(), b.clone()
    a_nan[:, 100:] = float("nan")
    b_nan[100:] = float("nan")
    run("k-inside-buffer", a_nan, b_nan, 100, [(0, 100, 0, 96), (100, 200, 96, 220)], own=False)
    run("own-descriptors", a, b, 136, edge[:2], own=True)  # the body builds its descriptors
    # Tasks larger than the block run block by block: 2x2 blocks (the second block row short),
    # then 2x1 blocks of one short column block; with K ending inside the buffers too.
    run("multi-block", a, b, 136, [(0, 200, 0, 256), (0, 200, 256, 300)], own=False)
    run("multi-block-k-inside", a_nan, b_nan, 100, [(0, 200, 0, 220), (0, 72, 220, 300)],
        own=True)
