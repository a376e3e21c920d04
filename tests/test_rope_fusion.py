"""Rotary embeddings without relayouts (issue 16): ``q * cos + rotate_half(q) * sin`` traces to
ONE elementwise op whose ``ewise`` tasks read q, cos and sin directly, one task per row tile.

- A broadcast operand (``cos`` ``[S, D]``, ``[1, 1, S, D]`` or ``[B, 1, S, D]`` against
  ``[B, H, S, D]``) is read through a row map (form ``bcast:``), not expanded by a relayout;
  broadcasts the map cannot express keep the ``*_bcast`` relayout.
- ``rotate_half``'s ``cat((-x[..., h:], x[..., :h]), -1)`` is a ``rotate_half`` load step of
  the consumer's chain, not two slices, a neg and a concat; other cats, and x split along its
  last dim, keep that path.

Checked against torch on random inputs (never zeros) on the reference runtime, and in the
megakernel under TRITON_INTERPRET=1: this file run as a script (``python
tests/test_rope_fusion.py`` with TRITON_INTERPRET=1) prints one JSON line per case.
"""

from __future__ import annotations

import collections
import os
import sys

import pytest
import torch
import torch.nn as nn

import mgraph as mg
from helpers import check_graph, check_interpreter_cases, rel_err, row_vec
from mgraph.ops.elementwise import bcast_form
from mgraph.runtime import run_sequential

B, S, D = 2, 16, 16


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_chain() -> list:
    """x * cos + rotate_half(x) * sin over inputs (x, cos, sin), as fuse_pointwise builds it."""
    return [["mul", 0, 1, 0.0], ["rotate_half", 0, -1, 0.0], ["mul", 4, 2, 0.0],
            ["add", 3, 5, 0.0]]


def rope_op(table, heads=4, seq=24, dim=16, topology="1x1", layout=None, dtype=torch.float32,
            tile_rows=16):
    """The elementwise op of RoPE over ``[B, heads, seq, dim]`` with tables of shape ``table``
    (``S``/``D`` filled in): seq 24 with 16-row tiles makes tiles that wrap around the table."""
    shape = [B, heads, seq, dim]
    tshape = [{"B": B, "S": seq, "D": dim}.get(d, d) for d in table]
    form = bcast_form(tshape, shape)
    assert form is not None, tshape
    g = mg.ops.elementwise(topology=topology, rows=B * heads * seq, cols=dim, chain=rope_chain(),
                           operands=[form, form], shape=shape, layout=layout, tile_rows=tile_rows,
                           dtype=dtype)
    return g, shape, tshape


