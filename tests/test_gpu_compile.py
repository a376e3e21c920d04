"""The generated megakernel compiled ahead of time for an H200 (sm_90) on the CPU, no GPU.

Triton's interpreter (what the other megakernel tests run) executes the bodies as Python and
type-checks nothing the way the compiler does: a body that returned bf16 on one path and float32
on another ran there and failed to compile on the GPU (block-sp-1x2, attention_tiles._operand).
This test feeds the same kernel through the compiler for target cuda:90. The kernel arguments are
the ones runtime.py passes on a GPU (``TritonRuntime._kernel_args`` with rank 0's tables, its
programs split into roles and ``USE_TIMER`` on; NEED_AB follows the dispatch, as runtime.py
derives it), specialised by Triton's own binder as at a launch. The dispatch holds every kind the graphs below run, which
the first test checks is every kind mgraph ships a body for, plus the rdma push. Each config
compiles to TTIR (the AST front end, where type errors surface); the SP block goes on to TTGIR
(layouts, TMA, the pipeliner). Each config's TTIR also goes through tests/cta_uniform.py: no
branch on a value that may differ between a program's warps (runtime/megakernel/sync.py,
"Uniform control flow"). LLVM IR, PTX and ptxas took about two minutes more for the SP
block on two cores and are not run here: ``python tests/test_gpu_compile.py --full`` runs them
by hand. Nothing is cached between runs: the stages are run directly, not through
``triton.compile`` and its on-disk cache.
"""

from __future__ import annotations

import sys
import time
from functools import cache
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from cta_uniform import divergent_branches  # noqa: E402

import mgraph as mg  # noqa: E402
import mgraph.runtime.megakernel.runtime as megaruntime  # noqa: E402
from mgraph.kinds import KINDS  # noqa: E402
from mgraph.runtime.megakernel.dispatch import (  # noqa: E402
    PUSH_KIND,
    body_params,
    has_body,
    megakernel_for,
)
from mgraph.runtime.megakernel.encode import PUSH_ID, kind_id  # noqa: E402
from mgraph.scheduler import Schedule  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

BF16, F32 = torch.bfloat16, torch.float32
GEMM = dict(M=512, N=512, K=256, tile=[128, 256])  # the GPU's GEMM tile (BM=128, BN=256)


def block_sp() -> Schedule:
    """tests/gpu_programs.py's block-sp case: the traced transformer block, bf16, SP on 1x2."""
    import transformer_block as tb

    torch.manual_seed(0)
    model = tb.Block(hidden=1024, heads=8, ffn=4096).to(BF16).eval()
    x = torch.randn(1, 512, 1024, dtype=BF16)
    return mg.compile(model, (x,), plan=tb.gpu_plan(), topology="1x2", backend="triton").schedule


# The graphs whose kinds make the dispatch: every kind with a body runs in one of them.
GRAPHS = {
    "block-sp-1x2-bf16": block_sp,
    "gemm_allreduce-1x2-bf16": lambda: mg.ops.gemm_allreduce(topology="1x2", dtype=BF16, **GEMM),
    "allgather_gemm-1x2-bf16": lambda: mg.ops.allgather_gemm(topology="1x2", dtype=BF16, **GEMM),
    "gemm_allreduce-2x1-bf16": lambda: mg.ops.gemm_allreduce(topology="2x1", dtype=BF16, **GEMM),
    # inline_finalize=False: the only graph here with attn_finalize tasks (the ops' default
    # folds them into each chain's last attn_block), so its body is still compiled
    "ring_attention-1x2-fp32": lambda: mg.ops.ring_attention(
        topology="1x2", B=1, H=4, S=512, D=128, block=128, kv_heads=2, causal=True, dtype=F32,
        inline_finalize=False,
    ),
    "ring_attention-1x2-bf16": lambda: mg.ops.ring_attention(
        topology="1x2", B=1, H=4, S=512, D=128, block=128, kv_heads=2, causal=True, dtype=BF16
    ),
    "moe-1x2-bf16": lambda: mg.ops.moe_dispatch_combine(
        topology="1x2", T=64, E=8, H=256, F=512, top_k=2, expert_group=2, dtype=BF16
    ),
    "layer_norm-1x2-bf16": lambda: mg.ops.layer_norm(
        topology="1x2", rows=256, cols=1024, dtype=BF16
    ),
    "softmax-1x2-bf16": lambda: mg.ops.softmax(topology="1x2", rows=256, cols=1024, dtype=BF16),
    "row_reduce-1x2-bf16": lambda: mg.ops.row_reduce(
        topology="1x2", rows=256, cols=1024, fn="sum", dtype=BF16
    ),
    # a head split: the traced block's relayouts are all read in place now (fuse_pointwise,
    # token_major_attention), so the relayout body comes from the op itself
    "relayout-1x2-bf16": lambda: mg.ops.relayout(
        topology="1x2", rows=1024, cols=64, in_shape=[1, 256, 4, 64],
        steps=[["permute", [0, 2, 1, 3]]], dtype=BF16,
    ),
    "concat-1x2-bf16": lambda: mg.ops.concat(
        topology="1x2", rows=256, cols=512, cols_y=256, dtype=BF16
    ),
    # gated units (mg.compile glu=True): two products a tile, the unit in the epilogue
    "matmul_glu-1x2-bf16": lambda: mg.ops.matmul_glu(
        topology="1x2", M=512, N=512, K=256, shard="cols", tile=[128, 128], dtype=BF16
    ),
}
# The configs compiled, each with the dispatch of every kind and its own kernel arguments:
# name -> (last stage, trace=True, what it adds to the kernel that the others leave out).
COMPILED = {
    "block-sp-1x2-bf16": ("ttgir", False, "the H200 case: attention, norms, TMA GEMMs"),
    "gemm_allreduce-1x2-bf16": ("ttir", True, "segments reduce-adding two writes; TRACE"),
    "allgather_gemm-1x2-bf16": ("ttir", False, "segments with hoisted waits (SEG_WAITS)"),
    "gemm_allreduce-2x1-bf16": ("ttir", False, "multi-node: rdma push, host FIFO (HAS_NET)"),
    "ring_attention-1x2-fp32": ("ttir", False, "every body at DT=float32"),
    "matmul_glu-1x2-bf16": ("ttir", False, "gemm's body with the gated-unit epilogue (GLU)"),
}


