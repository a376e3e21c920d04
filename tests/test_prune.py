"""mgraph.prune: the tasks no output depends on go, and nothing else moves.

A traced Llama block whose query heads are sharded past its KV heads gathers k whole on every
rank; each rank's attention reads one KV head. After pruning, each rank splits and rotates
only that head (the relayout reads a band of k's columns: mgraph/ops/relayout.py
``_column_bands``), the output still equals eager torch, and the graph still validates. A
hand-made graph checks which tasks go and the renumbering."""

from __future__ import annotations

import runpy
from pathlib import Path

import torch

import mgraph as mg
from mgraph.graph import Buffer, Event, Region, Task, TaskGraph, TensorSpec
from mgraph.lower import lower
from mgraph.program import trace
from mgraph.prune import prune
from mgraph.topology import Topology
from mgraph.trace.attention_map import token_major_attention
from mgraph.trace.pointwise import fuse_pointwise

EXAMPLES = Path(__file__).parent.parent / "examples"


def _block(topology: str):
    ns = runpy.run_path(str(EXAMPLES / "llama_block.py"), run_name="prune")
    torch.manual_seed(0)
    model = ns["DecoderBlock"](hidden=128, heads=8, kv_heads=2, ffn=256).eval()
    return model, torch.randn(1, 1024, 128), ns["block_plan"]()


def test_each_rank_splits_only_the_kv_head_its_attention_reads():
    model, x, plan = _block("2x4")
    opgraph = token_major_attention(fuse_pointwise(trace(model, (x,), plan, "2x4")))
    whole = lower(opgraph)
    before = len(whole.tasks)
    prog = mg.compile(model, (x,), plan=plan, topology="2x4")
    graph = prog.graph
    assert len(graph.tasks) < before
    # 8 heads of 16 columns on 8 ranks, 2 KV heads: ranks 0-3 read KV head 0, ranks 4-7 head 1;
    # a head is 1024 rows of k's split, eight 128-row relayout tiles and one RoPE tile
    heads = {}
    for t in graph.tasks:
        if t.kind == "relayout" and t.name.startswith("view_1:"):  # k's head split
            heads.setdefault(t.rank, set()).add(t.reads[0][3] // 16)
    assert heads == {r: {r // 4} for r in range(8)}, heads
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(prog(x), want, rtol=2e-5, atol=2e-5)


def test_a_graph_with_nothing_dead_is_left_as_it_was():
    model, x, plan = _block("1x2")
    opgraph = token_major_attention(fuse_pointwise(trace(model, (x,), plan, "1x2")))
    graph = lower(opgraph)
    text = graph.to_text()
    assert prune(graph) is graph and graph.to_text() == text


def _task(i, writes, reads=(), waits=(), signals=()):
    return Task(i, f"t{i}", 0, "compute", "copy", [Region(*r) for r in reads],
                [Region(*w) for w in writes], list(waits), list(signals))


def test_dead_tasks_go_and_ids_are_renumbered():
    bufs = {
        b.id: b for b in (
            Buffer("x", 0, 4, 4, "float32", "input"),
            Buffer("dead", 0, 4, 4, "float32", "scratch"),
            Buffer("mid", 0, 4, 4, "float32", "scratch"),
            Buffer("out", 0, 4, 4, "float32", "output"),
        )
    }  # fmt: skip
    events = [Event(0, 0, "dead done"), Event(1, 0, "mid done"), Event(2, 0, "unused")]
    tasks = [
        _task(0, [("dead@0", 0, 4, 0, 4)], [("x@0", 0, 4, 0, 4)], signals=[0]),
        _task(1, [("mid@0", 0, 4, 0, 4)], [("x@0", 0, 4, 0, 4)], signals=[1]),
        _task(2, [("dead@0", 0, 4, 0, 4)], [("dead@0", 0, 4, 0, 4)], waits=[(0, 1)]),
        _task(3, [("out@0", 0, 4, 0, 4)], [("mid@0", 0, 4, 0, 4)], waits=[(1, 1)]),
    ]
    graph = TaskGraph("t", Topology.parse("1x1"), "float32", {}, {"x": TensorSpec((4, 4), "float32")},
                      {"out": TensorSpec((4, 4), "float32")}, bufs, events, tasks)  # fmt: skip
    prune(graph)
    assert [t.name for t in graph.tasks] == ["t1", "t3"]
    assert [t.id for t in graph.tasks] == [0, 1]
    assert graph.tasks[0].signals == [1] and graph.tasks[1].waits == [(1, 1)]
    assert len(graph.events) == 3 and len(graph.buffers) == 4
    graph.validate()
