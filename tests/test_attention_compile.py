"""The attention tile compiled ahead of time for an H200 (sm_90) on the CPU, no GPU.

The interpreter tests (test_triton_attention.py) check what the bodies compute; they cannot
see how they compile. On H200 the tile ran at 17-33 TF/s (benchmarks/results/v8: the pointer
path of then), and after the first spill fix at 71-470 TF/s with ptxas serialising every wgmma
(v9), while a plain Triton flash tile ran at 512. ptxas allocates one function one register
budget and, where any point of it runs short, serialises every wgmma in it; so the fast loops
must be checked inside the kernels that launch them, not only alone:

- the fast path's own sub-block body (attention_tiles._fast_rows: TMA descriptors over q, k and
  v, q and acc in registers, the plain and the masked key ranges), with a mask tile and
  without, compiled alone: the dots are wgmma (HGMMA), pipelined (one WARPGROUP.DEPBAR an
  iteration, not one per HGMMA), q/k/v come by TMA (UTMALDG), the mask tile by 16-byte
  cp.async, no 16-bit scalar global loads, no local-memory spill inside a loop;
- the megakernel as the bf16 ring launches it (attn_block, its inline finalize and copy in one
  function with the queue loop and the waits): the fast loops' wgmma stay pipelined there and
  the plain loop spills nothing;
- the same megakernel at head size 256: ATTN_D = 256 compiles the wide fast path (one 128 x 256
  acc, 64-key chunks) instead of the 128-column one, and its loops are pipelined too, inside an
  H200 block's shared memory; ATTN_D itself (attention_tiles.attn_head_size) per graph.

benchmarks/NOTES.md has the numbers before and after, also for attention_tiles.chains_kernel
(what benchmarks/bench_attention.py tile launches), compiled the same way by hand.
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
from triton.compiler import ASTSource, make_backend  # noqa: E402

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
                  HAS_BIAS, bp, b_stride, False, DT, USE_TIMER, at._DB, at._KB, None,
                  at._BIAS_STAGES)


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


def sass_stats(cubin_bytes: bytes, tmp_path: Path, per_loop: bool = False) -> dict:
    """A cubin's resource usage and SASS instruction counts, in all and inside loops (and, with
    ``per_loop``, per innermost loop: its size and what one iteration issues)."""
    cubin = tmp_path / "kernel.cubin"
    cubin.write_bytes(cubin_bytes)
    sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(cubin)], capture_output=True,
                          text=True, check=True).stdout
    usage = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", str(cubin)],
                           capture_output=True, text=True, check=True).stdout
    ins, loops = loop_spans(sass)
    in_loop = [text for addr, text in ins if any(lo <= addr <= hi for lo, hi in loops)]

    def count(op: str, texts: list[str]) -> int:  # an opcode and any suffix: LDG.E.U16 is LDG
        return sum(bool(re.search(rf"(^|\s){re.escape(op)}(\.|\s|$)", t)) for t in texts)

    texts = [text for _addr, text in ins]
    stats = dict(loops=len(loops), regs=max(int(r) for r in re.findall(r"REG:(\d+)", usage)),
                 stack=max(int(r) for r in re.findall(r"STACK:(\d+)", usage)))
    for op in ("HGMMA", "HMMA", "UTMALDG", "LDG.E.U16", "LDL", "STL"):
        stats[op] = count(op, texts)
    for op in ("LDG", "LDGSTS.E.BYPASS.128", "LDL", "STL"):
        stats[f"loop {op}"] = count(op, in_loop)
    if per_loop:
        stats["per_loop"] = []
        for lo, hi in loops:
            if any(o != (lo, hi) and lo <= o[0] and o[1] <= hi for o in loops):
                continue
            body = [text for addr, text in ins if lo <= addr <= hi]
            stats["per_loop"].append(dict(
                n=len(body), **{op: count(op, body)
                                for op in ("HGMMA", "UTMALDG", "LDGSTS", "LDL", "STL")},
                DEPBAR=sum("WARPGROUP.DEPBAR" in text for text in body)))
    return stats


def compile_sm90(fn, signature: dict, constants: dict, tmp_path: Path,
                 per_loop: bool = False) -> tuple[object, dict]:
    """``fn`` compiled for sm_90 (8 warps, 3 stages: run_chains' and the megakernel's), and its
    cubin's statistics (:func:`sass_stats`)."""
    start = time.perf_counter()
    compiled = triton.compile(ASTSource(fn, signature, constants),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 8, "num_stages": 3})
    seconds = time.perf_counter() - start
    stats = dict(seconds=round(seconds, 1), shared=compiled.metadata.shared,
                 ptx_wgmma="wgmma.mma_async" in compiled.asm["ptx"],
                 **sass_stats(compiled.asm["cubin"], tmp_path, per_loop))
    return compiled, stats


