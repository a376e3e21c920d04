"""The memory-bound tile bodies (relayout, rms_norm, ewise): both paths of each, and how the
fast ones compile.

- Under TRITON_INTERPRET=1 (tests/memory_bodies_interp.py, a subprocess): graphs chosen so that
  the vectorised fast path and the general path each run, compared with the reference runtime.
- Ahead of time for an H200 (sm_90) on the CPU: each body alone in a small kernel (8 warps, as in
  the megakernel, RB_M=64, RB_N=256), its SASS read with cuobjdump: the fast loops move 16 bytes
  per load and store (LDG.E.128 / STG.E.128) and spill nothing. Before this change the relayout
  body's one loop was 10,666 instructions with 64 two-byte loads and 1,400 spill stores.
"""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

from helpers import interpreter_rows

triton = pytest.importorskip("triton")

TOL = {"float32": 2e-6, "bfloat16": 1e-2}  # as test_triton_bodies.py: one bf16 ulp of rounding


@cache
def rows() -> dict[str, dict]:
    return interpreter_rows("memory_bodies_interp.py")


def _check(prefix: str, expect: int) -> list[dict]:
    got = [r for k, r in rows().items() if k.startswith(prefix)]
    assert len(got) == expect, sorted(rows())
    for r in got:
        assert r["error"] < TOL[r["dtype"]], r
    return got


def test_relayout_fast_and_general_paths():
    got = {r["case"]: r for r in _check("relayout-", 12)}
    for case, r in got.items():  # the gate admits every task of a case, or none
        fast = any(k in case for k in ("d16", "d40"))
        assert r["fast"] == (r["tasks"] if fast else 0), r


def test_rms_norm_fast_and_general_paths():
    for r in _check("rms_norm-", 16):  # 16-byte rows take the fast paths, 102 columns do not
        assert r["fast"] == (r["tasks"] if "-vec" in r["case"] else 0), r


def test_layer_norm_softmax_row_reduce_general_paths():
    """Odd widths (their fast paths: test_triton_bodies.py's row cases, 16-byte rows)."""
    got = [r for prefix in ("layer_norm-", "softmax-", "row_reduce-")
           for r in _check(prefix, {"layer_norm-": 4, "softmax-": 2, "row_reduce-": 4}[prefix])]
    assert all(r["fast"] == 0 for r in got), got


def test_ewise_fast_and_general_paths():
    for r in _check("ewise-", 12):  # chains of 2-6 inputs; 78 columns and a column operand not
        assert r["fast"] == (r["tasks"] if "-vec-" in r["case"] else 0), r


def test_concat_fast_and_general_paths():
    for r in _check("concat-", 6):  # an x of odd width puts y off a 16-byte boundary
        assert r["fast"] == (r["tasks"] if "-vec-" in r["case"] else 0), r


# -- ahead of time, sm_90 ------------------------------------------------------------------------
import triton.language as tl  # noqa: E402

from mgraph.ops.concat import concat_tile  # noqa: E402
from mgraph.ops.elementwise import ewise_tile  # noqa: E402
from mgraph.ops.layer_norm import layer_norm_tile  # noqa: E402
from mgraph.ops.relayout import relayout_tile  # noqa: E402
from mgraph.ops.rms_norm import rms_norm_tile  # noqa: E402
from mgraph.ops.row_reduce import row_reduce_tile  # noqa: E402
from mgraph.ops.softmax import softmax_tile  # noqa: E402


@triton.jit
def _relayout_kernel(tp, params, regions, bufaddr, bufrows, bufcols, DT: tl.constexpr,
                     RB_M: tl.constexpr, RB_N: tl.constexpr):
    relayout_tile(tp, params, regions, bufaddr, bufrows, bufcols, DT, RB_M, RB_N)


@triton.jit
def _rms_norm_kernel(tp, params, regions, bufaddr, bufrows, bufcols, DT: tl.constexpr,
                     RB_M: tl.constexpr, RB_N: tl.constexpr):
    rms_norm_tile(tp, params, regions, bufaddr, bufcols, DT, RB_M, RB_N)


@triton.jit
def _ewise_kernel(tp, params, regions, bufaddr, bufrows, bufcols, DT: tl.constexpr,
                  RB_M: tl.constexpr, RB_N: tl.constexpr):
    ewise_tile(tp, params, regions, bufaddr, bufcols, DT)


