"""The attention tile's fast path compiled ahead of time for an H200 (sm_90) on the CPU, no GPU.

The interpreter tests (test_triton_attention.py) check what the bodies compute; they cannot
see how they compile. On H200 the tile ran at 17-33 TF/s (benchmarks/results/v8, the pointer
path of then) while a plain Triton flash tile ran at 512. Two tests here:

- the fast path's own sub-block body (attention_tiles._fast_rows: TMA descriptors over q, k and
  v, q and acc in registers, the plain and the masked key ranges, as attn_block_tile calls it)
  for both head-size widths, with a mask tile and without, compiled alone: the dots are wgmma
  (HGMMA), q/k/v come by TMA (UTMALDG), the mask tile by 16-byte cp.async, no 16-bit scalar
  global loads, and no local-memory spill inside a loop;
- the whole chains kernel (attention_tiles.chains_kernel: what benchmarks/bench_attention.py
  tile launches, every path of attn_block and attn_finalize in one function, as in the
  megakernel): the fast loops hold (almost) no spill there either. Before this test's change
  they reloaded 19-71 spilled registers per iteration (255 registers, a 2.6 KB stack): the
  loop-invariant index tensors of the masks, 64-bit strides and 128 x 128 pointer tensors of
  the pointer path and attn_finalize kept the function past 255 registers.

ptxas still reports (C7515, ptxas 13.4 here) that it serialises the kernel's wgmma (each waits
for the previous one), in the chains kernel as in the kernel with only the 128-column loops;
the fast body compiled alone is not serialised. Not asserted: it is ptxas's heuristic, and the
GPU's ptxas (Triton 3.6) may decide otherwise; bench_attention.py records its verdict there.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
nvidia = pytest.importorskip("triton.backends.nvidia")

import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mgraph.ops import attention_tiles as at  # noqa: E402

BIN = Path(nvidia.__file__).parent / "bin"


@triton.jit
def _fast_rows_kernel(qp, q_stride, nq, kp, k_stride, vp, v_stride, nk, D, ap, a_stride, sap,
                      sa_stride, mp, smp, first, q_start, k_start, causal, qk_scale, bp,
                      b_stride, HAS_BIAS: tl.constexpr, DT: tl.constexpr,
                      USE_TIMER: tl.constexpr):
    """attn_block_tile's fast branch for one 128-row sub-block (_fast_rows: descriptors, q and
    acc in registers, the plain and the masked key ranges, the state read and written), with a
    mask tile or without (HAS_BIAS, a constant here so that each binary holds one of the two
    pairs of loops)."""
    at._fast_rows(qp, q_stride, nq, kp, k_stride, vp, v_stride, nk, D, ap, a_stride, sap,
                  sa_stride, mp, 2, smp, 2, first, 0, q_start, k_start, causal, qk_scale,
                  HAS_BIAS, bp, b_stride, False, DT, USE_TIMER)


SIGNATURE = {
    "qp": "*bf16", "q_stride": "i32", "nq": "i32", "kp": "*bf16", "k_stride": "i32",
    "vp": "*bf16", "v_stride": "i32", "nk": "i32", "D": "i32", "ap": "*fp32", "a_stride": "i32",
    "sap": "*fp32", "sa_stride": "i32", "mp": "*fp32", "smp": "*fp32", "first": "i32",
    "q_start": "i32", "k_start": "i32", "causal": "i32", "qk_scale": "fp32", "bp": "*bf16",
    "b_stride": "i32", "HAS_BIAS": "constexpr", "DT": "constexpr", "USE_TIMER": "constexpr",
}


def loop_spans(sass: str) -> tuple[list[tuple[int, str]], list[tuple[int, int]]]:
    """The SASS instructions (address, text) and the address spans of its loops: from the
    target of each conditional backward branch to the branch. (A wait's spin branches to
    itself; the unconditional jump back from an out-of-line wait is no loop.)"""
    ins = [(int(m.group(1), 16), m.group(2))
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", sass)]
    loops = []
    for addr, text in ins:
        back = re.match(r"@!?U?P\w+\s+BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if back and addr - int(back.group(1), 16) > 0x20:
            loops.append((int(back.group(1), 16), addr))
    return ins, loops


def compile_sm90(fn, signature: dict, constants: dict, tmp_path: Path,
                 per_loop: bool = False) -> tuple[object, dict]:
    """``fn`` compiled for sm_90 (8 warps, 3 stages: run_chains' and the megakernel's), and its
    cubin's resource usage and SASS instruction counts, in all and inside loops."""
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(fn, signature, constants),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 8, "num_stages": 3})
    seconds = time.perf_counter() - start
    cubin = tmp_path / "fold.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True,
                          text=True, check=True).stdout
    usage = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", str(cubin)],
                           capture_output=True, text=True, check=True).stdout
    ins, loops = loop_spans(sass)
    in_loop = [text for addr, text in ins if any(lo <= addr <= hi for lo, hi in loops)]

    def count(op: str, texts: list[str]) -> int:  # an opcode and any suffix: LDG.E.U16 is LDG
        return sum(bool(re.search(rf"(^|\s){re.escape(op)}(\.|\s|$)", t)) for t in texts)

    texts = [text for _addr, text in ins]
    stats = dict(seconds=round(seconds, 1), loops=len(loops),
                 regs=int(re.search(r"REG:(\d+)", usage).group(1)),
                 stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
                 shared=compiled.metadata.shared,
                 ptx_wgmma="wgmma.mma_async" in compiled.asm["ptx"])
    for op in ("HGMMA", "HMMA", "UTMALDG", "LDG.E.U16", "LDL", "STL"):
        stats[op] = count(op, texts)
    for op in ("LDG", "LDGSTS.E.BYPASS.128", "LDL", "STL"):
        stats[f"loop {op}"] = count(op, in_loop)
    if per_loop:  # each innermost loop: its size and what one iteration issues
        stats["per_loop"] = []
        for lo, hi in loops:
            if any(o != (lo, hi) and lo <= o[0] and o[1] <= hi for o in loops):
                continue
            body = [text for addr, text in ins if lo <= addr <= hi]
            stats["per_loop"].append(dict(
                n=len(body), **{op: count(op, body)
                                for op in ("HGMMA", "UTMALDG", "LDGSTS", "LDL", "STL")},
                DEPBAR=sum("WARPGROUP.DEPBAR" in text for text in body)))
    return compiled, stats