def compile_megakernel(kinds, args: dict):
    """The generated megakernel of ``kinds`` compiled for sm_90 with ``args`` (the runtime's
    kernel arguments), specialised by Triton's binder as at a launch (test_gpu_compile's way),
    through triton.compile: its metadata has the shared memory the launch needs."""
    from triton.runtime.jit import create_function_from_signature

    from mgraph.runtime.megakernel.dispatch import body_params, megakernel_for
    from mgraph.runtime.megakernel.encode import kind_id

    args = dict(args, NEED_AB=any(p in ("ad0", "bd0") for k in kinds for p in body_params(k)))
    fn = megakernel_for({k: kind_id(k) for k in kinds})
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, launch_opts = binder(**args)
    _options, signature, constexprs, attrs = fn._pack_args(
        backend, launch_opts, bound, specialization, launch_opts)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                          options={"num_warps": args["num_warps"],
                                   "num_stages": args["num_stages"]})


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


def test_ring_megakernel_fast_loops_pipelined(tmp_path):
    """The megakernel as a bf16 ring over 1x2 launches it on rank 0 (test_gpu_compile's
    ring_attention-1x2-bf16 graph: kinds attn_block and copy, no attn_finalize since the
    chains finalise inline by default; the runtime's kernel arguments, 8 warps, 3 stages),
    through ptxas: the fast loops' wgmma stay pipelined beside the queue loop, the waits and
    the copy body, and the plain loop spills nothing. Its masked loops still reload registers (18-28 an iteration with ptxas 13.4 when the kernel
    held attn_finalize too; with ptxas 13.0, 8-9 with it and 1-4 without it; they fold only the
    chunks a causal diagonal crosses). Before: every wgmma serialised, 32-71 LDL an iteration."""
    import test_gpu_compile as tgc

    from mgraph.runtime.megakernel.dispatch import body_params, megakernel_for
    from mgraph.runtime.megakernel.encode import kind_id

    args, kinds = tgc.gpu_args("ring_attention-1x2-bf16")
    assert set(kinds) == {"attn_block", "copy"}, kinds
    args = dict(args, NEED_AB=any(p in ("ad0", "bd0") for k in kinds for p in body_params(k)))
    cubin, _seconds = tgc.compile_for_sm90(megakernel_for({k: kind_id(k) for k in kinds}), args,
                                           "cubin")
    stats = sass_stats(cubin, tmp_path, per_loop=True)
    fast = [r for r in stats["per_loop"] if r["UTMALDG"] > 0 and r["HGMMA"] > 0]
    print({k: v for k, v in stats.items() if k != "per_loop"}, fast)
    assert len(fast) == 4, fast  # (plain, masked) x (mask tile or not)
    assert all(pipelined(r) for r in fast), fast
    plain = min((r for r in fast if r["LDGSTS"] == 0), key=lambda r: r["n"])
    assert plain["LDL"] == 0 and plain["STL"] == 0, fast
    # the pointer path: a call to a function of its own, on mma.sync (HMMA), no wgmma
    assert stats["HMMA"] > 0 and cubin.count(b"_pointer_rows") > 0, stats


def ring_d(D: int, dtype=None):
    """A causal bf16 ring over 1x2 as test_gpu_compile's ring_attention-1x2-bf16, head size D."""
    import torch

    import mgraph as mg

    return mg.ops.ring_attention(topology="1x2", B=1, H=4, S=512, D=D, block=128, kv_heads=2,
                                 causal=True, dtype=dtype or torch.bfloat16)


def test_attn_head_size_picks_the_one_fast_path_a_graph_needs():
    """ATTN_D per graph: the largest head size of the attn_block tasks a fast path takes,
    rounded up to 128 or 256; 0 without attention or with heads past 256 only. The generated
    megakernel declares it (kernel.py's template does not) and the runtime passes it."""
    import torch

    import mgraph as mg
    from mgraph.runtime.megakernel.dispatch import body_constexprs, megakernel_for
    from mgraph.runtime.megakernel.encode import kind_id

    for D, want in ((40, 128), (128, 128), (160, 256), (256, 256), (320, 0)):
        g = ring_d(D)
        assert at.attn_head_size(g, range(len(g.tasks))) == want, D
        # a rank's own tasks: rank 1's attn_block tasks alone give the same
        mine = [t.id for t in g.tasks if t.rank == 1]
        assert body_constexprs(g, mine) == {"ATTN_D": want, "GLU": False, "GEMM_PTR": False}, D
        copies = [t.id for t in g.tasks if t.kind == "copy"]
        assert body_constexprs(g, copies) == {"ATTN_D": 0, "GLU": False, "GEMM_PTR": False}
    fp32 = ring_d(128, torch.float32)  # no fast path for float32 data: compile none
    assert at.attn_head_size(fp32, range(len(fp32.tasks))) == 0
    gemm = mg.ops.gemm_allreduce(topology="1x2", M=256, N=256, K=128)
    assert at.attn_head_size(gemm, range(len(gemm.tasks))) == 0
    fn = megakernel_for({k: kind_id(k) for k in ("attn_block", "attn_finalize", "copy")})
    declared = [q for q in fn.params if q.name == "ATTN_D"]
    assert len(declared) == 1 and declared[0].is_constexpr, fn.arg_names