def random(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# -- the op ------------------------------------------------------------------------------------
TABLES = (["S", "D"], [1, 1, "S", "D"], ["B", 1, "S", "D"], [1, 4, "S", "D"], ["B", 4, 1, "D"])


@pytest.mark.parametrize("table", TABLES, ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("topology,layout", [("1x1", None), ("2x2", ["shard", 1, False]),
                                             ("1x2", ["shard", 2, False]),
                                             ("1x2", ["shard", 2, True]),
                                             ("1x2", ["rows", -1, False])])
def test_rope_op_matches_torch(table, topology, layout):
    """Against q * cos + rotate_half(q) * sin by torch's own broadcasting, on layouts that
    shard heads, tokens (several runs per rank; zigzag as ContextParallel's) and flat rows."""
    g, shape, tshape = rope_op(table, topology=topology, layout=layout)
    check_graph(g)
    q, cos, sin = random(*shape, seed=1), random(*tshape, seed=2), random(*tshape, seed=3)
    got = run_sequential(g, {"x": q.reshape(-1, D), "y": cos.reshape(-1, D),
                             "y2": sin.reshape(-1, D)})["out"]
    want = q * cos + rotate_half(q) * sin
    assert rel_err(got.reshape(want.shape), want) < 1e-6


def test_rope_tasks_read_only_the_table_rows_they_need():
    """A tile inside one run of the table's rows reads just those rows; one that wraps around
    the sequence reads the whole table; a rank holds the rows its tasks read (its tokens')."""
    g, _, _ = rope_op(["S", "D"], seq=32, tile_rows=16)
    table_rows = {(t.reads[1].row0, t.reads[1].row1) for t in g.tasks}
    assert table_rows == {(0, 16), (16, 32)}, table_rows
    g, _, _ = rope_op(["S", "D"], seq=24, tile_rows=16)
    assert {(t.reads[1].row0, t.reads[1].row1) for t in g.tasks} == {(0, 16), (0, 24), (8, 24)}
    g, _, _ = rope_op(["S", "D"], seq=32, topology="1x2", layout=["shard", 2, False])
    held = {b.rank: b.binding.pieces for b in g.buffers.values() if b.name == "y"}
    assert held == {0: (((0, 16), (0, D)),), 1: (((16, 32), (0, D)),)}, held


def test_bad_rope_operands_are_named_errors():
    ew = mg.ops.elementwise
    with pytest.raises(mg.ShapeError, match="does not broadcast"):
        ew(topology="1x1", rows=64, cols=16, chain=rope_chain(),
           operands=["bcast:1x3x16", "bcast:1x3x16"], shape=[4, 16, 16])
    with pytest.raises(mg.ShapeError, match="whole rows"):
        ew(topology="1x2", rows=64, cols=16, chain=[["rotate_half", 0, -1, 0.0]], operands=[],
           shape=[4, 16, 16], layout=["shard", 2, False])
    with pytest.raises(mg.ShapeError, match="even width"):
        ew(topology="1x1", rows=64, cols=15, chain=[["rotate_half", 0, -1, 0.0]], operands=[])
    with pytest.raises(mg.OptionError, match="rotates value 1"):
        ew(topology="1x1", rows=64, cols=16, chain=[["neg", 0, -1, 0.0], ["rotate_half", 1, -1, 0.0]],
           operands=[])
    three = ["bcast:1x1x16x16", "bcast:2x1x16x16", "bcast:1x2x16x16"]
    with pytest.raises(mg.OptionError, match="distinct broadcast maps"):
        ew(topology="1x1", rows=64, cols=16, operands=three, shape=[2, 2, 16, 16],
           chain=[["add", 0, 1, 0.0], ["add", 4, 2, 0.0], ["add", 5, 3, 0.0]])


# -- traced modules --------------------------------------------------------------------------
class Rope(nn.Module):
    """q and k projections split into heads (GQA: fewer KV heads), RoPE with tables in the
    form ``table``: "SD" ([S, D], broadcast over batch and heads), "B1SD" ([B, S, D] inputs
    unsqueezed over the heads, as transformers does), "11SD" ([1, 1, S, D])."""

    def __init__(self, hidden=64, heads=8, kv_heads=2, head_dim=D, table="B1SD"):
        super().__init__()
        self.head_dim, self.table = head_dim, table
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.table == "B1SD":
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        elif self.table == "11SD":
            cos, sin = cos[None, None], sin[None, None]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


TP = {"q_proj": mg.ColwiseParallel(), "k_proj": mg.ColwiseParallel()}


def tables(table: str, dtype=torch.float32, head_dim=D, batch=B, seq=S):
    shape = (batch, seq, head_dim) if table == "B1SD" else (seq, head_dim)
    return random(*shape, dtype=dtype, seed=4), random(*shape, dtype=dtype, seed=5)


def task_stems(prog) -> collections.Counter:
    """Tasks of rank 0 per (kind, op label): the label is the task name before its rank."""
    return collections.Counter(
        (t.kind, t.name.split(" r0 ")[0].split(": ")[-1]) for t in prog.graph.tasks if t.rank == 0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("table", ["B1SD", "SD", "11SD"])
def test_traced_rope_is_one_task_per_tile(table, dtype):
    torch.manual_seed(0)
    model = Rope(table=table).to(dtype).eval()
    x = torch.randn(B, S, 64, dtype=dtype)
    args = (x, *tables(table, dtype))
    prog = mg.compile(model, args, plan=TP, topology="1x2")
    with torch.no_grad():
        want = model(*args)
    got = prog(*args)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, w in zip(got, want, strict=True):
        assert rel_err(a, w) < tol
    stems = task_stems(prog)
    # 4 query heads and 1 KV head per rank, [B, H, S, D] rows in runs of H * S per batch:
    # one task per run of 64 (q) or 16 (k) rows, nothing else: the head split is read through
    # its gather map by the RoPE task (tests/test_relayout_fusion.py)
    rope = "rotate_half*mul*mul*add"
    assert stems[("ewise", rope)] == 2 * B, stems
    assert set(stems) == {("gemm", "matmul"), ("ewise", rope)}, stems
    for t in prog.graph.tasks:
        if t.kind == "ewise":  # q (or k) gathered, cos, sin: no copy of any of them
            assert len(t.reads) == 3 and t.params["maps"] == 0b010111 and t.params["half"] == D // 2


def test_transformers_llama_rope_is_fused():
    transformers = pytest.importorskip("transformers")  # noqa: F841
    from test_transformers_models import B as TB
    from test_transformers_models import S as TS
    from test_transformers_models import compiled_matches, llama, tp_plan

    torch.manual_seed(1)
    x = torch.randn(TB, TS, 128)
    prog = compiled_matches(llama(), (x,), plan=tp_plan(sequence=True), topology="1x2")
    stems = task_stems(prog)
    assert stems[("ewise", "rotate_half*mul*mul*add")] > 0, stems
    assert not [s for s in stems if s[0] == "concat" or s[1] in ("neg", "relayout") and "bcast"
                in s[1]], stems
    ops = [n.op for n in prog.opgraph.nodes]
    assert "concat" not in ops
    slices = [n for n in prog.opgraph.nodes if n.op == "relayout"
              and any(step[0] in ("slice", "expand") for step in n.params["steps"])]
    assert not slices, [n.params["steps"] for n in slices]


class Fallbacks(nn.Module):
    """What keeps today's path: a table broadcast over the last dim ([S, 1]) or over two runs
    of dims ([1, H, 1, D] against [B, H, S, D]); a cat that is not rotate_half; rotate_half of
    a tensor split along its last dim (a colwise projection's output, before the head split)."""

    def forward(self, x, q, per_pos, per_head):
        h = q.shape[-1] // 2
        not_rot = torch.cat((-q[..., :h], q[..., h:]), dim=-1)
        y = q * per_pos + not_rot * per_head
        p = self.proj(x)
        return y, rotate_half(p) * 2.0

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32, bias=False)


def test_what_the_map_cannot_express_keeps_the_relayout_path():
    torch.manual_seed(2)
    model = Fallbacks().eval()
    H = 4
    args = (torch.randn(B, S, 16), torch.randn(B, H, S, D), torch.randn(S, 1),
            torch.randn(1, H, 1, D))
    prog = mg.compile(model, args, plan={"proj": mg.ColwiseParallel()}, topology="1x2")
    with torch.no_grad():
        want = model(*args)
    for a, w in zip(prog(*args), want, strict=True):
        assert rel_err(a, w) < 1e-5
    names = [n.name for n in prog.opgraph.nodes]
    bcasts = [n for n in names if n.endswith("_bcast")]
    assert len(bcasts) == 2, names  # per_pos and per_head, each expanded
    ops = collections.Counter(n.op for n in prog.opgraph.nodes)
    assert ops["concat"] == 2, ops  # the cat that is not rotate_half, and the one of p
    rotated = [n for n in prog.opgraph.nodes if "rotate_half" in str(n.params.get("chain"))]
    assert not rotated


@pytest.mark.gpu
@pytest.mark.parametrize("table", ["B1SD", "SD"])
def test_gpu_rope_program_matches_eager(table):
    """A traced GQA RoPE at Llama-8B head sizes (32 query heads, 8 KV heads, head dim 128) on one
    GPU, backend="triton", bf16, against eager torch in fp32 on the same inputs; every RoPE task
    takes the fast path (16-byte vectors)."""
    import copy

    torch.manual_seed(4)
    dt = torch.bfloat16
    model = Rope(hidden=1024, heads=32, kv_heads=8, head_dim=128, table=table).to("cuda", dt)
    x = torch.randn(1, 1024, 1024, device="cuda", dtype=dt)
    cos, sin = (t.cuda() for t in tables(table, dt, head_dim=128, batch=1, seq=1024))
    prog = mg.compile(model.eval(), (x, cos, sin), backend="triton")
    exact = copy.deepcopy(model).float()
    with torch.no_grad():
        want = exact(x.float(), cos.float(), sin.float())
    for _ in range(2):  # the second call replays the runtime
        got = prog(x, cos, sin)
        torch.cuda.synchronize()
        for a, w in zip(got, want, strict=True):
            assert rel_err(a.float(), w) < 2e-2
    rope = [t for t in prog.graph.tasks if t.kind == "ewise"]
    assert rope and all(_fast(prog.graph, t, dt) for t in rope)


# -- the megakernel under TRITON_INTERPRET=1 ---------------------------------------------------
def test_rope_in_the_megakernel():
    pytest.importorskip("triton")
    check_interpreter_cases("test_rope_fusion.py", INTERP_CASES)


# case -> whether the fast path takes every ewise task (else none): 16-byte rows and a half
# of whole vectors (D=40 in bf16: a half of 20 elements is not)
INTERP_CASES = {
    "op-B1SD-d16-float32": True,
    "op-SD-d16-bfloat16": True,
    "op-11SD-d40-bfloat16": False,
    "traced-gqa-float32": True,
}


def _fast(graph, task, dtype) -> bool:
    """ewise_tile's gate on the host: every region admits 16-byte vectors (row_operand), and
    the rotation's half is a whole number of them."""
    vec = 16 // torch.empty((), dtype=dtype).element_size()

    regions = (*task.reads, *task.writes)
    return all(row_vec(graph, r, dtype) for r in regions) and task.params.get("half", 0) % vec == 0


def _interp_main() -> None:
    import json

    from mgraph.runtime.megakernel import TritonRuntime

    def report(case, graph, inputs, want) -> None:
        sched = mg.schedule(graph)
        got = TritonRuntime(sched, interpret=True).run(inputs).outputs
        err = max(rel_err(got[k].float(), want[k].float()) for k in want)
        ew = [t for t in graph.tasks if t.kind == "ewise"]
        dtype = next(iter(inputs.values())).dtype
        fast = sum(_fast(graph, t, dtype) for t in ew)
        print(json.dumps({"case": case, "dtype": str(dtype).removeprefix("torch."),
                          "error": err, "fast": fast, "tasks": len(ew)}), flush=True)

    for table, dim, dt in ((["B", 1, "S", "D"], 16, torch.float32),
                           (["S", "D"], 16, torch.bfloat16),
                           ([1, 1, "S", "D"], 40, torch.bfloat16)):
        g, shape, tshape = rope_op(table, heads=2, dim=dim, seq=24, dtype=dt)
        q, cos, sin = (random(*shape, dtype=dt, seed=6), random(*tshape, dtype=dt, seed=7),
                       random(*tshape, dtype=dt, seed=8))
        inputs = {"x": q.reshape(-1, dim), "y": cos.reshape(-1, dim), "y2": sin.reshape(-1, dim)}
        want = (q.float() * cos.float() + rotate_half(q.float()) * sin.float()).to(dt)
        name = "".join(str(d) for d in table)
        report(f"op-{name}-d{dim}-{str(dt).removeprefix('torch.')}", g, inputs,
               {"out": want.reshape(-1, dim)})
    # a traced GQA RoPE (4 query heads, 2 KV heads) whole in the megakernel: gemm, the head
    # split relayouts and the two fused RoPE chains, against eager torch; in fp32, as
    # megakernel_bodies_interp.py's traced MLP (the interpreter's bf16 dot multiplies raw bits)
    torch.manual_seed(3)
    dt = torch.float32
    model = Rope(hidden=32, heads=4, table="B1SD").to(dt).eval()
    args = (torch.randn(B, S, 32, dtype=dt), *tables("B1SD", dt))
    prog = mg.compile(model, args, topology="1x1")
    with torch.no_grad():
        eager = model(*args)
    want = {n: w.reshape(-1, D) for n, w in zip(prog.opgraph.output_names, eager, strict=True)}
    report("traced-gqa-float32", prog.graph, prog.inputs(*args), want)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before triton"
    torch.set_num_threads(1)
    sys.exit(_interp_main())