@cache
def schedule_of(name: str) -> Schedule:
    graph = GRAPHS[name]()
    return graph if isinstance(graph, Schedule) else mg.schedule(graph)


@cache
def gpu_args(name: str, trace: bool = False) -> tuple[dict, frozenset[str]]:
    """(the kernel arguments rank 0 of ``name`` launches with on a GPU, the kinds it runs).

    The runtime is built on the CPU the interpreter's way (every rank's arena in this process)
    but with one program per worker (``interpret_roles``), as a GPU process encodes rank 0's
    tables and sizes its launch (the interpreter's single program would give other queues,
    segment switches, ``seg_p`` 1 and ``pool`` 0, which Triton specialises differently); then
    it answers as a GPU runtime: watchdog in ns, USE_TIMER on."""
    schedule = schedule_of(name)
    rt = megaruntime.TritonRuntime(
        schedule,
        rank=0,
        interpret=True,
        interpret_roles=True,
        shared=megaruntime._SharedMemory(schedule.graph, torch.device("cpu")),
    )
    try:
        rt.interpret, rt.trace_enabled = False, trace
        args = rt._kernel_args()
    finally:
        rt.close()
    assert args["USE_TIMER"] and args["TRACE"] == trace
    assert args["pool"] > 0 and args["seg_p"] > 1, "not the GPU's split of programs into roles"
    return args, frozenset(rt.tables.kinds)


def shipped_kinds() -> set[str]:
    """Every kind whose Triton body mgraph ships (not ones a test registered), and the push."""

    def module(kind: str) -> str:
        body = KINDS[kind].triton_body
        return getattr(body, "fn", body).__module__

    return {k for k in KINDS if has_body(k) and module(k).startswith("mgraph.")} | {PUSH_KIND}


@cache
def every_kind_megakernel():
    kinds = set().union(*(gpu_args(name)[1] for name in GRAPHS))
    used = {k: PUSH_ID if k == PUSH_KIND else kind_id(k) for k in kinds}
    return megakernel_for(used), kinds


def dispatch_args(name: str, kinds: set[str], trace: bool = False) -> dict:
    """``name``'s GPU arguments for a dispatch of ``kinds``: the kernel builds the GEMM A/B
    descriptors when a dispatched body takes them (runtime.py's rule for NEED_AB)."""
    args = dict(gpu_args(name, trace)[0])
    args["NEED_AB"] = any(p in ("ad0", "bd0") for k in kinds for p in body_params(k))
    return args


