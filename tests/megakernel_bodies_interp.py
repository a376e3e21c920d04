"""Runs under TRITON_INTERPRET=1 in a subprocess (see test_triton_bodies.py): the Triton tile
bodies of the tracer's kinds, each run by the megakernel on a 1x1 graph built by its op's own
builder and compared with the reference runtime on the same graph (random inputs, never zeros).
Prints one JSON line per case: {"case", "kind", "dtype", "error"}."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"

import torch  # noqa: E402

import mgraph as mg  # noqa: E402
from mgraph.runtime.megakernel import TritonRuntime  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32


def _positive(x: torch.Tensor) -> torch.Tensor:
    return x.float().abs().add(0.25).to(x.dtype)  # log/sqrt/rsqrt/pow: a domain without NaN


def compare(case: str, graph, inputs: dict | None = None, seed: int = 0):
    """Run ``graph`` in the megakernel (interpreter) and on the reference runtime; print the
    relative error of every output against the reference's."""
    if inputs is None:  # every global input, weights included: random, never zeros
        from mgraph.graph import torch_dtype

        gen = torch.Generator().manual_seed(seed)
        inputs = {name: torch.randn(spec.shape, generator=gen).to(torch_dtype(spec.dtype))
                  for name, spec in graph.inputs.items()}
    sched = mg.schedule(graph)
    want = mg.run(sched, inputs).outputs
    rt = TritonRuntime(sched, interpret=True)
    got = rt.run(inputs).outputs
    err = max(((got[k].float() - want[k].float()).norm() / want[k].float().norm()).item()
              for k in want)
    kinds = sorted({t.kind for t in graph.tasks})
    dtype = str(next(iter(graph.buffers.values())).dtype)
    print(json.dumps({"case": case, "kinds": kinds, "dtype": dtype, "error": err}), flush=True)


def ewise_cases() -> None:
    """Every elementwise fn, each operand form (tensor, row vector, column, scalar), fp32 and
    bf16; tiles of 24 rows and 80 columns exercise the masked edges of the RB blocks."""
    from mgraph.ops.elementwise import BINARY, UNARY

    ew = mg.ops.elementwise
    for dt in (F32, BF16):
        for fn in UNARY:
            g = ew(topology="1x1", rows=40, cols=80, fn=fn, dtype=dt, tile_rows=24)
            inputs = ew.random_inputs(g, seed=1)
            if fn in ("log", "sqrt", "rsqrt"):
                inputs = {k: _positive(v) for k, v in inputs.items()}
            compare(f"ewise-{fn}-{dt}", g, inputs)
        for fn in BINARY:
            for form, extra in (("full", {"other": "full"}), ("row", {"other": "row"}),
                                ("scalar", {"scalar": 1.75}), ("swap", {"scalar": 0.5, "swap": True}),
                                ("alpha", {"other": "full", "alpha": -0.5})):
                g = ew(topology="1x1", rows=40, cols=80, fn=fn, dtype=dt, tile_rows=24, **extra)
                inputs = ew.random_inputs(g, seed=2)
                if fn == "pow":  # a positive base; an exponent with fractions and signs
                    inputs["x"] = _positive(inputs["x"])
                if fn == "div" and "y" in inputs:
                    inputs["y"] = _positive(inputs["y"])
                compare(f"ewise-{fn}-{form}-{dt}", g, inputs)
    # a column operand ([rows, 1]: one value per row) has 4-byte rows (see _without_row_check)
    for dt in (F32, BF16):
        g = ew(topology="1x1", rows=40, cols=80, fn="mul", other="col", dtype=dt, tile_rows=24)
        compare(f"ewise-mul-col-{dt}", g, seed=3)


# Rows of 328 columns: two RB_N=256 blocks, the second one masked; 16-byte rows in fp32 and bf16.
ROW = dict(topology="1x1", rows=40, cols=328, tile_rows=24)


