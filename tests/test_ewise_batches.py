"""The ewise fast path's batches (elementwise_bodies._ewise_vec): which path a Llama layer's
chains take, both dtypes' batches against the reference runtime, and how the body compiles.

The H200 measured the layer's ewise tasks at ~3 GB/s a program (199 ms busy over 132 programs
for ~0.7 GB; benchmarks/results/v11/bench_layer_kinds.json). Every one of them takes the fast
path (the first test); its loop loaded one 16 x 128 block ahead, one 16-byte vector a thread
an operand, and the copy that carried those loads to the next iteration waited for them at
the loop's head, before that iteration's loads went out: one memory round trip a block, 8 KiB
a program in flight for SwiGLU. A batch loads operands 0 and 1 of 8 blocks (16 slots, 64 KiB a
program) before the bytecode runs over any; the AOT test fails on the old form (8 loads an
iteration, a copy of a load's result at the loop's head) and on local memory.

- CPU: the layer's tasks and the body's gate, mirrored on the host (test_rope_fusion._fast,
  plus the gather map's gate of _gather_src).
- TRITON_INTERPRET=1 (this file as a subprocess): chains over tiles of several batches, the
  last one partial, of one (unary), two (SwiGLU) and three operands with a rotation.
- sm_90 ahead of time (Triton 3.6 on the GPU: ``PYTHONPATH=/tmp/tr36site`` runs it here).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mgraph as mg
from helpers import check_interpreter_cases, rel_err, row_vec

BF16, F32 = torch.bfloat16, torch.float32
ROOT = Path(__file__).resolve().parents[1]


# -- which path the layer's tasks take -----------------------------------------------------------
def _vec(dtype: torch.dtype) -> int:
    return 16 // torch.empty((), dtype=dtype).element_size()


def _gather_vec(p: dict, dtype: torch.dtype) -> bool:
    """_gather_src's gate: a stride-1 innermost column run of whole vectors, the base and every
    other stride multiples of them (the buffers' 256-byte alignment and int32 spans hold)."""
    from mgraph.ops.relayout import DIGITS

    words = [p["g_base"], p["g_c0n"], *(p[f"g_r{k}s"] for k in range(DIGITS))]
    words += [p[f"g_c{k}s"] for k in range(1, DIGITS)]
    return p["g_c0s"] == 1 and all(w % _vec(dtype) == 0 for w in words)


def ewise_path(graph, task, dtype: torch.dtype) -> str:
    """ewise_tile's choice on the host: "vec" (_ewise_vec) or "general"."""
    from mgraph.ops.elementwise import GATHER

    maps = task.params.get("maps", 0)
    ok = row_vec(graph, task.writes[0], dtype) and task.params.get("half", 0) % _vec(dtype) == 0
    for k, region in enumerate(task.reads):
        if (maps >> (2 * k)) & 3 == GATHER:
            ok = ok and _gather_vec(task.params, dtype)
        else:
            ok = ok and row_vec(graph, region, dtype)
    return "vec" if ok else "general"


def test_llama_layer_ewise_tasks_take_the_fast_path():
    """bench_layer.py's layer at head dim 128, as on the H200 (smaller hidden,
    FFN and sequence: the same chains and the same alignments): RoPE's chains (a gather
    operand, two broadcast ones, a rotation), SwiGLU and the residual adds all take _ewise_vec;
    the batch's operands 0 and 1 are SwiGLU's and the adds' two, RoPE's x and cos."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_layer", ROOT / "benchmarks/bench_layer.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)  # type: ignore[union-attr]
    args = type("Args", (), dict(hidden=512, heads=4, kv_heads=1, ffn=1792, seq=256, batch=1,
                                 dtype=BF16))
    layer = bench.build_layer(args, torch.device("cpu"))
    x = torch.randn(1, 256, 512, dtype=BF16)
    prog = mg.compile(layer, (x,), plan=bench.mgraph_plan(), topology="1x1")
    ew = [t for t in prog.graph.tasks if t.kind == "ewise"]
    paths = {}
    for t in ew:
        chain = "rope" if t.params.get("half") else f"{t.params['nops']} ops"
        key = (chain, ewise_path(prog.graph, t, BF16), len(t.reads), t.writes[0].row1 - t.writes[0].row0)
        paths[key] = paths.get(key, 0) + 1
    # per rank of 256 tokens (row tiles: elementwise.traced_tile_rows): q's 4 heads x 256
    # rows in 2 tiles of 512, k's one head in one of 256; the two residual adds (512 columns)
    # in tiles of 128 rows; SwiGLU (1792 columns) in tiles of 32
    assert paths == {
        ("rope", "vec", 3, 512): 2,  # x * cos + rotate_half(x) * sin: 7 instructions
        ("rope", "vec", 3, 256): 1,
        ("3 ops", "vec", 2, 128): 4,  # the residual adds: LOAD, LOAD, add
        ("4 ops", "vec", 2, 32): 8,  # SwiGLU: LOAD, silu, LOAD, mul
    }, paths
    assert all(ewise_path(prog.graph, t, BF16) == "vec" for t in ew)


# -- the batches under the interpreter -----------------------------------------------------------
# rows 150 in one tile (10 block rows, the last one of 6 rows), 272 columns (two 128-column
# blocks and a masked one): 30 blocks a tile, batches of 8 in bf16 (8, 8, 8, 6), of 4 in fp32,
# straddling block rows
CHAINS = {
    "unary": ([["silu", 0, -1, 0.0]], []),
    "swiglu": ([["silu", 0, -1, 0.0], ["mul", 2, 1, 0.0]], ["full"]),
    "rope3": ([["mul", 0, 1, 0.0], ["rotate_half", 0, -1, 0.0], ["mul", 4, 2, 0.0],
               ["add", 3, 5, 0.0]], ["row", "full"]),
}
# (rows, cols, tile_rows): several batches a tile; and "wide" tiles of at most half a batch
# (2 blocks and 1: RoPE's 64 x 128 tiles in bf16 are 4), whose upper slots hold operand 2 and
# operand 0 rotated
SHAPES = {"": (150, 272, 150), "-wide": (48, 128, 32)}
CASES = {"unary": "", "swiglu": "", "rope3": "", "rope3-wide": "-wide"}
INTERP_CASES = {f"{name}-{dt}": True for name in CASES for dt in ("float32", "bfloat16")}


def test_ewise_batches_in_the_megakernel():
    pytest.importorskip("triton")
    check_interpreter_cases("test_ewise_batches.py", INTERP_CASES)


def interp_row(case: str, graph, got: dict, want: dict, dtype: torch.dtype, **extra) -> None:
    """One interpreter case's JSON row (check_interpreter_cases reads it)."""
    import json

    err = max(rel_err(got[k].float(), want[k].float()) for k in want)
    ew = [t for t in graph.tasks if t.kind == "ewise"]
    fast = sum(ewise_path(graph, t, dtype) == "vec" for t in ew)
    print(json.dumps({"case": case, "dtype": str(dtype).removeprefix("torch."), "error": err,
                      "fast": fast, "tasks": len(ew), **extra}), flush=True)


def run_cases(settings, seed: int, **extra) -> None:
    """CASES' chains in fp32 and bf16, run by the megakernel under the interpreter with
    ``settings`` and on the reference runtime: a JSON row each (interp_row)."""
    from mgraph.runtime.megakernel import TritonRuntime

    for name, shape in CASES.items():
        chain, operands = CHAINS[name.removesuffix(shape)]
        rows, cols, tile_rows = SHAPES[shape]
        for dt in (F32, BF16):
            g = mg.ops.elementwise(topology="1x1", rows=rows, cols=cols, chain=chain,
                                   operands=operands, tile_rows=tile_rows, dtype=dt)
            gen = torch.Generator().manual_seed(seed)
            inputs = {n: torch.randn(s.shape, generator=gen).to(dt) for n, s in g.inputs.items()}
            sched = mg.schedule(g)
            want = mg.run(sched, inputs).outputs
            got = TritonRuntime(sched, interpret=True, settings=settings).run(inputs).outputs
            interp_row(f"{name}-{str(dt).removeprefix('torch.')}", g, got, want, dt, **extra)


def _interp_main() -> None:
    from mgraph.settings import Settings

    # the bytecode interpreter's batches: no chain gets generated code (test_ewise_special.py)
    run_cases(Settings(ewise_chains=0), 31)


# -- ahead of time, sm_90 --------------------------------------------------------------------------
def _sass(dtype_name: str, tmp_path: Path) -> list[tuple[int, str]]:
    """The ewise body alone in a kernel (test_memory_bodies._ewise_kernel: 8 warps, as in the
    megakernel) compiled for sm_90: its SASS as (address, instruction)."""
    triton = pytest.importorskip("triton")
    nvidia = pytest.importorskip("triton.backends.nvidia")
    import triton.language as tl
    from test_memory_bodies import SIGNATURE, _ewise_kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    compiled = triton.compile(
        ASTSource(_ewise_kernel, SIGNATURE, {"DT": getattr(tl, dtype_name), "RB_M": 64,
                                             "RB_N": 256}),
        target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    cubin = tmp_path / "ewise.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    return [(int(m.group(1), 16), m.group(2))
            for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", sass)]


def _loops(ins: list[tuple[int, str]]) -> list[tuple[int, int]]:
    """(head, last) of each loop: the target of a backward branch, the branch."""
    out = []
    for addr, text in ins:
        back = re.match(r"(?:@!?U?P\w+\s+)?BRA\s+(?:`\()?0x([0-9a-f]+)", text)
        if back and int(back.group(1), 16) < addr:
            out.append((int(back.group(1), 16), addr))
    return out


def _regs(text: str) -> list[str]:
    return re.findall(r"\bR(\d+)\b", text)


@pytest.mark.parametrize("dtype,slots", [("bfloat16", 16), ("float32", 8)])
def test_ewise_batch_loads_are_in_flight_together(dtype, slots, tmp_path):
    """The batch loop (the loop around the block loop that stores): per iteration, 2 x SUB
    blocks of 16-byte vectors (each through a row map or a gather map: two load sites),
    into distinct registers, none of them read between the loop's head and its first load
    (the old loop's head copied the previous iteration's loads: a wait); no local memory."""
    ins = _sass(dtype, tmp_path)
    local = [t for _a, t in ins if re.match(r"(?:@!?U?P\w+\s+)?(LDL|STL)", t)]
    assert not local, local[:5]
    loops = _loops(ins)
    store = next(a for a, t in ins if "STG.E.128" in t)
    block = min((lp for lp in loops if lp[0] <= store <= lp[1]), key=lambda lp: lp[1] - lp[0])
    batch = min((lp for lp in loops if lp[0] < block[0] and block[1] <= lp[1]),
                key=lambda lp: lp[1] - lp[0])
    head = [(a, t) for a, t in ins if batch[0] <= a < block[0]]
    loads = [(a, t) for a, t in head if "LDG.E.128" in t]
    vectors = 1 if dtype == "bfloat16" else 2  # 16-byte vectors a thread a 16 x 128 block
    # two load sites a block: through a row map or through a gather map
    assert len(loads) == 2 * slots * vectors, (len(loads), loads[:4])
    dests = {int(_regs(t.split("LDG.E.128", 1)[1])[0]) for _a, t in loads}
    assert len(dests) >= slots * vectors, sorted(dests)
    # the old form: copies of the previous iteration's loads at the head (waits for them)
    loaded = {str(r + k) for r in dests for k in range(4)}
    defined: set[str] = set()
    carried = []
    for a, t in head:
        if a >= loads[0][0]:
            break
        op, *regs = _regs_of(t)
        if re.match(r"(IMAD\.MOV|MOV)\b", op) and set(regs[1:]) & (loaded - defined):
            carried.append(t)
        defined.update(regs[:1])
    assert not carried, carried[:5]


def _regs_of(text: str) -> list[str]:
    """(opcode, registers in order: the destination first) of a SASS instruction."""
    body = re.sub(r"^@!?U?P\w+\s+", "", text)
    op, _, rest = body.partition(" ")
    return [op, *_regs(rest)]

if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before triton"
    torch.set_num_threads(1)
    sys.exit(_interp_main())