def pipelined(loop: dict) -> bool:
    """Whether a loop's wgmma run asynchronously: serialised, ptxas puts a wait (WARPGROUP.DEPBAR)
    after every HGMMA, 16 or more an iteration; pipelined, one or two (the probe's loop: 1)."""
    return loop["HGMMA"] > 0 and loop["DEPBAR"] <= 2


@pytest.mark.parametrize("bias", [False, True], ids=["unmasked", "masked"])
def test_fast_path_compiles_to_wgmma_and_tma_without_spills(bias, tmp_path):
    """The fast path's two pairs of loops (plain and masked; with a mask tile or without),
    compiled alone: wgmma, pipelined, q/k/v by TMA, no 16-bit scalar loads, no spill in a loop,
    inside an H200 block's shared memory (the loop without a mask sets the megakernel's
    attention share: 230,400 B). With a mask tile, its loads are 16-byte cp.async copies
    (LDGSTS.128) read from shared memory in the scores' register layout: the scores are reduced
    twice per loop (max and sum), never in a second layout."""
    compiled, stats = compile_sm90(
        _fast_rows_kernel, SIGNATURE, {"HAS_BIAS": int(bias), "DT": tl.bfloat16, "USE_TIMER": True},
        tmp_path, per_loop=True)
    summary = str(stats)
    print(summary)
    assert stats["loops"] == 2, summary  # the plain and the masked key range
    assert stats["ptx_wgmma"] and stats["HGMMA"] > 0 and stats["HMMA"] == 0, summary  # Hopper's
    assert all(pipelined(r) for r in stats["per_loop"]), summary
    assert stats["UTMALDG"] > 0, summary  # q, k and v by TMA
    assert stats["LDG.E.U16"] == 0, summary  # no element-wise bf16 loads anywhere
    assert stats["loop LDL"] == 0 and stats["loop STL"] == 0, summary
    assert compiled.asm["ttgir"].count('"tt.reduce"') == 4, summary
    assert stats["shared"] <= 232448, summary
    if bias:
        assert stats["loop LDG"] == 0 and stats["loop LDGSTS.E.BYPASS.128"] > 0, summary
    else:
        assert stats["loop LDG"] == 0 and stats["loop LDGSTS.E.BYPASS.128"] == 0, summary


CHAINS_SIGNATURE = {
    "tasks": "*i32", "order": "*i32", "starts": "*i32", "param_table": "*i32", "regions": "*i32",
    "bufaddr": "*i64", "bufcols": "*i32", "BLOCK_ID": "constexpr", "DT": "constexpr",
    "USE_TIMER": "constexpr",
}


def test_chains_kernel_fast_loops_pipelined_without_spills(tmp_path):
    """The kernel the tile benchmark launches, attn_block's every path and attn_finalize in one
    function, as in the megakernel: the fast loops keep their wgmma pipelined and spill
    nothing. Before: 255 registers, a 2.6 KB stack, 19-71 LDL an iteration in the fast loops,
    and ptxas serialised every wgmma of the kernel (C7512: not enough registers), whatever
    each loop needed alone."""
    from mgraph.runtime.megakernel.encode import kind_id

    _compiled, stats = compile_sm90(
        at.chains_kernel, CHAINS_SIGNATURE,
        {"BLOCK_ID": kind_id("attn_block"), "DT": tl.bfloat16, "USE_TIMER": True}, tmp_path,
        per_loop=True)
    summary = str({k: v for k, v in stats.items() if k != "per_loop"})
    fast = [r for r in stats["per_loop"] if r["UTMALDG"] > 0 and r["HGMMA"] > 0]
    print(summary, fast)
    assert len(fast) == 4, fast  # (plain, masked) x (mask tile or not)
    assert all(pipelined(r) for r in fast), fast
    # the plain loop of a task without a mask tile (most of the work: the smallest loop)
    plain = min((r for r in fast if r["LDGSTS"] == 0), key=lambda r: r["n"])
    assert plain["LDL"] == 0 and plain["STL"] == 0, fast
    # the masked loops may reload a few registers (ptxas 13.4 here: 1-4; 12.9: none)
    assert all(r["LDL"] <= 4 and r["STL"] == 0 for r in fast), fast
    # the pointer path is a call to a function of its own, on mma.sync (HMMA)
    assert stats["HMMA"] > 0 and ".func" in _compiled.asm["ptx"], summary
    assert stats["shared"] <= 232448, summary