@triton.jit
def _concat_kernel(tp, params, regions, bufaddr, bufrows, bufcols, DT: tl.constexpr,
                   RB_M: tl.constexpr, RB_N: tl.constexpr):
    concat_tile(tp, regions, bufaddr, bufcols, DT, RB_M, RB_N)


@triton.jit
def _layer_norm_kernel(tp, params, regions, bufaddr, bufrows, bufcols, DT: tl.constexpr,
                       RB_M: tl.constexpr, RB_N: tl.constexpr):
    layer_norm_tile(tp, params, regions, bufaddr, bufcols, DT, RB_M, RB_N)


@triton.jit
def _softmax_kernel(tp, params, regions, bufaddr, bufrows, bufcols, DT: tl.constexpr,
                    RB_M: tl.constexpr, RB_N: tl.constexpr):
    softmax_tile(tp, regions, bufaddr, bufcols, DT, RB_M, RB_N)


@triton.jit
def _row_reduce_kernel(tp, params, regions, bufaddr, bufrows, bufcols, DT: tl.constexpr,
                       RB_M: tl.constexpr, RB_N: tl.constexpr):
    row_reduce_tile(tp, params, regions, bufaddr, bufcols, DT, RB_M, RB_N)


SIGNATURE = {"tp": "*i32", "params": "*i32", "regions": "*i32", "bufaddr": "*i64",
             "bufrows": "*i32", "bufcols": "*i32", "DT": "constexpr", "RB_M": "constexpr",
             "RB_N": "constexpr"}


