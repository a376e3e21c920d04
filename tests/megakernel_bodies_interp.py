"""Runs under TRITON_INTERPRET=1 in a subprocess (see test_triton_bodies.py): the Triton tile
bodies of the tracer's kinds, each run by the megakernel on a 1x1 graph built by its op's own
builder and compared with the reference runtime on the same graph (random inputs, never zeros).
Prints one JSON line per case: {"case", "kind", "dtype", "error"}."""

from __future__ import annotations

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"

import torch  # noqa: E402

import mgraph as mg  # noqa: E402
from mgraph.runtime.megakernel import TritonRuntime  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32


def _positive(x: torch.Tensor) -> torch.Tensor:
    return x.float().abs().add(0.25).to(x.dtype)  # log/sqrt/rsqrt/pow: a domain without NaN


def compare(case: str, graph, inputs: dict | None = None, seed: int = 0, lift_row_check=False):
    """Run ``graph`` in the megakernel (interpreter) and on the reference runtime; print the
    relative error of every output against the reference's."""
    op = mg.ops.get_op(graph.op) if graph.op in mg.ops.op_names() else None
    if inputs is None:
        inputs = op.random_inputs(graph, seed=seed)
    sched = mg.schedule(graph)
    want = mg.run(sched, inputs).outputs
    if lift_row_check:
        rt = _without_row_check(sched)
    else:
        rt = TritonRuntime(sched, interpret=True)
    got = rt.run(inputs).outputs
    err = max(((got[k].float() - want[k].float()).norm() / want[k].float().norm()).item()
              for k in want)
    kinds = sorted({t.kind for t in graph.tasks})
    dtype = str(next(iter(graph.buffers.values())).dtype)
    print(json.dumps({"case": case, "kinds": kinds, "dtype": dtype, "error": err}), flush=True)


def _without_row_check(sched):
    """TritonRuntime with runtime.py's 16-byte row rule lifted (its other checks kept): the
    rule is for TMA, which only the GEMM path uses; a [rows, 1] buffer (a row reduction's
    output, a per-row operand) has 4-byte rows. The bodies store such buffers with plain
    pointer stores, which these cases prove; the runtime keeps refusing the graphs until
    _check_graph limits the rule to buffers a GEMM reads or writes."""
    from mgraph.errors import ScheduleError

    check = TritonRuntime._check_graph

    def lifted(graph):
        try:
            check(graph)
        except ScheduleError as exc:
            if "16 bytes" not in str(exc):
                raise

    TritonRuntime._check_graph = staticmethod(lifted)
    try:
        return TritonRuntime(sched, interpret=True)
    finally:
        TritonRuntime._check_graph = staticmethod(check)


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
        compare(f"ewise-mul-col-{dt}", g, seed=3, lift_row_check=True)


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
            compare(f"row_reduce-{fn}-{dt}", g, seed=7, lift_row_check=True)


CASES = {"ewise": ewise_cases, "rows": row_cases}

if __name__ == "__main__":
    torch.set_num_threads(1)
    for name in sys.argv[1:] or list(CASES):
        CASES[name]()
