"""Compile-speed work must not change what is compiled: the TaskGraph (every task's fields, its
waits and signals, the events and buffers) and the Schedule (workers, queue order, proxy
batches) of small traced models are pinned to the digests the code gave before that work
(commit 203eea5's lowering, validation and scheduler; benchmarks/NOTES.md "compile speed").

A change that moves a digest changes the tasks or their order: if it is meant (a new lowering,
a new policy), it must say so and re-pin here on purpose. The models avoid RoPE (whose tracing
is fused elsewhere) so the pins watch lower/validate/schedule, not the tracer.

Re-pinned on purpose since: the attention reading v's head split and writing its output
merge in place (token_major_attention in mg.compile: fewer tasks), NVLink copies queued chunk
by chunk (policies.push_rotation: the 2x4 schedule), and AG+GEMM's node-local shards in
L2-friendly bands of tile rows (collectives.grouped: the 2x2 layer with 2048 tokens), and
attention's default KV block raised to 8192 keys (ring_attention.KV_KEYS: the 2x2 layer with
2048 tokens folds its 2048 keys in one task per q block, 64 attn_block tasks fewer), and
attention's ``inline_finalize`` on by default (no attn_finalize task: one task fewer per q
block, 4, 4, 64 and 128 below), and 1 MiB network chunks by default for GEMM+AR and GEMM+RS on
several nodes (collectives.default_chunk_bytes: the 2x2 layer with 2048 tokens, 32 tasks fewer;
the smaller models' chunks were under 256 KiB already).
"""

from __future__ import annotations

import hashlib
import runpy
from pathlib import Path

import pytest
import torch

import mgraph as mg

EXAMPLES = Path(__file__).parent.parent / "examples"


def graph_digest(graph: mg.TaskGraph) -> str:
    """Every field of every task, event and buffer, in graph order."""
    tasks = [
        (t.id, t.name, t.rank, t.role, t.kind, [tuple(r) for r in t.reads],
         [tuple(r) for r in t.writes], [tuple(w) for w in t.waits], list(t.signals), t.flops,
         t.bytes, sorted(t.params.items()))
        for t in graph.tasks
    ]  # fmt: skip
    buffers = [
        (k, b.name, b.rank, b.rows, b.cols, b.dtype, b.role, b.binding, b.symmetric, b.zeroed)
        for k, b in graph.buffers.items()
    ]
    events = [(e.id, e.rank, e.name) for e in graph.events]
    meta = (graph.op, str(graph.topology), graph.dtype, sorted(graph.params.items()),
            sorted(graph.inputs.items()), sorted(graph.outputs.items()))  # fmt: skip
    return hashlib.sha256(repr((meta, tasks, buffers, events)).encode()).hexdigest()[:16]


def schedule_digest(sched: mg.Schedule) -> str:
    """Per rank: workers per role, every role queue in order, the proxy batches."""
    ranks = [
        (rs.rank, sorted(rs.workers.items()), sorted(rs.queues.items()), rs.batches)
        for rs in sched.ranks
    ]
    return hashlib.sha256(repr(ranks).encode()).hexdigest()[:16]


def _block(topology: str, hidden: int, heads: int, ffn: int, tokens: int) -> mg.Program:
    ns = runpy.run_path(str(EXAMPLES / "transformer_block.py"), run_name="digest")
    torch.manual_seed(0)
    model = ns["Block"](hidden=hidden, heads=heads, ffn=ffn).eval()
    x = torch.randn(1, tokens, hidden)
    return mg.compile(model, (x,), plan=ns["block_plan"](), topology=topology)


# topology, hidden, heads, ffn, tokens -> (tasks, graph digest, schedule digest); re-pinned on
# purpose for inline_finalize's default (the attn_finalize tasks gone), and for pointwise chains
# tiled by the columns one rank holds (trace/pointwise._tile_rows: the last two, fewer tasks)
PINNED = [
    ("1x2", 64, 4, 128, 32, (52, "f77769a7f5c04331", "2522b403dcea83b2")),
    ("2x2", 128, 4, 384, 64, (228, "fcac98cc0c7821dc", "80cc79ec261d1c09")),
    ("2x4", 512, 8, 1536, 1024, (1112, "aa232b134d4ae629", "f07018b071430cb4")),
    # 2816 / 4 ranks = 704 columns: masked edge tiles
    ("2x2", 1024, 8, 2816, 2048, (2008, "96adfc835628f81e", "7c26804b2848c944")),
]  # fmt: skip


@pytest.mark.parametrize(("topology", "hidden", "heads", "ffn", "tokens", "pinned"), PINNED)
def test_compiled_graph_and_schedule_are_pinned(topology, hidden, heads, ffn, tokens, pinned):
    prog = _block(topology, hidden, heads, ffn, tokens)
    got = (len(prog.graph.tasks), graph_digest(prog.graph), schedule_digest(prog.schedule))
    assert got == pinned, (
        f"transformer_block at {topology}: the compiled graph or schedule moved "
        f"(tasks, graph, schedule) {got} != {pinned}; compile-speed changes must keep them"
    )


def test_digests_see_a_moved_wait_and_a_reordered_queue():
    """Neither digest is blind: one wait count, or two queued tasks swapped, changes it."""
    prog = _block("1x2", 64, 4, 128, 32)
    graph, sched = prog.graph, prog.schedule
    g0, s0 = graph_digest(graph), schedule_digest(sched)
    waiter = next(t for t in graph.tasks if t.waits)
    e, c = waiter.waits[0]
    waiter.waits[0] = (e, c + 1)
    assert graph_digest(graph) != g0
    waiter.waits[0] = (e, c)
    assert graph_digest(graph) == g0
    q = sched.ranks[0].queues["compute"]
    q[0], q[1] = q[1], q[0]
    assert schedule_digest(sched) != s0


def test_schedule_from_validations_order_is_the_schedule_without_it():
    """mg.compile hands validation's counter order to scheduling instead of simulating the
    counters again: the same queues and workers as a schedule that computes it itself."""
    from mgraph.validate import topo_order, validate

    graph = _block("2x2", 128, 4, 384, 64).graph
    order = validate(graph)
    assert order == topo_order(graph)
    assert schedule_digest(mg.schedule(graph, order=order)) == schedule_digest(mg.schedule(graph))


def test_gc_paused_restores_the_collector_and_leaves_freezes_alone():
    import gc
    import weakref

    from mgraph.graph import gc_paused

    class Node:
        pass

    # a young reference cycle made before the pause is collected, not promoted with the graph
    cycle = Node()
    cycle.self = cycle
    dead = weakref.ref(cycle)
    del cycle
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        assert dead() is None
        made = [[i] for i in range(5000)]
    assert gc.isenabled()
    # what was made inside is in the oldest generation, not waiting for a young collection
    assert gc.get_count()[0] < 1000, gc.get_count()
    assert gc.get_freeze_count() == 0
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()  # a caller's disabled collector stays disabled
    finally:
        gc.enable()
    # a process that froze objects itself keeps them frozen
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with gc_paused():
            made.append([0])
        # still frozen (an unfreeze would drop the count to 0); a frozen object that dies
        # meanwhile (another test's, in this worker) lowers it a little
        assert frozen - 100 <= gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