def test_ring_megakernel_d256_wide_fast_loops_pipelined(tmp_path):
    """The ring megakernel of test_ring_megakernel_fast_loops_pipelined at head size 256:
    ATTN_D = 256, so attn_block compiles the wide fast path alone (q and k 256 columns, one
    128 x 256 fp32 acc, 64-key chunks, 2 stages): every fast loop issues 20 HGMMA an iteration
    (q.k: K 256 over 16 steps; p.v: N 256, K 64 over 4), none the 128-column path's 16; they
    are pipelined, the plain loop spills nothing, and q plus two stages of k, v and a mask tile
    fit an H200 block's shared memory. (With the acc in two 128-column halves, ptxas
    serialised every wgmma of the kernel: C7513.)"""
    from unittest import mock

    import test_gpu_compile as tgc

    name = "ring_attention-1x2-bf16-d256"
    with mock.patch.dict(tgc.GRAPHS, {name: lambda: ring_d(256)}):
        args, kinds = tgc.gpu_args(name)
    assert args["ATTN_D"] == 256 and tgc.gpu_args("ring_attention-1x2-bf16")[0]["ATTN_D"] == 128
    compiled = compile_megakernel(kinds, args)
    stats = sass_stats(compiled.asm["cubin"], tmp_path, per_loop=True)
    fast = [r for r in stats["per_loop"] if r["UTMALDG"] > 0 and r["HGMMA"] > 0]
    print(dict(shared=compiled.metadata.shared,
               **{k: v for k, v in stats.items() if k != "per_loop"}), fast)
    assert len(fast) == 4, fast  # (plain, masked) x (mask tile or not)
    assert all(r["HGMMA"] == 20 for r in fast), fast
    assert all(pipelined(r) for r in fast), fast
    plain = min((r for r in fast if r["LDGSTS"] == 0), key=lambda r: r["n"])
    assert plain["LDL"] == 0 and plain["STL"] == 0, fast
    assert compiled.metadata.shared <= 232448, compiled.metadata.shared
    assert stats["HMMA"] > 0 and compiled.asm["cubin"].count(b"_pointer_rows") > 0, stats


_D192 = """
import torch, mgraph as mg
import mgraph.ops.attention_tiles as at
from mgraph.runtime.megakernel import TritonRuntime

def pointer_path(*args):  # every task here must take the wide fast path
    raise AssertionError("attn_block took the pointer path")

at._pointer_rows = pointer_path
g = mg.ops.ring_attention(topology="1x1", B=1, H=1, S=256, D=192, block=64, kv_block=128,
                          causal=True, dtype=torch.bfloat16)
gen = torch.Generator().manual_seed(5)
x = {n: torch.randn(s.shape, generator=gen).to(torch.bfloat16) for n, s in g.inputs.items()}
s = mg.schedule(g)
want = mg.run(s, x).outputs["out"].float()
got = TritonRuntime(s, interpret=True).run(x).outputs["out"].float()
print("ERR", ((got - want).norm() / want.norm()).item())
"""


def test_megakernel_d192_takes_the_wide_fast_path_interpreted():
    """Under TRITON_INTERPRET=1, the megakernel on a bf16 causal graph of head size 192 (ATTN_D
    256 from the runtime's kernel arguments: q blocks of 64 rows, KV blocks of 128 keys, so a
    task folds chunks below, across and past the diagonal) matches the reference runtime within
    bf16's tolerance (test_triton_attention.TOL_BF16), with the pointer path replaced by an
    error: every task took the wide fast path. (run_chains' head size 160 cases in
    megakernel_attention_interp.py take it through chains_kernel.)"""
    import os

    from test_triton_attention import TOL_BF16

    from helpers import run_interpreted

    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = run_interpreted(["-c", _D192], env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = float(proc.stdout.split("ERR")[-1])
    assert err < TOL_BF16, proc.stdout