def compile_for_sm90(
    fn, args: dict, last: str, texts: dict[str, str] | None = None
) -> tuple[object, dict[str, float]]:
    """Compile ``fn`` for cuda:90 through stage ``last`` (ttir, ttgir, llir, ptx or cubin):
    the arguments specialised as JITFunction.run does at a launch, then Triton's stages one by
    one. Returns (the last module, seconds per stage); ``texts``, when given, gets the text of
    each stage before the cubin (a stage changes the previous one's module in place)."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    assert isinstance(fn, JITFunction), "TRITON_INTERPRET is set: the compiler is not in use"
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, launch_opts = binder(**args)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, launch_opts, bound, specialization, launch_opts
    )
    src = ASTSource(fn, signature, constexprs, attrs)
    stages: dict = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    seconds = {}
    start = time.perf_counter()
    module = src.make_ir(
        target,
        options,
        backend.get_codegen_implementation(options),
        backend.get_module_map(),
        context,
    )
    seconds["ast"] = time.perf_counter() - start
    metadata: dict = {}
    for stage, run in stages.items():
        start = time.perf_counter()
        module = run(module, metadata)
        seconds[stage] = time.perf_counter() - start
        if texts is not None and not isinstance(module, bytes):
            texts[stage] = str(module)
        if stage == last:
            return module, seconds
    raise AssertionError(f"no stage {last!r} in {list(stages)}")


def test_the_graphs_cover_every_kind_with_a_body():
    _fn, kinds = every_kind_megakernel()
    missing = shipped_kinds() - kinds
    assert not missing, f"add a graph that runs {sorted(missing)} to GRAPHS"
    # Each compiled config still turns on what it is in COMPILED for (a lowering that stops
    # doing so would silently drop that part of the kernel from the test).
    on = {name: gpu_args(name)[0] for name in COMPILED}
    ar = on["gemm_allreduce-1x2-bf16"]
    assert ar["HAS_SEGS"] and ar["SEG_ADD"] and ar["SEG_NW"] > 1, ar
    assert on["allgather_gemm-1x2-bf16"]["SEG_WAITS"], on["allgather_gemm-1x2-bf16"]
    assert on["gemm_allreduce-2x1-bf16"]["HAS_NET"], on["gemm_allreduce-2x1-bf16"]
    assert PUSH_KIND in gpu_args("gemm_allreduce-2x1-bf16")[1]
    block = on["block-sp-1x2-bf16"]
    assert (block["BM"], block["BN"], block["BARRIER"]) == (128, 256, True), block
    assert str(on["ring_attention-1x2-fp32"]["DT"]) == "fp32"
    assert on["matmul_glu-1x2-bf16"]["GLU"] and not block["GLU"], on["matmul_glu-1x2-bf16"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPILED))
def test_megakernel_with_every_kind_compiles_for_sm90(name):
    last, trace, _why = COMPILED[name]
    fn, kinds = every_kind_megakernel()
    texts: dict[str, str] = {}
    module, _seconds = compile_for_sm90(fn, dispatch_args(name, kinds, trace), last, texts)
    text = str(module)
    assert "tt.func public @megakernel" in text
    if last == "ttgir":  # laid out for the H200: compute capability 90, the launch's warps
        assert 'ttg.target = "cuda:90"' in text and '"ttg.num-warps" = 8 : i32' in text
    found = divergent_branches(texts["ttir"])
    assert found == [], "branches on per-warp values (file:line <- caller):\n" + "\n".join(found)


@pytest.mark.slow
def test_adaptive_controller_compiles_for_sm90():
    """Settings(adaptive=True) compiles the controller into the kernel (control.py: counters,
    the windowed decision, role changes at task boundaries, the reset at exit); AG+GEMM's
    schedule has compute and nvlink programs to move."""
    fn, kinds = every_kind_megakernel()
    args = dispatch_args("allgather_gemm-1x2-bf16", kinds)
    assert args["pool"] > 0 and args["window_ns"] > 0 and args["max_comm"] > 0, args
    args["ADAPTIVE"] = True
    texts: dict[str, str] = {}
    module, _seconds = compile_for_sm90(fn, args, "ttgir", texts)
    text = str(module)
    assert "tt.atomic_cas" in text and "tt.func public @megakernel" in text
    found = divergent_branches(texts["ttir"])
    assert found == [], "branches on per-warp values (file:line <- caller):\n" + "\n".join(found)


def main() -> None:
    """By hand: every config through ptxas (minutes), with seconds per stage."""
    last = "cubin" if "--full" in sys.argv else None
    fn, kinds = every_kind_megakernel()
    print(f"dispatch: {sorted(kinds)}")
    for name, (stage, trace, _why) in COMPILED.items():
        module, seconds = compile_for_sm90(fn, dispatch_args(name, kinds, trace), last or stage)
        size = f", cubin {len(module)} bytes" if isinstance(module, bytes) else ""
        print(f"{name}: " + ", ".join(f"{s} {t:.1f} s" for s, t in seconds.items()) + size)


if __name__ == "__main__":
    main()