def row_cases() -> None:
    """Norms, softmax and row reductions: whole rows over several column blocks."""
    for dt in (F32, BF16):
        for w in (True, False):
            g = mg.ops.rms_norm(**ROW, dtype=dt, eps=1e-5, has_weight=w)
            compare(f"rms_norm-w{int(w)}-{dt}", g, seed=4)
        for w, b in ((True, True), (True, False), (False, True), (False, False)):
            g = mg.ops.layer_norm(**ROW, dtype=dt, has_weight=w, has_bias=b)
            x = mg.ops.layer_norm.random_inputs(g, seed=5)
            x["x"] = (x["x"].float() * 3 + 2).to(dt)  # a mean and a spread far from 0 and 1
            compare(f"layer_norm-w{int(w)}b{int(b)}-{dt}", g, x)
        g = mg.ops.softmax(**ROW, dtype=dt)
        x = mg.ops.softmax.random_inputs(g, seed=6)
        x["x"] = (x["x"].float() * 4).to(dt)  # spread the logits: the running max matters
        compare(f"softmax-{dt}", g, x)
        for fn in ("mean", "sum", "amax", "amin"):
            g = mg.ops.row_reduce(**ROW, dtype=dt, fn=fn)
            compare(f"row_reduce-{fn}-{dt}", g, seed=7)


def relayout_cases() -> None:
    """The tracer's relayout chains: head split + transpose, the merge back, repeat_kv's
    expand, slices (a step, a last-dim prefix); tiles smaller than the buffer (tile_rows)."""
    B, S, H, D = 2, 16, 4, 16
    chains = {
        "split-heads": ([B, S, H * D], [["view", [B, S, H, D]], ["permute", [0, 2, 1, 3]]]),
        "merge-heads": ([B, H, S, D], [["permute", [0, 2, 1, 3]], ["view", [B, S, H * D]]]),
        "repeat-kv": ([B, 2, S, D], [["view", [B, 2, 1, S, D]], ["expand", [B, 2, 3, S, D]],
                                     ["view", [B, 6, S, D]]]),
        "slice": ([B, S, 4 * D], [["slice", [1, 1, S, 2]], ["slice", [2, 8, 40, 1]]]),
    }
    for dt in (F32, BF16):
        for name, (shape, steps) in chains.items():
            rows = 1
            for n in shape[:-1]:
                rows *= n
            g = mg.ops.relayout(topology="1x1", rows=rows, cols=shape[-1], in_shape=shape,
                                steps=steps, tile_rows=16, dtype=dt)
            assert all("base" in t.params for t in g.tasks), name  # every tile's map fits
            compare(f"relayout-{name}-{dt}", g, seed=13)


def concat_cases() -> None:
    """[x | y] with x wider than one RB_N block, y narrower (masked edges in both)."""
    for dt in (F32, BF16):
        g = mg.ops.concat(topology="1x1", rows=40, cols=264, cols_y=40, tile_rows=24, dtype=dt)
        compare(f"concat-{dt}", g, seed=8)
        g = mg.ops.concat(topology="1x1", rows=2 * 3 * 8, cols=16, cols_y=32, shape=[2, 3, 8, 16],
                          dtype=dt)
        compare(f"concat-nd-{dt}", g, seed=9)


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mgraph.ops.abi import F_READ0, F_WRITE0, load_region, param_f32, param_i32  # noqa: E402
from mgraph.ops.tilewise import tile_ptrs  # noqa: E402

_READ0, _WRITE0 = tl.constexpr(F_READ0), tl.constexpr(F_WRITE0)


