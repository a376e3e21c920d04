"""Runs under TRITON_INTERPRET=1 in a subprocess (see test_memory_bodies.py): the memory-bound
tile bodies' two paths each, the vectorised fast path and the general one, on graphs chosen to
take one or the other (odd widths, unaligned slices, transposed columns), compared with the
reference runtime on the same graph (random inputs, never zeros). Prints one JSON line per case:
{"case", "dtype", "error", "fast", "tasks"}: how many of the graph's tasks the fast path's gate
(mirrored here on the host) admits."""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"

import torch  # noqa: E402

import mgraph as mg  # noqa: E402
from helpers import row_vec  # noqa: E402 - tilewise.row_operand's gate on the host
from mgraph.graph import torch_dtype  # noqa: E402
from mgraph.ops.relayout import DIGITS  # noqa: E402
from mgraph.runtime.megakernel import TritonRuntime  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32


def vec(dtype: torch.dtype) -> int:
    return 16 // torch.empty((), dtype=dtype).element_size()


def relayout_fast(graph, task, dtype: torch.dtype) -> bool:
    """relayout_tile's gate, on the host: a stride-1 innermost column run and every other
    stride, the base, the output pitch, corner and width multiples of 16 bytes (the buffers'
    bases are 256-byte aligned and small here)."""
    p, out = task.params, task.writes[0]
    words = [p["base"], p["c0n"], graph.buffers[out.buffer].cols, out.col0, out.col1 - out.col0]
    words += [p[f"r{k}s"] for k in range(DIGITS)] + [p[f"c{k}s"] for k in range(1, DIGITS)]
    return p["c0s"] == 1 and all(w % vec(dtype) == 0 for w in words)


def compare(case: str, graph, fast_of, seed: int = 0, inputs: dict | None = None) -> None:
    if inputs is None:
        gen = torch.Generator().manual_seed(seed)
        inputs = {name: torch.randn(spec.shape, generator=gen).to(torch_dtype(spec.dtype))
                  for name, spec in graph.inputs.items()}
    dtype = next(iter(inputs.values())).dtype
    sched = mg.schedule(graph)
    want = mg.run(sched, inputs).outputs
    got = TritonRuntime(sched, interpret=True).run(inputs).outputs
    err = max(((got[k].float() - want[k].float()).norm() / want[k].float().norm()).item()
              for k in want)
    fast = sum(bool(fast_of(graph, t, dtype)) for t in graph.tasks)
    print(json.dumps({"case": f"{case}-{str(dtype).removeprefix('torch.')}",
                      "dtype": str(dtype).removeprefix("torch."), "error": err,
                      "fast": fast, "tasks": len(graph.tasks)}), flush=True)


def relayout_cases() -> None:
    B, S, H = 2, 8, 4
    chains = {
        # fast: head dims of whole 16-byte runs; the merge is wider than RB_N / 2 (the other
        # block shape); repeat_kv's expand (stride-0 digits)
        "split-heads-d16": ([B, S, H * 16], [["view", [B, S, H, 16]], ["permute", [0, 2, 1, 3]]]),
        "merge-heads-d40": ([B, H, S, 40], [["permute", [0, 2, 1, 3]], ["view", [B, S, H * 40]]]),
        "repeat-kv-d16": ([B, 2, S, 16], [["view", [B, 2, 1, S, 16]], ["expand", [B, 2, 3, S, 16]],
                                          ["view", [B, 6, S, 16]]]),
        # general: a head of 6 elements, a slice starting off a 16-byte boundary, a transpose
        # of the last two dims (column stride > 1)
        "split-heads-d6": ([B, S, H * 6], [["view", [B, S, H, 6]], ["permute", [0, 2, 1, 3]]]),
        "slice-unaligned": ([B, S, 64], [["slice", [2, 3, 43, 1]]]),
        "transpose-last": ([B, S, 24], [["permute", [0, 2, 1]]]),
    }
    for dt in (F32, BF16):
        for name, (shape, steps) in chains.items():
            rows = 1
            for n in shape[:-1]:
                rows *= n
            g = mg.ops.relayout(topology="1x1", rows=rows, cols=shape[-1], in_shape=shape,
                                steps=steps, tile_rows=8, dtype=dt)
            assert all("base" in t.params for t in g.tasks), name  # every tile's map fits
            compare(f"relayout-{name}", g, relayout_fast, seed=21)


def rows_fast(graph, task, dtype: torch.dtype) -> bool:
    """The row bodies' gate: every read and the write admit 16-byte vectors."""
    return all(row_vec(graph, r, dtype) for r in (*task.reads, *task.writes))


# 328 columns: one whole RB_N block and a masked one, 16-byte rows in both dtypes; 102: rows
# that are not (the general path), tiles of 24 rows (a masked row block)
WIDTHS = {"vec": 328, "odd": 102}


