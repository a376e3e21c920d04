"""The MoE tile bodies' fast paths: what they compute (Triton's interpreter, bf16 and float32,
tests/megakernel_moe_fast_interp.py) and how they compile for an H200 (sm_90, ahead of time on
the CPU, as tests/test_attention_compile.py reads SASS).

On one H200 (benchmarks/results/v9, before this test's change) the MoE megakernel took 81.6 ms
where the torch baseline took 16.3: a route task spent 23.5 ms (a scalar loop per expert of its
group with two barriers each, and 32 x 256 masked element-wise copies per token block and
expert), an expert task 4.5 ms (the weights by 16-bit element-wise loads: 48 LDG.E.U16 an
iteration of the K loop), a combine task 0.4 ms (element-wise loads). The compile test pins
what replaced them: the expert body's K loops are wgmma fed by TMA with no element-wise load,
the route body's row copy and the combine body's gathers are 16-byte vectors."""

from __future__ import annotations

import re
import subprocess
import time
from functools import cache

import pytest

from helpers import interpreter_rows

triton = pytest.importorskip("triton")
nvidia = pytest.importorskip("triton.backends.nvidia")

from test_attention_compile import BIN, loop_spans  # noqa: E402
from test_gpu_compile import dispatch_args, gpu_args, kind_id, megakernel_for  # noqa: E402

BODIES = ["route-send", "route-meta", "route-pick_rows", "route-pick_weights", "expert-hidden",
          "expert-back", "combine-out", "op-reference"]  # fmt: skip
# bf16: the interpreter rounds float32 to bf16 toward zero (the GPU and torch to nearest), so
# about half of the hidden's elements differ by one bf16 step from the CPU runtime's
TOL = {"bf16": 2e-2, "fp32": 2e-6}
# the paths each case runs: the expert body's, the route body's ranking (6 logits a row: not
# whole 16-byte units, the float ranking); 256 rows: a 192-row chunk in the pair tile, then 64
PATHS = {"bf16-rows128": ["float", "tma128"], "bf16-rows64": ["float", "tma64"],
         "fp32-h38": ["float", "pointer"], "bf16-keys": ["keys16", "tma64"],
         "bf16-rows256": ["float", "pair192", "tma64"], "bf16-rows160": ["float", "pair192"],
         "bf16-split": ["float", "pair192"], "fp32-split": ["float", "pointer"],
         "fp32-split-tma": ["float", "tma64"]}  # fmt: skip


@cache
def rows() -> dict[str, dict]:
    return interpreter_rows("megakernel_moe_fast_interp.py")


@pytest.mark.parametrize("case", list(PATHS))
def test_fast_paths_match_the_cpu_runtime_and_the_reference(case):
    got = {k: r for k, r in rows().items() if k.startswith(f"{case}:1x1-")}
    assert sorted(k.rsplit("-", 2)[-2] + "-" + k.rsplit("-", 1)[-1] for k in got) == sorted(
        BODIES
    ), sorted(got)
    tol = TOL[case.split("-")[0]]
    for name, r in got.items():
        assert r["error"] < tol and not r["nan"], (name, r)
        assert r["dropped"] == r["dropped_cpu"] == r["dropped_reference"], r
        assert r["dropped"] == [0.0] * len(r["counts"]), r
    # the expert body's path that ran: the case is about that path
    assert rows()[f"{case}:paths"]["paths"] == PATHS[case]
    if case in ("bf16-rows128", "bf16-rows256", "bf16-rows160", "bf16-split"):  # two segments
        # filled, the rest empty
        n = 160 if case == "bf16-split" else int(case.removeprefix("bf16-rows"))
        assert next(iter(got.values()))["counts"] == [n, 0, 0, n, 0, 0]


