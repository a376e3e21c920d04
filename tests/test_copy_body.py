"""The copy and reduce kinds' bodies (tiles.copy_tile: every NVLink copy of the lowerings runs
it; tiles.reduce_tile: the all-reduces' sums).

- Under TRITON_INTERPRET=1 (tests/copy_body_interp.py, a subprocess): copies that take the
  16-byte path, the element-by-element one, and both within one task, bit-exact; sums of three
  regions on either path, within the dtype's rounding of the reference's.
- Ahead of time for an H200 (sm_90) on the CPU: the fast loop moves 16 bytes per load and store
  (LDG.E.128 / STG.E.128), 8 of each a thread per 64 x 256 block, and nothing spills. Before,
  every copy ran the element-by-element loop (2-byte loads and stores through int64 pointers):
  calibrate.py measured 6.7-8.5 GB/s per NVLink worker on 2 H200. The reduce body's fast loop
  likewise (its sources' loads, its destinations' stores).
"""

from __future__ import annotations

import pytest

from helpers import interpreter_rows

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from test_memory_bodies import sass_stats  # noqa: E402

from mgraph.ops.tiles import copy_tile, reduce_tile  # noqa: E402


def test_copy_fast_and_general_paths_are_exact():
    rows = interpreter_rows("copy_body_interp.py")
    assert sorted(rows) == ["copy-bfloat16", "copy-float32", "reduce-bfloat16",
                            "reduce-float32"], rows
    for case in ("reduce-bfloat16", "reduce-float32"):  # 1 of 3 sums on 16-byte rows
        r = rows.pop(case)
        assert r["pairs"] == 3 and r["fast"] == 1, r
        assert r["error"] < {"reduce-bfloat16": 1e-2, "reduce-float32": 2e-6}[case], r
    for r in rows.values():
        # 9 (task, destination) pairs; the gate admits the 3 on 16-byte rows (2 destinations of
        # copy 0, out4 of copy 3), in both dtypes
        assert r["pairs"] == 8 + 1 and r["fast"] == 3, r
        assert r["exact"] and r["error"] == 0.0, r


@triton.jit
def _copy_kernel(tp, params, regions, bufaddr, bufrows, bufcols, DT: tl.constexpr,
                 RB_M: tl.constexpr, RB_N: tl.constexpr):
    copy_tile(tp, regions, bufaddr, bufcols, bufrows, DT, RB_M, RB_N)


def test_copy_fast_loop_moves_16_byte_vectors(tmp_path):
    stats = sass_stats(_copy_kernel, tmp_path)
    print(stats)
    assert stats["spills"] == 0, stats
    # one fast loop per dtype branch (bf16 and the float32 slots'): 8 vector loads and stores
    # a thread per 64 x 256 block (16 KiB of bf16)
    fast = [lp for lp in stats["loops"] if lp.get("STG.E.128")]
    assert len(fast) == 2, stats
    for lp in fast:
        assert lp["LDG.E.128"] == lp["STG.E.128"] and lp["LDG.E.128"] >= 8, stats
        assert "LDG.E.U16" not in lp and lp["n"] < 400, stats


@triton.jit
def _reduce_kernel(tp, params, regions, bufaddr, bufrows, bufcols, DT: tl.constexpr,
                   RB_M: tl.constexpr, RB_N: tl.constexpr):
    reduce_tile(tp, regions, bufaddr, bufcols, DT, RB_M, RB_N)


def test_reduce_fast_loop_moves_16_byte_vectors(tmp_path):
    stats = sass_stats(_reduce_kernel, tmp_path)
    print(stats)
    # (one register spilled and reloaded outside every loop: none inside one)
    assert not any(op.startswith(("STL", "LDL")) for lp in stats["loops"] for op in lp), stats
    # the fast path's source loop (8 vector loads a thread per block), its store of the sum
    # (8 vectors; in the loop around the source loop, so not innermost), and the copy of the
    # sum into the other writes (8 and 8)
    assert stats["all"].get("STG.E.128") == 16 and stats["all"].get("LDG.E.128") == 16, stats
    fast = [lp for lp in stats["loops"] if lp.get("LDG.E.128") or lp.get("STG.E.128")]
    assert sorted((lp.get("LDG.E.128", 0), lp.get("STG.E.128", 0)) for lp in fast) == [
        (8, 0), (8, 8)], stats
    assert not any("U16" in op for lp in fast for op in lp), stats
