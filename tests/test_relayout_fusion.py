"""Head splits read by their elementwise consumer (issue 16, item 4): a relayout whose result only
one elementwise chain reads (q's and k's ``x.view(B, S, H, D).transpose(1, 2)`` feeding RoPE) is
no task; the chain's ``ewise`` tasks read the relayout's SOURCE through the relayout's gather map
(a ``gather:`` operand, mgraph/ops/elementwise.py; the map is relayout.tile_gathers').

- The op: a ``gather:`` operand against torch on random inputs, fp32 and bf16, GQA head counts,
  on layouts that shard heads (a colwise projection's output), tokens (zigzag too) or nothing;
  named errors for a layout that would need other ranks' rows and for two gather operands.
- The tracer (fuse_pointwise): the head splits of q and k go, v's (read by attention) and the
  output merge stay; relayouts another op also reads, or whose source is held in another
  layout than they read it in, or whose map has no gather form, stay relayout tasks.
- The megakernel under TRITON_INTERPRET=1: this file run as a script (``python
  tests/test_relayout_fusion.py`` with TRITON_INTERPRET=1) prints one JSON line per case.
"""

from __future__ import annotations

import collections
import os
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mgraph as mg
from helpers import check_graph, check_interpreter_cases, rel_err, row_vec
from mgraph.ops.elementwise import bcast_form, gather_fits, gather_form
from mgraph.runtime import run_sequential

B, S, D = 2, 16, 16
CHAIN = [["mul", 0, 1, 0.0], ["rotate_half", 0, -1, 0.0], ["mul", 4, 2, 0.0], ["add", 3, 5, 0.0]]
SPLIT = [["permute", [0, 2, 1, 3]]]  # after the view: [B, S, H, D] -> [B, H, S, D]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def random(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def split_rope(heads, seq=S, dim=D, topology="1x1", src=None, dst=None, dtype=torch.float32,
               tile_rows=16):
    """RoPE over the head split of a ``[B, seq, heads * dim]`` source held in ``src``: the
    elementwise op whose x is the split read through its gather map, in layout ``dst``."""
    steps = [["view", [B, seq, heads, dim]], *SPLIT]
    shape = [B, heads, seq, dim]
    form = bcast_form([seq, dim], shape)
    g = mg.ops.elementwise(topology=topology, rows=B * heads * seq, cols=dim, chain=CHAIN,
                           operands=[form, form], shape=shape, layout=dst, tile_rows=tile_rows,
                           x_form=gather_form([B, seq, heads * dim], steps, src), dtype=dtype)
    return g, shape