@triton.jit
def gated_tile(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr, RB_M: tl.constexpr,
               RB_N: tl.constexpr):
    """out = silu(x) * y * weight * scale + shift: reads x, y (full), weight (a row); params
    scale (float) and shift (int), in the reference's signature order."""
    r0 = tl.load(tp + _READ0)
    w0 = tl.load(tp + _WRITE0)
    scale = param_f32(params, tp, 0)
    shift = param_i32(params, tp, 1).to(tl.float32)
    _s, m0, m1, n0, n1 = load_region(regions, r0)
    for i in range(0, m1 - m0, RB_M):
        for j in range(0, n1 - n0, RB_N):
            om = i + tl.arange(0, RB_M)
            on = j + tl.arange(0, RB_N)
            mask = (om < m1 - m0)[:, None] & (on < n1 - n0)[None, :]
            x = tl.load(tile_ptrs(regions, bufaddr, bufcols, r0, om, on, DT), mask=mask).to(tl.float32)
            y = tl.load(tile_ptrs(regions, bufaddr, bufcols, r0 + 1, om, on, DT), mask=mask).to(tl.float32)
            w = tl.load(tile_ptrs(regions, bufaddr, bufcols, r0 + 2, om, on, DT), mask=mask).to(tl.float32)
            out = x / (1.0 + tl.exp(-x)) * y * w * scale + shift
            tl.store(tile_ptrs(regions, bufaddr, bufcols, w0, om, on, DT), out.to(DT), mask=mask)


def custom_cases() -> None:
    """A register_op op with triton=: its body runs in the megakernel (its kind's params are the
    float and int scalars), through the op's own builder and through a traced module."""
    import torch.nn.functional as F

    @mg.register_op("gated_test", triton=gated_tile, whole_rows=False, tile_rows=16)
    def gated(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, scale: float = 0.5,
              shift: int = 1) -> torch.Tensor:
        return F.silu(x) * y * weight * scale + shift

    for dt in (F32, BF16):
        g = gated.opdef(topology="1x1", rows=40, cols=264, forms={"weight": "row"},
                        scalars={"scale": 1.5, "shift": -2}, dtype=dt)
        compare(f"custom-builder-{dt}", g, seed=10)

    class Gate(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.rand(64) + 0.5)

        def forward(self, x, y):
            return gated(x, y, self.w, 0.25)  # shift left at its default

    prog = mg.compile(Gate().eval(), (torch.randn(2, 16, 64), torch.randn(2, 16, 64)),
                      topology="1x1")
    assert {t.kind for t in prog.graph.tasks} == {"gated_test"}, prog.graph.tasks
    compare("custom-traced-float32", prog.graph, seed=11)


def traced_mlp() -> None:
    """examples/tp_mlp.py's Llama MLP, traced on 1x1: gate/up/down GEMMs, silu and the product
    (ewise) all run in the megakernel; checked against the reference runtime and eager torch."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    from tp_mlp import PLAN, LlamaMLP

    torch.manual_seed(0)
    # hidden 256, ffn 512: every GEMM gets 64 x 256 tiles. runtime.py refuses GEMM tiles of
    # several shapes in one graph (BM/BN are kernel constexprs), which the example's
    # hidden=128, ffn=256 would give (64 x 128 and 64 x 256).
    model = LlamaMLP(hidden=256, ffn=512).eval()
    x = torch.randn(2, 32, 256)
    prog = mg.compile(model, (x,), plan=PLAN, topology="1x1")
    kinds = {t.kind for t in prog.graph.tasks}
    assert {"gemm", "ewise"} <= kinds <= {"gemm", "ewise", "reduce", "copy"}, kinds
    compare("mlp-traced-float32", prog.graph, seed=12)
    # the megakernel's output against eager torch, the weights bound as the Program binds them
    rt = TritonRuntime(mg.schedule(prog.graph), interpret=True)
    got = rt.run(prog.inputs(x)).outputs[prog.opgraph.output_names[0]]
    with torch.no_grad():
        want = model(x)
    err = ((got.reshape(want.shape) - want).norm() / want.norm()).item()
    print(json.dumps({"case": "mlp-eager-float32", "kinds": sorted(kinds), "dtype": "float32",
                      "error": err}), flush=True)

CASES = {"ewise": ewise_cases, "rows": row_cases, "concat": concat_cases, "relayout": relayout_cases,
         "custom": custom_cases, "mlp": traced_mlp}

if __name__ == "__main__":
    torch.set_num_threads(1)
    for name in sys.argv[1:] or list(CASES):
        CASES[name]()
