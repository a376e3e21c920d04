"""Runs under TRITON_INTERPRET=1 in a subprocess (see test_copy_body.py): the copy kind's body
(tiles.copy_tile, what every NVLink copy runs) on one graph whose copies take its 16-byte path,
its element-by-element path, and both within one task (two destinations), and the reduce
kind's (tiles.reduce_tile) on sums that take either path, in bfloat16 and float32, compared
with the reference runtime (random inputs, never zeros). Prints one JSON line per case:
{"case", "error", "fast", "pairs"} (and "exact" for the copies), ``fast`` counting the (task, destination) pairs
(copy) or tasks (reduce) that tilewise.row_operand's gate, mirrored on the host by
helpers.row_vec, admits."""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"

import torch  # noqa: E402

import mgraph as mg  # noqa: E402
from helpers import row_vec  # noqa: E402
from mgraph.builder import GraphBuilder, piece  # noqa: E402
from mgraph.graph import torch_dtype  # noqa: E402
from mgraph.kinds import Role  # noqa: E402
from mgraph.runtime.megakernel import TritonRuntime  # noqa: E402
from mgraph.topology import Topology  # noqa: E402

R, C = 80, 136  # 136 columns: 16-byte rows in both dtypes; out3's 17 are not


def build(dtype: str):
    b = GraphBuilder("copies", Topology.parse("1x1"), dtype, {})
    b.global_input("x", (R, C))
    shapes = {"out": (R, C), "out2": (R, C), "out3": (R, 17), "out4": (R, 8)}
    for name, shape in shapes.items():
        b.global_output(name, shape)
    x = b.bound_buffer("x", 0, "x", [piece((R, C))])
    out = {n: b.bound_buffer(n, 0, n, [piece(s)], role="output") for n, s in shapes.items()}
    copies = [  # (source rows, cols), [(destination, rows, cols)]
        (((0, 40), (0, C)), [("out", (0, 40), (0, C)), ("out2", (0, 40), (0, C))]),
        (((40, 80), (0, 3)), [("out", (40, 80), (0, 3)), ("out2", (40, 80), (0, 3))]),
        (((40, 80), (3, C)), [("out", (40, 80), (3, C)), ("out2", (40, 80), (3, C))]),
        (((0, 80), (0, 8)), [("out4", (0, 80), (0, 8)), ("out3", (0, 80), (0, 8))]),
        (((0, 80), (8, 17)), [("out3", (0, 80), (8, 17))]),
    ]
    for i, ((rows, cols), dsts) in enumerate(copies):
        b.task(0, Role.COMPUTE, "copy", [x.region(rows, cols)],
               [out[n].region(r, c) for n, r, c in dsts], name=f"copy {i}")
    return b.finish()


def build_reduce(dtype: str):
    """out = x + y + z by row blocks: 16-byte rows (fast), a block of 3 columns and one from
    column 3 on (element by element), each sum also stored into out2 (a second write)."""
    b = GraphBuilder("sums", Topology.parse("1x1"), dtype, {})
    for name in ("x", "y", "z"):
        b.global_input(name, (R, C))
    for name in ("out", "out2"):
        b.global_output(name, (R, C))
    src = [b.bound_buffer(n, 0, n, [piece((R, C))]) for n in ("x", "y", "z")]
    out = [b.bound_buffer(n, 0, n, [piece((R, C))], role="output") for n in ("out", "out2")]
    for i, (rows, cols) in enumerate((((0, 40), (0, C)), ((40, 80), (0, 3)), ((40, 80), (3, C)))):
        b.task(0, Role.COMPUTE, "reduce", [s.region(rows, cols) for s in src],
               [o.region(rows, cols) for o in out], name=f"sum {i}")
    return b.finish()


def run(graph, inputs):
    graph.validate()
    sched = mg.schedule(graph)
    return mg.run(sched, inputs).outputs, TritonRuntime(sched, interpret=True).run(inputs).outputs


def main() -> None:
    for dtype in ("bfloat16", "float32"):
        graph = build(dtype)
        gen = torch.Generator().manual_seed(31)
        inputs = {"x": torch.randn(R, C, generator=gen).to(torch_dtype(dtype))}
        want, got = run(graph, inputs)
        error = max((got[k].float() - want[k].float()).abs().max().item() for k in want)
        exact = all(torch.equal(got[k], inputs["x"][:, : got[k].shape[1]]) for k in got)
        dt = torch_dtype(dtype)
        fast = sum(row_vec(graph, t.reads[0], dt) and row_vec(graph, w, dt)
                   for t in graph.tasks for w in t.writes)
        print(json.dumps({"case": f"copy-{dtype}", "error": error, "exact": exact, "fast": fast,
                          "pairs": sum(len(t.writes) for t in graph.tasks)}), flush=True)
        graph = build_reduce(dtype)
        inputs = {n: torch.randn(R, C, generator=gen).to(dt) for n in ("x", "y", "z")}
        want, got = run(graph, inputs)
        fast = sum(all(row_vec(graph, r, dt) for r in (*t.reads, *t.writes)) for t in graph.tasks)
        # relative to the reference: the interpreter rounds fp32 -> bf16 its own way (one ulp)
        error = max(((got[k].float() - want[k].float()).norm() / want[k].float().norm()).item()
                    for k in want)
        print(json.dumps({"case": f"reduce-{dtype}", "error": error, "fast": fast,
                          "pairs": len(graph.tasks)}), flush=True)


if __name__ == "__main__":
    main()