def test_column_split_lowers_to_pass_tasks_and_matches_the_reference():
    """expert_cols_f / expert_cols_h: each expert row tile becomes pass-1 tasks on slices of
    hidden columns (part 1) and pass-2 tasks on slices of output columns (part 2) that wait for
    all of them; the CPU runtime matches the torch reference (the Triton bodies: the
    interpreter cases above)."""
    import mgraph as mg
    from helpers import check_graph
    from mgraph.errors import OptionError

    kw = dict(T=48, H=16, E=4, top_k=2, F=40, expert_rows=8, combine_cols=8, topology="1x2")
    g = mg.ops.moe_dispatch_combine(**kw, expert_cols_f=16, expert_cols_h=8)
    whole = mg.ops.moe_dispatch_combine(**kw)
    experts = [t for t in g.tasks if t.kind == "moe_expert"]
    tiles = [t for t in whole.tasks if t.kind == "moe_expert"]
    parts = [t.params["part"] for t in experts]
    # F = 40: slices 16, 16, 8; H = 16: two slices of 8
    assert parts.count(1) == 3 * len(tiles) and parts.count(2) == 2 * len(tiles), parts
    assert {t.params["part"] for t in tiles} == {0}
    one = [t for t in experts if t.name.startswith(tiles[0].name + " ")]
    widths = [(t.params["part"], t.reads[3].col1 - t.reads[3].col0) for t in one]
    assert widths == [(1, 16), (1, 16), (1, 8), (2, 8), (2, 8)], widths
    first = {t.id for t in one if t.params["part"] == 1}
    for t in one:
        if t.params["part"] == 2:  # waits on one event the three pass-1 tasks signal
            ((event, count),) = t.waits
            assert count == 3 and {u.id for u in g.tasks if event in u.signals} == first
    assert sum(t.flops for t in experts) == pytest.approx(sum(t.flops for t in tiles))
    check_graph(g)
    for bad in (dict(expert_cols_f=16), dict(expert_cols_f=16, expert_cols_h=0)):
        with pytest.raises(OptionError):
            mg.ops.moe_dispatch_combine(**kw, **bad)


def _compile_sm90(fn, args: dict) -> tuple[bytes, dict]:
    """tests/test_gpu_compile.compile_for_sm90 through ptxas, keeping the metadata (shared
    memory): the arguments specialised as at a launch, Triton's stages run directly (no cache)."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", 90, 32))
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
    module = src.make_ir(GPUTarget("cuda", 90, 32), options,
                         backend.get_codegen_implementation(options),
                         backend.get_module_map(), context)  # fmt: skip
    metadata: dict = {}
    for _stage, run in stages.items():
        module = run(module, metadata)
    return module, metadata


def _count(op: str, texts: list[str]) -> int:  # an opcode and any suffix: LDG.E.U16 is LDG
    return sum(bool(re.search(rf"(^|\s){re.escape(op)}(\.|\s|$)", t)) for t in texts)


def test_moe_megakernel_compiles_to_wgmma_tma_and_vector_loads(tmp_path):
    """The megakernel of a bf16 MoE graph (route, move, expert, combine, copy: rank 0 of
    test_gpu_compile's 1x2 graph, its launch arguments), through ptxas for sm_90. Per innermost
    loop of the SASS: the expert body's K loops (six: pass 1 and pass 2 of the 64-row, 128-row
    and pair tiles) are wgmma (HGMMA) fed by TMA (UTMALDG), one wgmma group in flight (a serialised
    wgmma waits after each), no element-wise 16-bit load; the route body's row copy loads and
    stores 16-byte vectors; the kernel fits an H200 block's shared memory."""
    name = "moe-1x2-bf16"
    kinds = gpu_args(name)[1]
    assert {"moe_route", "moe_expert", "moe_combine", "moe_move"} <= kinds, kinds
    fn = megakernel_for({k: kind_id(k) for k in kinds})
    start = time.perf_counter()
    cubin, metadata = _compile_sm90(fn, dispatch_args(name, kinds))
    path = tmp_path / "moe.cubin"
    path.write_bytes(cubin)
    sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(path)], capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    ins, loops = loop_spans(sass)
    inner = [(lo, hi) for lo, hi in loops
             if not any(o != (lo, hi) and lo <= o[0] and o[1] <= hi for o in loops)]  # fmt: skip
    per_loop = []
    for lo, hi in inner:
        body = [text for addr, text in ins if lo <= addr <= hi]
        per_loop.append({op: _count(op, body) for op in ("HGMMA", "UTMALDG", "LDG.E.U16", "LDL",
                                                          "STL", "LDG.E.128", "STG.E.128")}
                        | {"DEPBAR": sum("WARPGROUP.DEPBAR" in t for t in body), "n": len(body)})  # fmt: skip
    summary = f"{time.perf_counter() - start:.0f} s, shared {metadata.get('shared')}: {per_loop}"
    print(summary)
    gemm = [r for r in per_loop if r["HGMMA"] > 0]
    assert len(gemm) == 6, summary
    for r in gemm:
        assert r["UTMALDG"] >= 2 and r["LDG.E.U16"] == 0, summary
        assert r["DEPBAR"] <= 2, summary  # pipelined: a serialised loop waits after each HGMMA
        assert r["LDL"] <= 1 and r["STL"] == 0, summary  # (ptxas 13.4: one reload in one loop)
    # the route body's copy of routed rows: 16-byte loads and stores
    assert any(r["LDG.E.128"] > 0 and r["STG.E.128"] > 0 and r["LDG.E.U16"] == 0
               for r in per_loop), summary  # fmt: skip
    assert metadata["shared"] <= 232448, summary
