"""GEMM operands whose rows are not whole 16-byte units (TMA cannot address them) run on
backend="triton": the GEMM body takes those tasks by masked pointers (mgraph/ops/gemm_pointers.py)
instead of refusing the graph; every other GEMM keeps the TMA path, and a kernel without such a
task compiles as before (the pointer path is behind the constexpr GEMM_PTR).

- under TRITON_INTERPRET=1 (subprocesses, tests/gemm_rows_interp.py): float32 GEMMs with N or K
  of 2, 30, 50, 270 and a gated unit, a reduce-add on two ranks, traced Linears of odd widths
  beside an aligned one, a traced MoE block whose router rows are 24 bytes; bf16 routers of 4
  and 60 columns and a traced bf16 MoE block of 4 experts; against torch over the whole output
  and every tile, edge tiles included;
- bf16 models encoded for the megakernel (tables, checks, kernel arguments) without running
  them: MoE routers of 4 and 60 experts, an odd vocabulary;
- aligned graphs: no task by pointers, GEMM_PTR off, the same prefix, params and A/B slots, and
  a kernel with no trace of the pointer path in its sm_90 TTIR; where the path is compiled, it
  is a function of its own whose dots are mma.sync (the kernel's GEMM loops stay wgmma);
- the path alone compiled for sm_90 (SASS): where A's rows are whole 16-byte units (the cases
  above but odd K, 18-column K ranges and gemm_glu) its K step loads A in 16-byte vectors, and
  nothing spills.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mgraph as mg
from mgraph.ops.abi import F_NPARAM, F_PARAM0, Q_STATIC
from mgraph.runtime.megakernel import TritonRuntime, encode_rank
from mgraph.runtime.megakernel.dispatch import body_constexprs
from mgraph.runtime.megakernel.encode import GEMM_KINDS, ROLE_ALL, gemm_block, gemm_by_pointers

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from mgraph.ops.gemm_pointers import gemm_pointers  # noqa: E402

HERE = Path(__file__).parent
BF16 = torch.bfloat16

GROUPS = {  # one subprocess each (its imports cost ~2.5 s)
    "gemm": ["gemm-n50", "gemm-n2", "gemm-n30-k50", "gemm-multiblock-n270"],
    "glu-reduce-add-bf16": ["matmul_glu-k50", "gemm_allreduce-1x2-accumulate-n50",
                            "gemm-bf16-n4", "gemm-bf16-n60"],
    "traced": ["traced-linears", "traced-moe-e6"],
    "traced-bf16": ["traced-moe-bf16-e4"],
    "vectors": ["gemm-bf16-n4-k320", "gemm_allreduce-1x2-accumulate-n50-k36"],
}
# the cases whose tasks by pointers read A in 2-byte loads (A's rows or K range not whole 16-byte
# units, or gemm_glu); traced-linears has one GEMM of each shape; every other case's tasks all
# read A in 16-byte vectors (gemm_pointers: the transposed block shape)
NO_VECTORS = {"gemm-n30-k50", "matmul_glu-k50", "gemm_allreduce-1x2-accumulate-n50-k36"}
# bf16: the output's rounding (the interpreter's is coarser than round-to-nearest: ~3e-3 on the
# TMA path too); float32: exact to rounding
TOL = {"float32": 1e-5, "bfloat16": 1e-2}


@pytest.mark.parametrize("group", list(GROUPS))
def test_gemms_with_rows_tma_cannot_address_match_torch_under_the_interpreter(group):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(HERE))
    proc = subprocess.run(
        [sys.executable, str(HERE / "gemm_rows_interp.py"), *GROUPS[group]], env=env,
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["case"] for r in rows] == GROUPS[group]
    for r in rows:
        tol = TOL[r["dtype"]]
        if "eager" in r:  # a bf16 model against float32 eager: as close as eager bf16 is
            tol = 2 * max(r["eager"], r["eager_tile"]) + 2e-3
        assert r["finite"] and r["error"] < tol and r["tile_error"] < tol, r
        assert r["gemm_ptr"] and r["pointer_tasks"] > 0, r  # the pointer path ran
        if r["case"] == "traced-linears":
            assert 0 < r["vector_tasks"] < r["pointer_tasks"], r
        else:
            want = 0 if r["case"] in NO_VECTORS else r["pointer_tasks"]
            assert r["vector_tasks"] == want, r
    if group == "traced":
        linears = rows[0]
        # the aligned Linear stays on TMA, in the static prefix, in the same kernel
        assert linears["tma_tasks"] == 1 and linears["static"] == 1, linears


def _trace(model: torch.nn.Module, x: torch.Tensor, plan=None) -> mg.Program:
    return mg.compile(model.to(BF16).eval(), (x.to(BF16),), plan=plan)


def _moe(experts: int) -> mg.Program:
    from test_trace_moe import StackedMoeBlock

    torch.manual_seed(0)
    model = StackedMoeBlock(hidden=64, ffn=32, experts=experts, top_k=2)
    return _trace(model, torch.randn(2, 16, 64), {"": mg.ExpertParallel(router="gate")})


@pytest.mark.parametrize("what", ["router-4", "router-60", "vocab-1001"])
def test_bf16_routers_and_odd_vocabularies_encode_for_the_megakernel(what):
    """Rows of 8 bytes (4 experts), 120 (60: Qwen1.5-MoE) and 2002 (a vocabulary of 1001, as
    GPT-2's 50257): refused before launch until now (ScheduleError, 'TMA needs 16-byte
    aligned rows'); the runtime now builds its tables and kernel arguments."""
    if what.startswith("router"):
        prog = _moe(int(what.split("-")[1]))
        assert {"moe_route", "moe_expert", "moe_combine"} <= {t.kind for t in prog.graph.tasks}
    else:
        torch.manual_seed(0)
        prog = _trace(torch.nn.Linear(64, 1001, bias=False), torch.randn(2, 16, 64))
    graph = prog.graph
    gemms = [t for t in graph.tasks if t.kind in GEMM_KINDS]
    assert gemms and all(gemm_by_pointers(graph, t) for t in gemms)
    rt = TritonRuntime(prog.schedule, interpret=True)
    try:
        assert body_constexprs(graph, rt.tables.local_tasks)["GEMM_PTR"]
        # no pointer-path task in the static prefix (it loads and stores through TMA)
        assert int(rt.tables.qinfo[ROLE_ALL][Q_STATIC]) == 0
    finally:
        rt.close()


def _aligned_graphs() -> dict:
    torch.manual_seed(0)
    return {
        "gemm": mg.ops.gemm(M=256, N=512, K=256, topology="1x1", tile=[128, 256], dtype=BF16),
        "gemm_allreduce": mg.ops.gemm_allreduce(M=256, N=512, K=256, topology="1x2",
                                                tile=[128, 256], algorithm="accumulate",
                                                dtype=BF16),
        "matmul_glu": mg.ops.matmul_glu(M=256, N=256, K=256, topology="1x1", tile=[128, 128],
                                        dtype=BF16),
        "router-8": _moe(8).graph,
    }


def test_aligned_gemms_keep_the_tma_path_and_their_encoding():
    for name, graph in _aligned_graphs().items():
        gemms = [t for t in graph.tasks if t.kind in GEMM_KINDS]
        assert not any(gemm_by_pointers(graph, t) for t in gemms), name
        assert not body_constexprs(graph, range(len(graph.tasks)))["GEMM_PTR"], name
        sched = mg.schedule(graph)
        for rank in graph.topology.ranks:
            t = encode_rank(sched, rank)
            mine = [x for x in gemms if x.rank == rank]
            if name in ("gemm", "router-8"):
                # its wait-free GEMMs (all the plain GEMM's, the 8-expert router's, whose rows
                # are 16 bytes) in the static TMA prefix, as before (4 experts: none, above)
                free = [x for x in mine if not x.waits]
                assert int(t.qinfo[0][Q_STATIC]) == len(free) > 0, name
            # params: gemm declares one word (accumulate), gemm_glu none, as before
            for local, tid in enumerate(t.local_tasks):
                task = graph.tasks[tid]
                if task.kind in GEMM_KINDS:
                    words = t.params[t.tasks[local][F_PARAM0]:][: t.tasks[local][F_NPARAM]]
                    want = [int(bool(task.params.get("accumulate")))] if task.kind == "gemm" else []
                    assert words.tolist() == want, (name, task.name)
            # the descriptors built once per launch are of the most used A and B
            a_use = {}
            for x in mine:
                a_use[x.reads[0].buffer] = a_use.get(x.reads[0].buffer, 0) + 1
            if a_use:
                assert t.slots[t.a0_slot] == max(a_use, key=a_use.get), name


def test_gemm_blocks_are_powers_of_two():
    """Triton's blocks are powers of two and a dot's at least 16 x 16: a Linear of 100 (or 4)
    outputs over 40 tokens gets the next such block, its edges masked."""

    def block(m: int, n: int, k: int, tile: list[int]) -> tuple[int, int]:
        g = mg.ops.gemm(M=m, N=n, K=k, topology="1x1", tile=tile)
        return gemm_block([t for t in g.tasks if t.kind == "gemm"])

    assert block(40, 100, 64, [128, 256]) == (64, 128)
    assert block(8, 4, 64, [128, 256]) == (16, 16)
    assert block(300, 600, 64, [256, 512]) == (128, 256)
    assert block(256, 512, 64, [128, 256]) == (128, 256)


def _sm90_ttgir(graph) -> tuple[str, dict]:
    """The sm_90 TTGIR of rank 0's kernel for ``graph`` (tests/test_gpu_compile.py's way)."""
    import test_gpu_compile as tgc

    from mgraph.runtime.megakernel import runtime as megaruntime
    from mgraph.runtime.megakernel.dispatch import megakernel_for
    from mgraph.runtime.megakernel.encode import kind_id

    rt = megaruntime.TritonRuntime(
        mg.schedule(graph), rank=0, interpret=True, interpret_roles=True,
        shared=megaruntime._SharedMemory(graph, torch.device("cpu")),
    )
    try:
        rt.interpret, rt.trace_enabled = False, False
        args = rt._kernel_args()
    finally:
        rt.close()
    fn = megakernel_for({k: kind_id(k) for k in rt.tables.kinds})
    module, _ = tgc.compile_for_sm90(fn, args, "ttgir")
    return str(module), args


def test_the_pointer_path_is_compiled_only_where_it_runs_and_apart_from_the_wgmma_loops():
    aligned, args = _sm90_ttgir(
        mg.ops.gemm(M=256, N=512, K=256, topology="1x1", tile=[128, 256], dtype=BF16))
    assert not args["GEMM_PTR"] and "gemm_pointers" not in aligned
    assert "versionMajor = 2" not in aligned  # no mma.sync: only the TMA loops' wgmma
    odd, args = _sm90_ttgir(
        mg.ops.gemm(M=256, N=500, K=256, topology="1x1", tile=[128, 256], dtype=BF16))
    assert args["GEMM_PTR"]
    functions = re.split(r"\n  tt\.func ", odd)  # (Triton 3.6 quotes the callee's name)
    (pointers,) = [f for f in functions
                   if re.match(r'private @"?mgraph\.ops\.gemm_pointers\.gemm_pointers', f)]
    (kernel,) = [f for f in functions if f.startswith("public @megakernel")]
    assert re.search(r'tt\.call @"?mgraph\.ops\.gemm_pointers\.gemm_pointers', kernel)
    mma = dict(re.findall(r"#(mma\d*) = #ttg\.nvidia_mma<\{versionMajor = (\d)", odd))
    in_pointers = set(re.findall(r"parent = #(mma\d*)\b", pointers))
    assert in_pointers and {mma[m] for m in in_pointers} == {"2"}, (in_pointers, mma)
    assert "ttng.warp_group_dot" in kernel and "ttng.warp_group_dot" not in pointers


@triton.jit
def _pointers_kernel(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr, BN: tl.constexpr):
    gemm_pointers(tp, params, regions, bufaddr, bufcols, DT, BN, True, False)


@pytest.fixture(scope="module")
def pointer_sass(tmp_path_factory) -> dict:
    """gemm_pointers alone (bf16, 8 warps, the megakernel's 3 stages) compiled for sm_90: per
    innermost loop with a dot, its global loads by width; the function's local memory use."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    nvidia = pytest.importorskip("triton.backends.nvidia")
    cuobjdump = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        pytest.skip("no cuobjdump in this Triton")
    signature = {"tp": "*i32", "params": "*i32", "regions": "*i32", "bufaddr": "*i64",
                 "bufcols": "*i32", "DT": "constexpr", "BN": "constexpr"}
    compiled = triton.compile(ASTSource(_pointers_kernel, signature, {"DT": tl.bfloat16, "BN": 256}),
                              target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 8, "num_stages": 3})
    cubin = tmp_path_factory.mktemp("sass") / "pointers.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    ins = [(int(m.group(1), 16), m.group(2))
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", sass)]
    loops = []  # from each backward branch's target to the branch
    for addr, text in ins:
        back = re.match(r"(?:@!?U?P\w+\s+)?BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if back and addr - int(back.group(1), 16) > 0x20:
            loops.append((int(back.group(1), 16), addr))
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1]
                                           for o in loops)]

    def count(op: str, texts: list[str]) -> int:  # LDG.E.U16 counts as LDG.E.U16 only
        return sum(bool(re.search(rf"(^|\s){re.escape(op)}(\s|$)", t)) for t in texts)

    dots = []
    for lo, hi in inner:
        body = [text for addr, text in ins if lo <= addr <= hi]
        if any("HMMA" in t for t in body):
            dots.append({op: count(op, body) for op in ("LDG.E.128", "LDG.E.U16", "LDG.E")})
    texts = [text for _addr, text in ins]
    return {"dot_loops": dots, "local": sum(bool(re.search(r"(^|\s)(LDL|STL)", t))
                                            for t in texts),
            "ptx_v4": len(re.findall(r"ld\.global(?:\.\w+)*\.v4\.b32", compiled.asm["ptx"]))}


def test_the_pointer_path_reads_whole_rows_of_a_in_16_byte_vectors(pointer_sass):
    """A router's or an lm_head's A (x: K a multiple of 8) in 16-byte vectors: the transposed
    block's K step loads A^T's 128 x 128 in 8 vectors a thread (2-byte loads before: 16 a
    thread for a 32 x 128 block) and B^T's narrow 32 x 128 in 16 two-byte loads; the other
    shape (A's rows narrow) 24 two-byte loads a step (32 x 64 and 64 x 64); no local memory
    (Triton's pipeliner, left on, made the vector loads asynchronous copies and spilled)."""
    stats = pointer_sass
    assert sorted((d["LDG.E.128"], d["LDG.E.U16"], d["LDG.E"]) for d in stats["dot_loops"]) == [
        (0, 24, 0), (8, 16, 0)], stats
    assert stats["ptx_v4"] == 8 and stats["local"] == 0, stats