def sass_stats(kernel, tmp_path: Path) -> dict:
    """``kernel`` compiled for sm_90 at bf16 (8 warps, RB_M=64, RB_N=256): its spills and, per
    innermost loop, its size and its loads and stores by width."""
    nvidia = pytest.importorskip("triton.backends.nvidia")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    binary = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    compiled = triton.compile(
        ASTSource(kernel, SIGNATURE, {"DT": tl.bfloat16, "RB_M": 64, "RB_N": 256}),
        target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    cubin = tmp_path / "body.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(binary), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    ins = [(int(m.group(1), 16), m.group(2))
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", sass)]
    loops = []  # from the target of each backward branch to the branch (a loop whose trip
    for addr, text in ins:  # test the compiler rotated ends in an unconditional one)
        back = re.match(r"(?:@!?U?P\w+\s+)?BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if back and addr - int(back.group(1), 16) > 0x20:
            loops.append((int(back.group(1), 16), addr))
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1]
                                           for o in loops)]

    def ops(texts: list[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for text in texts:
            op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
            if op.startswith(("LDG", "STG", "LDL", "STL")):
                out[op] = out.get(op, 0) + 1
        return out

    every = ops([t for _a, t in ins])
    # local memory: LDL / STL with or without a width or cache suffix (LDL.LU, STL.64, ...)
    local = ("LDL", "STL")
    return {"all": every, "spills": sum(n for op, n in every.items() if op.split(".")[0] in local),
            "loops": [dict(n=sum(lo <= a <= hi for a, _t in ins),
                           **ops([t for a, t in ins if lo <= a <= hi])) for lo, hi in inner]}


def test_relayout_fast_loop_moves_16_byte_vectors(tmp_path):
    stats = sass_stats(_relayout_kernel, tmp_path)
    print(stats)
    assert stats["spills"] == 0, stats
    # the two block shapes' loops (a head's: one column block, so its row loop is innermost):
    # 16-byte loads and stores only, 8 of each per thread (32 KiB per iteration)
    fast = [lp for lp in stats["loops"] if lp.get("STG.E.128")]
    assert len(fast) == 2, stats
    for lp in fast:
        assert lp["LDG.E.128"] == lp["STG.E.128"] == 8 and "LDG.E.U16" not in lp, stats
        assert lp["n"] < 1000, stats  # was 10,666 (one loop, int64 digits, spills)


def test_rms_norm_fast_loops_move_16_byte_vectors(tmp_path):
    from mgraph.ops.rms_norm import _RS

    stats = sass_stats(_rms_norm_kernel, tmp_path)
    print(stats)
    assert stats["spills"] == 0, stats
    # _rms_rows (rows up to 4096 bf16 columns: the layer's): one loop over 4-row blocks whose
    # loads Triton's pipeliner made asynchronous copies to shared memory (8 16-byte ones a
    # thread a block, issued _RS - 1 blocks ahead), 8 vector stores. _rms_vec (wider rows):
    # the sum of squares (8 vector loads a thread: the NEXT 16 x 1024 block's) and the scaled
    # store (8 vector loads and stores, and the weight: one 8-byte load). Before v12: 64
    # two-byte loads per loop, 255 registers and spills
    fast = [lp for lp in stats["loops"] if lp.get("LDG.E.128") or lp.get("LDGSTS.E.BYPASS.128")]
    assert sorted((lp.get("LDGSTS.E.BYPASS.128", 0), lp.get("LDG.E.128", 0),
                   lp.get("STG.E.128", 0)) for lp in fast) == [(0, 8, 0), (0, 8, 8), (8, 0, 8)], stats
    assert [lp.get("LDG.E.U16", 0) for lp in fast] == [0, 0, 0], stats
    assert stats["all"]["LDG.E.128"] >= 16 + 8, stats  # _rms_vec's 16, and loads ahead
    assert stats["all"]["LDGSTS.E.BYPASS.128"] >= 8 * _RS.value, stats  # the loop's, and ahead
    assert all(lp["n"] < 700 for lp in fast), stats


def test_ewise_fast_path_loads_16_byte_vectors(tmp_path):
    """The fast path's loads: a batch's 16 slots (operands 0 and 1 of 8 blocks,
    elementwise_bodies._ewise_vec), one at a LOAD of a later operand, one at a ROT
    (rotate_half: its columns move in whole vectors), and the result's store, each one 16-byte
    vector a thread per 16 x 128 block; each load site twice: through a row map, or through a
    relayout's gather map (a ``gather:`` operand). The general path keeps its 2-byte loads (8 a
    thread at each of its LOAD and ROT sites, one pointer for both maps)."""
    stats = sass_stats(_ewise_kernel, tmp_path)
    print(stats)
    assert stats["spills"] == 0, stats
    assert stats["all"].get("LDG.E.128") == 36 and stats["all"].get("STG.E.128") == 1, stats
    # and no 2-byte load but the general path's 8 (Triton 3.6 once left the gather loads
    # scalar: 10 vectors and 88 of these)
    assert stats["all"].get("LDG.E.U16") == 8, stats


def test_concat_fast_loops_move_16_byte_vectors(tmp_path):
    """x's and y's copies, in the tall blocks and the wide ones: 8 vector loads and stores a
    thread per iteration; the general path's smaller blocks no longer spill."""
    stats = sass_stats(_concat_kernel, tmp_path)
    print(stats)
    assert stats["spills"] == 0, stats
    fast = [lp for lp in stats["loops"] if lp.get("LDG.E.128")]
    assert len(fast) == 4, stats
    assert all(lp["LDG.E.128"] == lp["STG.E.128"] == 8 and lp["n"] < 200 for lp in fast), stats


@pytest.mark.parametrize("body", ["layer_norm", "softmax", "row_reduce"])
def test_row_op_fast_loops_load_16_byte_vectors(body, tmp_path):
    """Each pass over the row: 8 vector loads a thread per block (layer_norm's last pass adds
    the weight's and the bias's, one element a thread each); no spills (layer_norm's general
    path spilled under Triton 3.6 at full blocks, found when sass_stats began counting plain
    LDL/STL: it runs half-height blocks now)."""
    stats = sass_stats(KERNELS[body], tmp_path)
    print(stats)
    assert stats["spills"] == 0, stats
    fast = [lp for lp in stats["loops"] if lp.get("LDG.E.128")]
    assert not any(op.startswith(("LDL", "STL")) for lp in fast for op in lp), stats
    assert len(fast) == {"layer_norm": 3, "softmax": 2, "row_reduce": 1}[body], stats
    assert all(lp["LDG.E.128"] == 8 for lp in fast), stats


KERNELS = {"relayout": _relayout_kernel, "rms_norm": _rms_norm_kernel, "ewise": _ewise_kernel,
           "concat": _concat_kernel, "layer_norm": _layer_norm_kernel,
           "softmax": _softmax_kernel, "row_reduce": _row_reduce_kernel}

if __name__ == "__main__":  # by hand: each body's SASS numbers (benchmarks/NOTES.md quotes them)
    import tempfile

    for name, kernel in KERNELS.items():
        with tempfile.TemporaryDirectory() as tmp:
            print(name, sass_stats(kernel, Path(tmp)))
