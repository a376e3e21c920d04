"""Straight-line code per elementwise chain (mgraph/ops/elementwise_special.py).

The megakernel's generated copy gets one function per chain its tasks carry (at most
Settings.ewise_chains); a task whose chain has none runs the bytecode interpreter
(elementwise_bodies.ewise_tile), as does every task with ewise_chains=0
(tests/test_ewise_batches.py runs that path).

- CPU: which chains a traced Llama layer has, the block shapes, the dispatch text.
- TRITON_INTERPRET=1 (this file as a subprocess): chains of one, two and three operands with a
  rotation, over tiles of several blocks with masked edges, against the reference runtime;
  a traced module of two chains with room for one of them (one task set runs the generated
  code, the other the interpreter) and for both.
"""

from __future__ import annotations

import argparse
import ast
import sys

import pytest
import torch
from torch import nn

import mgraph as mg
from helpers import check_interpreter_cases

BF16, F32 = torch.bfloat16, torch.float32


# -- on the host ----------------------------------------------------------------------------------
def _small_layer_graph():
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_layer as bl

    args = argparse.Namespace(hidden=512, heads=4, kv_heads=2, ffn=1024, dtype=BF16)
    layer = bl.build_layer(args, torch.device("cpu"))
    x = torch.randn(1, 512, 512, dtype=BF16)
    return mg.compile(layer, (x,), plan=bl.mgraph_plan(), topology="1x1").graph


def test_a_llama_layer_has_three_chains():
    from mgraph.ops.elementwise import CODES, GATHER, LOAD, ROT
    from mgraph.ops.elementwise_special import chain_keys

    g = _small_layer_graph()
    chains = chain_keys(g, [t.id for t in g.tasks], 6)
    ops = []
    for key, shape in chains:
        code = [key[2 + 4 * k : 6 + 4 * k] for k in range(key[0])]
        names = ["LOAD" if c[0] == LOAD else "ROT" if c[0] == ROT else CODES[c[0]] for c in code]
        ops.append((names, shape, key[-1]))
    # RoPE over q and k (one chain: the same bytecode and operand forms), the residual adds,
    # SwiGLU; RoPE's tiles are 512 rows of 128 columns (traced_tile_rows), q read through the
    # head split's gather map, cos and sin through row maps
    rope = ("ROT", "LOAD", "mul", "LOAD", "LOAD", "mul", "add")
    assert {tuple(o[0]): o[1] for o in ops} == {
        rope: (512, 128),
        ("LOAD", "LOAD", "add"): (128, 512),
        ("LOAD", "silu", "LOAD", "mul"): (64, 1024),
    }, ops
    maps = next(o[2] for o in ops if tuple(o[0]) == rope)
    assert maps & 3 == GATHER and (maps >> 2) & 3 and (maps >> 4) & 3, maps
    assert chain_keys(g, [t.id for t in g.tasks], 1) == chains[:1]


def test_block_shapes():
    from mgraph.ops.elementwise_special import block_shape

    # bf16: 16 vectors a thread over all loads, 8 warps; columns first, up to 1024
    assert block_shape(2, 16, (64, 14336)) == (16, 1024)
    assert block_shape(4, 16, (512, 128)) == (64, 128)
    assert block_shape(2, 16, (64, 4096)) == (16, 1024)
    assert block_shape(1, 32, (24, 80)) == (32, 128)  # fp32: 8 vectors; rows up to the tile's
    assert block_shape(8, 32, (4, 4096)) == (1, 1024)
    assert block_shape(3, 16, (256, 1024)) == (8, 1024)  # 5 vectors an operand: 4 (a power of 2)
    for loads in range(1, 9):  # Triton's aranges are powers of two: every block shape is
        for bits in (16, 32):
            for shape in ((64, 14336), (10, 80), (512, 128), (1, 8), (3, 4096), (1000, 1000)):
                rows, cols = block_shape(loads, bits, shape)
                assert rows & (rows - 1) == 0 and cols & (cols - 1) == 0, (loads, bits, shape)


