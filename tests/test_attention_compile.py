"""The attention tile's fast path compiled ahead of time for an H200 (sm_90) on the CPU, no GPU.

The interpreter tests (test_triton_attention.py) check what the bodies compute; they cannot
see how they compile. On H200 the tile ran at 17-33 TF/s (benchmarks/results/v8) while a plain
Triton flash tile ran at 512: compiled for sm_90, its k/v loads were 16-bit scalar pointer loads
and a runtime bias branch on the scores made the compiler carry them in three register layouts
(255 registers, a 5.4 KB spill stack). This test compiles the fast path's own fold loop
(attention_tiles._fold: TMA descriptors over k and v, q in registers, the unmasked and the
causal chunk ranges, as attn_block_tile calls it) through Triton's NVIDIA backend down to the
cubin and checks the SASS: the dots are wgmma (HGMMA), k and v come by TMA (UTMALDG), no
16-bit scalar global loads, and the loop keeps its registers (no local-memory spill). The
whole chains kernel (with the pointer path for bias tiles, D > 128 and fp32) takes about a
minute to compile on two cores and is not compiled here.
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
def _fast_fold_kernel(q, k, v, acc_out, ml_out, n_k, D, q_stride, k_stride, qk_scale,
                      q_start, k_start, j_full, j_end, regions, bufaddr, bufcols,
                      DT: tl.constexpr, USE_TIMER: tl.constexpr):
    """attn_block_tile's fast branch for one 128-row sub-block: descriptors, q, the two folds."""
    om = tl.arange(0, at._QB)
    row_ok = om < at._QB
    qd = tl.make_tensor_descriptor(q, [at._QB, D], [q_stride, 1], [at._QB, at._DB])
    kd = tl.make_tensor_descriptor(k, [n_k, D], [k_stride, 1], [at._KB, at._DB])
    vd = tl.make_tensor_descriptor(v, [n_k, D], [k_stride, 1], [at._KB, at._DB])
    qt = at._operand(qd.load([0, 0]), USE_TIMER)
    acc = tl.zeros((at._QB, at._DB), dtype=tl.float32)
    m_i = tl.full((at._QB,), float("-inf"), tl.float32)
    l_i = tl.zeros((at._QB,), dtype=tl.float32)
    acc, m_i, l_i = at._fold(acc, m_i, l_i, qt, kd, vd, 0, j_full, om, row_ok, n_k, k_start,
                             q_start, qk_scale, regions, bufaddr, bufcols, 0, 0, False, DT,
                             USE_TIMER)
    acc, m_i, l_i = at._fold(acc, m_i, l_i, qt, kd, vd, j_full, j_end, om, row_ok, n_k, k_start,
                             q_start, qk_scale, regions, bufaddr, bufcols, 0, 0, True, DT,
                             USE_TIMER)
    od = tl.arange(0, at._DB)
    tl.store(acc_out + om[:, None] * at._DB + od[None, :], acc)
    tl.store(ml_out + om * 2, m_i)
    tl.store(ml_out + om * 2 + 1, l_i)


SIGNATURE = {
    "q": "*bf16", "k": "*bf16", "v": "*bf16", "acc_out": "*fp32", "ml_out": "*fp32",
    "n_k": "i32", "D": "i32", "q_stride": "i32", "k_stride": "i32", "qk_scale": "fp32",
    "q_start": "i32", "k_start": "i32", "j_full": "i32", "j_end": "i32", "regions": "*i32",
    "bufaddr": "*i64", "bufcols": "*i32", "DT": "constexpr", "USE_TIMER": "constexpr",
}


def test_fast_path_compiles_to_wgmma_and_tma_without_spills(tmp_path):
    start = time.perf_counter()
    compiled = triton.compile(
        ASTSource(_fast_fold_kernel, SIGNATURE, {"DT": tl.bfloat16, "USE_TIMER": True}),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 8, "num_stages": 3},  # run_chains' and the bench's defaults
    )
    seconds = time.perf_counter() - start
    cubin = tmp_path / "fold.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True,
                          text=True, check=True).stdout
    usage = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", str(cubin)],
                           capture_output=True, text=True, check=True).stdout

    def count(op: str) -> int:
        return len(re.findall(rf"\b{re.escape(op)}\b", sass))

    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    summary = (f"{seconds:.1f} s, {regs} regs, stack {stack} B, HGMMA {count('HGMMA')}, "
               f"UTMALDG {count('UTMALDG')}, LDG.E.U16 {count('LDG.E.U16')}, "
               f"LDL {count('LDL')}, STL {count('STL')}, shared {compiled.metadata.shared} B")
    print(summary)
    assert "wgmma.mma_async" in compiled.asm["ptx"], summary
    assert count("HGMMA") > 0 and count("HMMA") == 0, summary  # tensor cores, Hopper's
    assert count("UTMALDG") > 0, summary  # k and v by TMA
    assert count("LDG.E.U16") == 0, summary  # no element-wise bf16 loads
    assert stack == 0 and count("LDL") == 0 and count("STL") == 0, summary
    assert compiled.metadata.shared <= 232448, summary  # an H200 block's shared memory
