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
                      q_start, k_start, c_full, c_end, bp, b_stride, has_bias,
                      BIAS: tl.constexpr, STAGES: tl.constexpr, DT: tl.constexpr,
                      USE_TIMER: tl.constexpr):
    """attn_block_tile's fast branch for one 128-row sub-block: descriptors, q, the two folds;
    with BIAS, the branch for a mask tile (its pointer, row stride and key count made visibly
    16-byte aligned as attn_block_tile does after checking them)."""
    om = tl.arange(0, at._QB)
    row_ok = om < at._QB
    qd = tl.make_tensor_descriptor(q, [at._QB, D], [q_stride, 1], [at._QB, at._DB])
    kd = tl.make_tensor_descriptor(k, [n_k, D], [k_stride, 1], [at._KB, at._DB])
    vd = tl.make_tensor_descriptor(v, [n_k, D], [k_stride, 1], [at._KB, at._DB])
    qt = at._operand(qd.load([0, 0]), USE_TIMER)
    acc = tl.zeros((at._QB, at._DB), dtype=tl.float32)
    m_i = tl.full((at._QB,), float("-inf"), tl.float32)
    l_i = tl.zeros((at._QB,), dtype=tl.float32)
    b_bool = has_bias == at._BIAS_BOOL
    if BIAS:
        per16 = 128 // DT.primitive_bitwidth
        bp = at._aligned16(bp, DT)
        b_stride = b_stride // per16 * per16
        n_k = n_k // per16 * per16
    acc, m_i, l_i = at._fold(acc, m_i, l_i, qt, kd, vd, 0, c_full, om, row_ok, n_k, k_start,
                             q_start, qk_scale, bp, b_stride, b_bool, False, BIAS, STAGES, DT,
                             USE_TIMER)
    acc, m_i, l_i = at._fold(acc, m_i, l_i, qt, kd, vd, c_full, c_end, om, row_ok, n_k, k_start,
                             q_start, qk_scale, bp, b_stride, b_bool, True, BIAS, STAGES, DT,
                             USE_TIMER)
    od = tl.arange(0, at._DB)
    tl.store(acc_out + om[:, None] * at._DB + od[None, :], acc)
    tl.store(ml_out + om * 2, m_i)
    tl.store(ml_out + om * 2 + 1, l_i)


SIGNATURE = {
    "q": "*bf16", "k": "*bf16", "v": "*bf16", "acc_out": "*fp32", "ml_out": "*fp32",
    "n_k": "i32", "D": "i32", "q_stride": "i32", "k_stride": "i32", "qk_scale": "fp32",
    "q_start": "i32", "k_start": "i32", "c_full": "i32", "c_end": "i32", "bp": "*bf16",
    "b_stride": "i64", "has_bias": "i32", "BIAS": "constexpr", "STAGES": "constexpr",
    "DT": "constexpr", "USE_TIMER": "constexpr",
}


def compile_sm90(fn, signature: dict, constants: dict, tmp_path: Path) -> tuple[object, dict]:
    """``fn`` compiled for sm_90 (8 warps, 3 stages: run_chains' and the megakernel's), and its
    cubin's resource usage and SASS instruction counts."""
    start = time.perf_counter()
    compiled = triton.compile(
        ASTSource(fn, signature, constants), target=GPUTarget("cuda", 90, 32),
        options={"num_warps": 8, "num_stages": 3},
    )
    seconds = time.perf_counter() - start
    cubin = tmp_path / "fold.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True,
                          text=True, check=True).stdout
    usage = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", str(cubin)],
                           capture_output=True, text=True, check=True).stdout

    def count(op: str) -> int:  # an opcode with any suffix: LDG counts LDG.E.U16 too
        return len(re.findall(rf"\b{re.escape(op)}\b", sass))

    stats = dict(seconds=round(seconds, 1), regs=int(re.search(r"REG:(\d+)", usage).group(1)),
                 stack=int(re.search(r"STACK:(\d+)", usage).group(1)),
                 shared=compiled.metadata.shared, ptx_wgmma="wgmma.mma_async" in compiled.asm["ptx"])
    for op in ("HGMMA", "HMMA", "UTMALDG", "LDL", "STL", "LDG.E.U16", "LDGSTS.E.BYPASS.128"):
        stats[op] = count(op)
    stats["LDG"] = len(re.findall(r"\bLDG\.", sass))  # LDG.E..., not UTMALDG
    return compiled, stats


def _check_fold(stats: dict) -> None:
    summary = str(stats)
    print(summary)
    assert stats["ptx_wgmma"] and stats["HGMMA"] > 0 and stats["HMMA"] == 0, summary  # Hopper's
    assert stats["UTMALDG"] > 0, summary  # q, k and v by TMA
    assert stats["LDG.E.U16"] == 0, summary  # no element-wise bf16 loads
    assert stats["stack"] == 0 and stats["LDL"] == 0 and stats["STL"] == 0, summary
    assert stats["shared"] <= 232448, summary  # an H200 block's shared memory


def test_fast_path_compiles_to_wgmma_and_tma_without_spills(tmp_path):
    _compiled, stats = compile_sm90(
        _fast_fold_kernel, SIGNATURE, {"BIAS": False, "STAGES": None, "DT": tl.bfloat16, "USE_TIMER": True},
        tmp_path)
    _check_fold(stats)
    assert stats["LDG"] == 0 and stats["LDGSTS.E.BYPASS.128"] == 0, stats  # TMA only


def test_masked_fast_path_loads_the_mask_tile_in_16_byte_vectors(tmp_path):
    """A mask tile (additive or boolean, one layout for the scores) beside TMA q/k/v: its loads
    are 16-byte cp.async copies into shared memory (the pipeliner stages them; LDGSTS.128), read
    from there in the scores' own register layout, with no 2-byte loads and no spills. Before
    (the pointer path every masked task took): 255 registers, a 3.2 KB stack, 2.8k LDL, 640
    16-bit loads."""
    compiled, stats = compile_sm90(
        _fast_fold_kernel, SIGNATURE, {"BIAS": True, "STAGES": at._BIAS_STAGES.value, "DT": tl.bfloat16,
         "USE_TIMER": True},
        tmp_path)
    _check_fold(stats)
    assert stats["LDGSTS.E.BYPASS.128"] > 0, stats
    # the scores are reduced once for the max and once for the sum in each of the two folds:
    # a second register layout for them would add reductions
    assert compiled.asm["ttgir"].count('"tt.reduce"') == 4, stats