def test_the_dispatch_falls_back_to_the_interpreter():
    from mgraph.ops.elementwise_special import special_source

    key = (1, 1, 20, 1, 0, 0, 0)  # LOAD r1 <- input 0, maps 0
    text = special_source([(key, (64, 128))], 16, "_entry")
    tree = ast.parse(text)
    names = [f.name for f in tree.body if isinstance(f, ast.FunctionDef)]
    assert names == ["_ewise_chain_0_vec", "_ewise_chain_0", "_entry"]
    entry = text[text.index("def _entry") :]
    assert "(k0 == 1) & (k1 == 1) & (k2 == 20) & (k3 == 1)" in entry and "(mp == 0)" in entry
    assert entry.rstrip().endswith("ewise_other(tp, params, regions, bufaddr, bufcols, DT)")
    empty = special_source([], 16, "_entry")
    assert "_ewise_chain_" not in empty and "ewise_other(" in empty


# -- under the interpreter ------------------------------------------------------------------------
class TwoChains(nn.Module):
    """Two elementwise ops fusion keeps apart (``a`` is read twice): two chains."""

    def forward(self, x, y):
        a = torch.nn.functional.silu(x) * y
        return (a + 1.5) * a


INTERP_CASES = {
    **{f"{name}-{dt}": True for name in ("unary", "swiglu", "rope3", "rope3-wide")
       for dt in ("float32", "bfloat16")},
    "two-chains-1-float32": True,
    "two-chains-2-float32": True,
    # a tile wider than a block: the one loop over every block (the next block may be in the
    # next column block), partial last blocks in both dims
    "swiglu-flat-float32": True,
    "swiglu-flat-bfloat16": True,
}


def test_chains_in_the_megakernel():
    pytest.importorskip("triton")
    check_interpreter_cases("test_ewise_special.py", INTERP_CASES)


def _interp_main() -> None:
    from test_ewise_batches import interp_row, run_cases

    from mgraph.ops.elementwise_special import chain_keys
    from mgraph.runtime.megakernel import TritonRuntime
    from mgraph.settings import Settings

    run_cases(Settings(), 37, chains=1)
    from test_ewise_batches import CHAINS

    chain, operands = CHAINS["swiglu"]
    for dt in (F32, torch.bfloat16):
        g = mg.ops.elementwise(topology="1x1", rows=40, cols=1104, chain=chain,
                               operands=operands, tile_rows=40, dtype=dt)
        (key, shape), = chain_keys(g, [t.id for t in g.tasks], 6)
        assert shape == (40, 1104)
        gen = torch.Generator().manual_seed(43)
        inputs = {n: torch.randn(s.shape, generator=gen).to(dt) for n, s in g.inputs.items()}
        sched = mg.schedule(g)
        got = TritonRuntime(sched, interpret=True).run(inputs).outputs
        interp_row(f"swiglu-flat-{str(dt).removeprefix('torch.')}", g, got,
                   mg.run(sched, inputs).outputs, dt, chains=1)
    gen = torch.Generator().manual_seed(41)
    x, y = (torch.randn(96, 256, generator=gen) for _ in range(2))
    prog = mg.compile(TwoChains(), (x, y), topology="1x1")
    g = prog.graph
    assert len(chain_keys(g, [t.id for t in g.tasks], 6)) == 2
    want = {"out": TwoChains()(x, y)}
    for n in (1, 2):
        rt = TritonRuntime(prog.schedule, interpret=True, settings=Settings(ewise_chains=n))
        out = rt.run({name: t for name, t in zip(g.inputs, (x, y), strict=True)}).outputs
        interp_row(f"two-chains-{n}-float32", g, {"out": next(iter(out.values()))}, want, F32,
                   chains=n)


if __name__ == "__main__":
    _interp_main()