def rms_norm_cases() -> None:
    for dt in (F32, BF16):
        # vec, vecwide (1096): whole rows in registers (_rms_rows); vecwider: rows past its
        # 4096 bf16 / 2048 fp32 columns (_rms_vec: four of its 1024-column blocks and a masked
        # one, its next-block loads crossing column blocks)
        for name, cols in (*WIDTHS.items(), ("vecwide", 1096), ("vecwider", 4112)):
            for w in (True, False):
                g = mg.ops.rms_norm(topology="1x1", rows=40, cols=cols, tile_rows=24, dtype=dt,
                                    eps=1e-5, has_weight=w)
                compare(f"rms_norm-{name}-w{int(w)}", g, rows_fast, seed=22)


def row_op_cases() -> None:
    """layer_norm, softmax and row_reduce on the general path (odd widths); their 16-byte rows
    (the fast path) are megakernel_bodies_interp.py's row cases: every weight and bias
    combination and every reduction at 328 columns."""
    for dt in (F32, BF16):
        for name, cols in (("odd", WIDTHS["odd"]),):
            for w, b in ((True, True), (False, True)):
                g = mg.ops.layer_norm(topology="1x1", rows=40, cols=cols, tile_rows=24, dtype=dt,
                                      has_weight=w, has_bias=b)
                x = mg.ops.layer_norm.random_inputs(g, seed=27)
                x["x"] = (x["x"].float() * 3 + 2).to(dt)  # a mean and a spread far from 0, 1
                compare(f"layer_norm-{name}-w{int(w)}b{int(b)}", g, rows_fast, inputs=x)
            g = mg.ops.softmax(topology="1x1", rows=40, cols=cols, tile_rows=24, dtype=dt)
            x = mg.ops.softmax.random_inputs(g, seed=28)
            x["x"] = (x["x"].float() * 4).to(dt)  # spread the logits: the running max matters
            compare(f"softmax-{name}", g, rows_fast, inputs=x)
            for fn in ("mean", "amax"):
                g = mg.ops.row_reduce(topology="1x1", rows=40, cols=cols, tile_rows=24, dtype=dt,
                                      fn=fn)
                compare(f"row_reduce-{name}-{fn}", g, reduce_fast, seed=29)


def reduce_fast(graph, task, dtype: torch.dtype) -> bool:
    """row_reduce's gate: x alone (its output is one column, stored element by element)."""
    return row_vec(graph, task.reads[0], dtype)


def ewise_cases() -> None:
    """Chains of 2, 4 (RoPE's x * cos + rot(x) * sin) and 6 inputs (operands 0 and 1 are read
    for a batch of blocks before its bytecode runs, later ones at their LOAD), full and row
    operands, tasks of several row
    blocks and of several column blocks (264: the last one masked); the general path for odd
    widths and a column operand."""
    ew = mg.ops.elementwise
    rope = [["mul", 0, 1, 0.0], ["mul", 2, 3, 0.0], ["add", 4, 5, 0.0]]
    six = [["mul", 0, 1, 0.0], ["mul", 2, 3, 0.0], ["add", 6, 7, 0.0], ["mul", 4, 5, 0.0],
           ["sub", 8, 9, 0.0], ["silu", 10, -1, 0.0]]
    for dt in (F32, BF16):
        for name, cols in (("vec", 80), ("vec-wide", 264), ("odd", 78)):
            if name != "odd":  # (the six-input chain covers the general path)
                g = ew(topology="1x1", rows=40, cols=cols, chain=rope,
                       operands=["full", "full", "full"], tile_rows=24, dtype=dt)
                compare(f"ewise-rope-{name}", g, rows_fast, seed=23)
            g = ew(topology="1x1", rows=40, cols=cols, chain=six,
                   operands=["row", "full", "full", "full", "row"], tile_rows=24, dtype=dt)
            compare(f"ewise-six-{name}", g, rows_fast, seed=24)
        g = ew(topology="1x1", rows=40, cols=80, fn="sub", other="col", tile_rows=24, dtype=dt)
        compare("ewise-col-odd", g, rows_fast, seed=25)


def concat_cases() -> None:
    """[x | y]: RoPE's halves (narrow: the tall blocks), wide operands (a masked RB_N block),
    and an x of odd width (y's destination column off a 16-byte boundary: the general path)."""
    for dt in (F32, BF16):
        for name, cols, cols_y in (("vec-narrow", 16, 32), ("vec-wide", 264, 40),
                                   ("odd", 20, 6)):
            g = mg.ops.concat(topology="1x1", rows=40, cols=cols, cols_y=cols_y, tile_rows=24,
                              dtype=dt)
            compare(f"concat-{name}", g, rows_fast, seed=26)


CASES = {"relayout": relayout_cases, "rms_norm": rms_norm_cases, "ewise": ewise_cases,
         "concat": concat_cases, "row_ops": row_op_cases}

if __name__ == "__main__":
    import sys

    torch.set_num_threads(1)
    for name in sys.argv[1:] or list(CASES):
        CASES[name]()