def want_rope(x, cos, sin, heads):
    q = x.float().view(B, -1, heads, x.shape[-1] // heads).transpose(1, 2)
    return q * cos.float() + rotate_half(q) * sin.float()


# -- the op ------------------------------------------------------------------------------------
LAYOUTS = [("1x1", None, None),
           ("1x2", ["shard", 2, False], ["shard", 1, False]),  # heads: a colwise projection's
           ("1x2", ["shard", 1, False], ["shard", 2, False]),  # tokens
           ("1x2", ["shard", 1, True], ["shard", 2, True]),  # tokens, zigzag
           ("2x2", ["shard", 1, False], ["shard", 2, False])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [4, 2], ids=lambda h: f"h{h}")  # GQA: query and KV heads
@pytest.mark.parametrize("topology,src,dst", LAYOUTS, ids=lambda v: str(v))
def test_gather_operand_matches_torch(topology, src, dst, heads, dtype):
    """Per rank and tile, the CPU body reads x through the task's own g_* params (the Triton
    body's arithmetic), so this checks the derived maps too. seq 24, tiles of 16: tiles that
    cross heads (a map of two row digits)."""
    g, shape = split_rope(heads, seq=24, topology=topology, src=src, dst=dst, dtype=dtype)
    check_graph(g)
    assert not [t for t in g.tasks if t.kind == "relayout"]
    x, cos, sin = (random(B, 24, heads * D, dtype=dtype, seed=1),
                   random(24, D, dtype=dtype, seed=2), random(24, D, dtype=dtype, seed=3))
    got = run_sequential(g, {"x": x.reshape(-1, heads * D), "y": cos, "y2": sin})["out"]
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(got.float().reshape(shape), want_rope(x, cos, sin, heads)) < tol


def test_gather_tasks_read_the_source_box_they_need():
    """A task's gather region is the box of the source buffer its map reaches: its 16 tokens'
    rows and its head's columns, not the whole buffer a relayout task reads."""
    g, _ = split_rope(4)
    boxes = sorted({(t.reads[0].row0, t.reads[0].row1, t.reads[0].col0, t.reads[0].col1)
                    for t in g.tasks})
    assert boxes == [(b * S, b * S + S, h * D, h * D + D) for b in range(B) for h in range(4)]


def test_gather_rows_wider_than_the_source():
    """A view to rows twice the source's width ([B, S, 32] as [B, S/2, 64]): each output row
    spans two source rows, so a task's region is whole source rows."""
    form = gather_form([B, S, 32], [["view", [B, S // 2, 64]]], None)
    g = mg.ops.elementwise(topology="1x2", rows=B * S // 2, cols=64, chain=[["exp", 0, -1, 0.0]],
                           operands=[], shape=[B, S // 2, 64], layout=["shard", 1, False],
                           tile_rows=4, x_form=form)
    check_graph(g)
    assert {(t.reads[0].col0, t.reads[0].col1) for t in g.tasks} == {(0, 32)}
    assert {t.reads[0].row1 - t.reads[0].row0 for t in g.tasks} == {8}
    x = random(B, S, 32, seed=10)
    got = run_sequential(g, {"x": x.reshape(-1, 32)})["out"]
    assert rel_err(got, x.exp().reshape(-1, 64)) < 1e-6


def test_bad_gather_operands_are_named_errors():
    ew = mg.ops.elementwise
    steps = [["view", [B, S, 4, D]], *SPLIT]
    # token-sharded source, head-sharded result: each rank would read the other's tokens
    form = gather_form([B, S, 4 * D], steps, ["shard", 1, False])
    with pytest.raises(mg.ShapeError, match="lacks elements"):
        ew(topology="1x2", rows=B * 4 * S, cols=D, chain=[["neg", 0, -1, 0.0]], operands=[],
           shape=[B, 4, S, D], layout=["rows", -1, False], x_form=form)
    assert not gather_fits(form, [B, 4, S, D], ["rows", -1, False], 2)
    with pytest.raises(mg.ShapeError, match="not the op's shape"):
        ew(topology="1x1", rows=B * 4 * S, cols=D, chain=[["neg", 0, -1, 0.0]], operands=[],
           shape=[B, S, 4, D], x_form=gather_form([B, S, 4 * D], steps, None))
    other = gather_form([B, S, 4 * D], [["view", [B, S, 4, D]], ["permute", [0, 2, 1, 3]]],
                        ["replicate", -1, False])
    two = gather_form([B * S, 4 * D], [["view", [B, S, 4, D]], *SPLIT], None)
    with pytest.raises(mg.OptionError, match="more than one gather"):
        ew(topology="1x1", rows=B * 4 * S, cols=D, chain=[["add", 0, 1, 0.0]], operands=[two],
           shape=[B, 4, S, D], x_form=other)
    with pytest.raises(mg.OptionError, match="x_form"):
        ew(topology="1x1", rows=64, cols=16, chain=[["neg", 0, -1, 0.0]], operands=[],
           x_form="row")


# -- traced modules --------------------------------------------------------------------------
class Attention(nn.Module):
    """GQA attention as Llama writes it: head splits, RoPE on q and k, SDPA, the output merge."""

    def __init__(self, hidden=64, heads=4, kv_heads=2, head_dim=D):
        super().__init__()
        self.head_dim = head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, -1))


TP = {"q_proj": mg.ColwiseParallel(), "k_proj": mg.ColwiseParallel(),
      "v_proj": mg.ColwiseParallel(), "o_proj": mg.RowwiseParallel()}


def relayout_nodes(prog) -> list[str]:
    return [n.name for n in prog.lowered.nodes if n.op == "relayout"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_traced_attention_reads_q_and_k_splits_in_rope(dtype):
    """At 1x2 tensor-parallel: the q and k head splits are read by the RoPE tasks; v's split
    (read by attention) and the output merge stay relayouts; no relayout task reads q or k."""
    torch.manual_seed(0)
    model = Attention().to(dtype).eval()
    args = (torch.randn(B, S, 64, dtype=dtype), random(S, D, dtype=dtype, seed=4),
            random(S, D, dtype=dtype, seed=5))
    prog = mg.compile(model, args, plan=TP, topology="1x2")
    with torch.no_grad():
        want = model(*args)
    assert rel_err(prog(*args).float(), want.float()) < (1e-5 if dtype == torch.float32 else 3e-2)
    traced = [n.name for n in prog.opgraph.nodes if n.op == "relayout"]
    assert len(traced) == 4, traced  # q, k, v splits and the merge, as traced
    assert not relayout_nodes(prog), relayout_nodes(prog)  # v's split, the merge: the attention's
    rope = [n for n in prog.lowered.nodes if n.op == "elementwise"]
    assert len(rope) == 2 and all(n.params["x_form"].startswith("gather:") for n in rope)
    per_rank = collections.Counter(t.kind for t in prog.graph.tasks if t.rank == 0)
    # v's split and the merge are read and written in place by the attention (token_major)
    assert per_rank["relayout"] == 0, per_rank


class Kept(nn.Module):
    """Relayouts that stay tasks (in a SequenceParallel region: token-sharded projections): a
    split another op also reads (and a program output); a view that merges the sharded tokens
    with the batch (the relayout reads its source replicated: a rank would read other ranks'
    rows)."""

    def __init__(self):
        super().__init__()
        self.p = nn.Linear(32, 4 * D, bias=False)
        self.p2 = nn.Linear(32, 4 * D, bias=False)

    def forward(self, x):
        q = self.p(x).view(B, S, 4, D).transpose(1, 2)
        merged = self.p2(x).view(B * S, 4, D) * 2.0
        return q * 3.0, q, merged


class Five(nn.Module):
    """A permute whose rows need five digits (relayout.DIGITS is four): no gather form."""

    def forward(self, z):
        return z.view(2, 2, 2, 2, 2, D).permute(4, 3, 2, 1, 0, 5) + 1.0


def test_what_cannot_be_read_in_place_keeps_its_relayout():
    torch.manual_seed(6)
    model, x = Kept().eval(), random(B, S, 32, seed=6)
    prog = mg.compile(model, (x,), plan={"": mg.SequenceParallel()}, topology="1x2")
    with torch.no_grad():
        want = model(x)
    for a, w in zip(prog(x), want, strict=True):
        assert rel_err(a, w) < 1e-5
    assert len(relayout_nodes(prog)) == 2, relayout_nodes(prog)
    merge = [n for n in prog.lowered.nodes if n.op == "relayout"
             and n.params["steps"] == [["view", [B * S, 4, D]]]]
    assert merge and merge[0].params["in_layout"] == ["replicate", -1, False], merge
    assert merge[0].inputs["x"].layout == mg.layout.Layout("shard", 1), merge[0].inputs["x"]
    assert not [n for n in prog.lowered.nodes if "gather:" in str(n.params)]
    z = random(32, D, seed=8)
    prog = mg.compile(Five().eval(), (z,), topology="1x1")
    assert rel_err(prog(z), Five()(z)) < 1e-6
    assert len(relayout_nodes(prog)) == 1
    assert not gather_fits(gather_form([32, D], [["view", [2, 2, 2, 2, 2, D]], ["permute", [
        4, 3, 2, 1, 0, 5]]], None), [2, 2, 2, 2, 2, D], None, 1)


def test_token_sharded_split_is_read_in_place():
    """A token-sharded projection (SequenceParallel) split into heads and scaled: the chain
    reads it in place (its result token-sharded), no relayout."""

    class Split(nn.Module):
        def __init__(self):
            super().__init__()
            self.p = nn.Linear(32, 4 * D, bias=False)

        def forward(self, x):
            return self.p(x).view(B, S, 4, D).transpose(1, 2) * 2.0 + 1.0

    torch.manual_seed(9)
    model, x = Split().eval(), random(B, S, 32, seed=9)
    prog = mg.compile(model, (x,), topology="1x2", plan={"": mg.SequenceParallel()})
    with torch.no_grad():
        assert rel_err(prog(x), model(x)) < 1e-5
    assert not relayout_nodes(prog)
    (node,) = [n for n in prog.lowered.nodes if n.op == "elementwise"]
    assert node.params["layout"] == ["shard", 2, False], node.params
    assert node.params["x_form"].startswith("gather:")


# -- the megakernel under TRITON_INTERPRET=1 ---------------------------------------------------
def test_gather_operands_in_the_megakernel():
    pytest.importorskip("triton")
    check_interpreter_cases("test_relayout_fusion.py", INTERP_CASES)


# case -> whether every ewise task passes the fast path's gate (else none): a head of 16
# elements is whole 16-byte vectors in both dtypes, its half too; 12 bf16 elements are not
INTERP_CASES = {
    "split-h4-d16-float32": True,
    "split-h2-d16-bfloat16": True,
    "split-h4-d12-bfloat16": False,
    "traced-neg-d16-float32": True,
    "wide-rows-float32": True,
}


def _fast(graph, task, dtype) -> bool:
    """ewise_tile's gate on the host: row_operand's for the other operands and the output, and
    for the gather operand _gather_src's (relayout_tile's): the innermost column digit a
    stride-1 run of whole vectors, the base and the other strides multiples of them."""
    vec = 16 // torch.empty((), dtype=dtype).element_size()
    p = task.params

    gathered = [k for k in range(len(task.reads)) if (p.get("maps", 0) >> (2 * k)) & 3 == 3]
    others = [r for k, r in enumerate(task.reads) if k not in gathered]
    strides = [p["g_base"], p["g_c0n"], *(p[f"g_r{k}s"] for k in range(4)),
               *(p[f"g_c{k}s"] for k in range(1, 4))]
    gate = p["g_c0s"] == 1 and all(s % vec == 0 for s in strides)
    return (all(row_vec(graph, r, dtype) for r in (*others, *task.writes)) and p.get("half", 0) % vec == 0
            and (not gathered or gate))


def _interp_main() -> None:
    import json

    from mgraph.runtime.megakernel import TritonRuntime

    def report(case, graph, inputs, want) -> None:
        sched = mg.schedule(graph)
        got = TritonRuntime(sched, interpret=True).run(inputs).outputs
        err = max(rel_err(got[k].float(), want[k].float()) for k in want)
        ew = [t for t in graph.tasks if t.kind == "ewise"]
        assert all((t.params["maps"] & 3) == 3 for t in ew)  # x gathered in every task
        dtype = next(iter(inputs.values())).dtype
        fast = sum(_fast(graph, t, dtype) for t in ew)
        print(json.dumps({"case": case, "dtype": str(dtype).removeprefix("torch."),
                          "error": err, "fast": fast, "tasks": len(ew)}), flush=True)

    # tiles of 64 rows: 4 blocks of the body's 16 rows each, across heads
    for heads, dim, dt in ((4, 16, torch.float32), (2, 16, torch.bfloat16),
                           (4, 12, torch.bfloat16)):
        g, shape = split_rope(heads, dim=dim, dtype=dt, tile_rows=64)
        x = random(B, S, heads * dim, dtype=dt, seed=6)
        cos, sin = random(S, dim, dtype=dt, seed=7), random(S, dim, dtype=dt, seed=8)
        want = want_rope(x, cos, sin, heads).to(dt)
        report(f"split-h{heads}-d{dim}-{str(dt).removeprefix('torch.')}", g,
               {"x": x.reshape(-1, heads * dim), "y": cos, "y2": sin},
               {"out": want.reshape(-1, dim)})

    # output rows spanning two source rows (regions of whole source rows)
    form = gather_form([B, S, 32], [["view", [B, S // 2, 64]]], None)
    g = mg.ops.elementwise(topology="1x1", rows=B * S // 2, cols=64, chain=[["exp", 0, -1, 0.0]],
                           operands=[], shape=[B, S // 2, 64], tile_rows=4, x_form=form)
    x = random(B, S, 32, seed=10)
    report("wide-rows-float32", g, {"x": x.reshape(-1, 32)}, {"out": x.exp().reshape(-1, 64)})

    # traced: a projection's head split read by a chain without rotation (LOAD only)
    class Neg(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(32, 4 * D, bias=False)

        def forward(self, x):
            return -self.proj(x).view(B, S, 4, D).transpose(1, 2) * 0.5

    torch.manual_seed(3)
    model = Neg().eval()
    x = torch.randn(B, S, 32)
    prog = mg.compile(model, (x,), topology="1x1")
    assert not relayout_nodes(prog)
    with torch.no_grad():
        want = {"out": model(x).reshape(-1, D)}
    report("traced-neg-d16-float32", prog.graph, prog.inputs(x), want)


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before triton"
    torch.set_num_threads(1)
    sys.exit(_interp_main())