# -- ahead of time, sm_90 --------------------------------------------------------------------------
def test_random_chains_compile(tmp_path):
    """The dispatch of test_program_triton's random chains (1 to 5 loads a block, every fn, CONST
    steps) through Triton's front end for sm_90, in bf16 and fp32: what the interpreter does not
    check (a block of 10 rows ran there and failed to compile on the H200: aranges are powers of
    two)."""
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    import importlib.util

    import triton.language as tl
    from test_program_triton import chain_case
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    from mgraph.ops.elementwise_special import chain_keys, special_source

    chains = []
    for seed in range(4):
        model, args = chain_case(seed, shape=(2, 64, 1024))  # gpu_programs.py's width
        g = mg.compile(model, args, topology="1x1").graph
        chains += chain_keys(g, [t.id for t in g.tasks], 6)
    assert len({k for k, _s in chains}) >= 4, chains
    signature = {"tp": "*i32", "params": "*i32", "regions": "*i32", "bufaddr": "*i64",
                 "bufcols": "*i32", "DT": "constexpr"}
    for bits, dt in ((16, tl.bfloat16), (32, tl.float32)):
        path = tmp_path / f"chains{bits}.py"
        path.write_text(special_source(chains, bits, "entry"))
        spec = importlib.util.spec_from_file_location(f"chains{bits}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # type: ignore[union-attr]
        src = ASTSource(module.entry, signature, {"DT": dt})
        target = GPUTarget("cuda", 90, 32)
        backend = make_backend(target)
        options = backend.parse_options({"num_warps": 8})
        context = ir.context()
        ir.load_dialects(context)
        backend.load_dialects(context)
        module_ir = src.make_ir(target, options, backend.get_codegen_implementation(options),
                                backend.get_module_map(), context)
        assert "tt.func" in str(module_ir)


def test_swiglu_chain_loop_moves_16_byte_vectors(tmp_path):
    """SwiGLU's generated fast path alone compiled for sm_90 (8 warps, bf16): one loop, each
    iteration a 16 x 1024 block, 8 vectors a thread of each operand loaded (16 LDG.E.128),
    8 stored, nothing in local memory; the first block loaded before the loop (each iteration
    loads the next block before computing its own)."""
    triton = pytest.importorskip("triton")
    nvidia = pytest.importorskip("triton.backends.nvidia")
    import importlib.util
    import re
    import subprocess
    from pathlib import Path

    import triton.language as tl
    from test_ewise_batches import _loops
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from mgraph.ops.elementwise import compile_chain
    from mgraph.ops.elementwise_special import special_source

    p = compile_chain([["silu", 0, -1, 0.0], ["mul", 2, 1, 0.0]], 2)
    key = (p["nops"], p["result"], *(p[f"w{i}"] for i in range(4 * p["nops"])), 0)
    text = special_source([(key, (64, 14336))], 16, "_entry") + (
        "\n\n@triton.jit\n"
        "def probe(tp, params, regions, bufaddr, bufcols, r0, w0, m, n, DT: tl.constexpr):\n"
        "    _ewise_chain_0_vec(tp, params, regions, bufaddr, bufcols, r0, w0, m, n, 0, 0, DT)\n"
    )
    path = tmp_path / "swiglu_probe.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("swiglu_probe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    signature = {"tp": "*i32", "params": "*i32", "regions": "*i32", "bufaddr": "*i64",
                 "bufcols": "*i32", "r0": "i32", "w0": "i32", "m": "i32", "n": "i32",
                 "DT": "constexpr"}
    compiled = triton.compile(ASTSource(module.probe, signature, {"DT": tl.bfloat16}),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    cubin = tmp_path / "probe.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    ins = [(int(m.group(1), 16), m.group(2))
           for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", sass)]
    assert not any(re.search(r"(^|\s)(LDL|STL)(\.|\s|$)", t) for _a, t in ins), "local memory"
    loops = _loops(ins)
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1]
                                           for o in loops)]
    body = [[t for a, t in ins if lo <= a <= hi] for lo, hi in inner]
    counts = [(sum("LDG.E.128" in t for t in b), sum("STG.E.128" in t for t in b)) for b in body]
    assert (16, 8) in counts, counts
    # the first block's loads issued before the loop: each iteration loads the NEXT block
    (lo, hi), = [lp for lp, c in zip(inner, counts, strict=True) if c == (16, 8)]
    assert sum("LDG.E.128" in t for a, t in ins if a < lo) >= 16, "no block loaded ahead"
