"""MoE traffic follows the routed counts (data), not the capacity of the buffers."""

from __future__ import annotations

import pytest
import torch

import mgraph as mg
from helpers import rel_err
from mgraph.graph import Task
from mgraph.kinds import kind_spec
from mgraph.runtime import run_sequential
from mgraph.runtime.reference import ReferenceRuntime
from mgraph.runtime.sequential import execute_sequential
from mgraph.runtime.sim.model import task_model

OP = "moe_dispatch_combine"


def build(topology: str, *, T_loc: int = 16, E_loc: int = 2, top_k: int = 2, **kw):
    world = mg.Topology.parse(topology).world_size
    # groups of one expert (the op's default groups several): the tests count per expert
    kw = {"H": 16, "F": 32, "expert_rows": 8, "combine_cols": 8, "expert_group": 1, **kw}
    return mg.ops.moe_dispatch_combine(
        T=T_loc * world, E=E_loc * world, top_k=top_k, topology=topology, **kw
    )


def routed(kind: str, topology: str, E: int, seed: int) -> tuple[mg.TaskGraph, dict]:
    """A graph and inputs whose routing is random, or skewed to leave experts empty or full."""
    g = build(topology)
    inputs = mg.ops.get_op(OP).random_inputs(g, seed=seed)
    logits = inputs["router_logits"]
    if kind == "empty":  # experts 1 and E-1 get no token at all
        logits[:, [1, E - 1]] -= 50.0
    elif kind == "full":  # experts 0 and 3 get every token: on 1x4 and 2x2 their segments
        # (T_loc rows) fill exactly; on 2x4 (segments of 8 rows: capacity_factor 4 times a mean
        # load of 2) half of each rank's tokens lose those picks, as the drop policy says
        logits[:, [0, 3]] += 50.0
    return g, inputs


def dropped_by_count(graph: mg.TaskGraph, logits: torch.Tensor) -> torch.Tensor:
    """[W, E]: the picks of each (source rank, expert) past the segment capacity, counted from
    torch's topk alone (the drop policy keeps the first C; how many it drops needs no order)."""
    W, E, k = graph.topology.world_size, graph.params["E"], graph.params["top_k"]
    C = graph.buffers["send@0"].rows // E
    picks = torch.zeros(logits.shape[0], E).scatter_(1, logits.float().topk(k).indices, 1.0)
    return (picks.view(W, -1, E).sum(1) - C).clamp(min=0)


@pytest.mark.parametrize("topology", ["1x4", "2x2", "2x4"])
@pytest.mark.parametrize("kind", ["random", "empty", "full"])
def test_exact_on_both_runtimes(topology, kind):
    E = 2 * mg.Topology.parse(topology).world_size
    for seed in (0, 1):
        g, inputs = routed(kind, topology, E, seed)
        g.validate()
        want = mg.ops.get_op(OP).run_reference(inputs, g.params)
        lost = dropped_by_count(g, inputs["router_logits"])
        assert torch.equal(want["dropped"], lost)
        seq = run_sequential(g, inputs)
        assert rel_err(seq["out"], want["out"]) < 1e-4 and torch.equal(seq["dropped"], lost)
        got = mg.run(mg.schedule(g), inputs).outputs  # threads, NaN-free output
        assert not got["out"].isnan().any() and rel_err(got["out"], want["out"]) < 1e-4
        assert torch.equal(got["dropped"], lost)
        if kind == "full" and topology == "2x4":  # segments of 8 rows: experts 0 and 3 of
            # every source rank get all its 16 tokens and drop 8 picks each, nothing else drops
            assert lost[:, [0, 3]].eq(8).all() and lost.sum() == 8 * 2 * 8
        else:
            assert lost.sum() == 0


def test_capacity_cannot_overflow():
    """On 1x4 (E=8, top_k=2) capacity_factor 4 = E / top_k: segments of T_loc rows per (source,
    expert). A token picks an expert at most once, so even a router that sends every token to
    the same top_k experts fills them exactly and drops nothing."""
    g, inputs = routed("full", "1x4", 8, 0)
    assert g.buffers["send@0"].rows == 8 * 16
    mem = execute_sequential(g, inputs)
    counts = torch.stack([mem[g.buffers[f"counts@{r}"].id] for r in range(4)])
    assert (counts.view(4, -1)[:, [0, 3]] == 16).all() and counts.sum() == 4 * 16 * 2


def test_move_copies_only_filled_rows():
    seg, cols = 4, 3
    src = torch.randn(3 * seg, cols)
    dst = torch.full_like(src, float("nan"))
    task = Task(0, "m", 0, "nvlink", "moe_move", [], [], params={"segment_rows": seg})
    kind_spec("moe_move").run_cpu(task, [src, torch.tensor([[2.0, 0.0, 4.0]])], [dst])
    assert torch.equal(dst[:2], src[:2]) and torch.equal(dst[8:], src[8:])
    assert dst[2:8].isnan().all()  # past the count of segment 0, and all of empty segment 1


def test_empty_expert_tile_exits_at_once():
    H, F, rows = 4, 6, 8
    w = [torch.randn(H, F), torch.randn(H, F), torch.randn(F, H)]
    x, meta = torch.randn(rows, H), torch.zeros(rows, 3)
    y, hidden = torch.full((rows, H), float("nan")), torch.full((rows, F), float("nan"))
    task = Task(0, "e", 0, "compute", "moe_expert", [], [], params={"local_expert": 0, "row0": 8})
    kind_spec("moe_expert").run_cpu(task, [x, meta, torch.tensor([[8.0]]), *w], [y, hidden])
    assert y.isnan().all() and hidden.isnan().all()  # the count (8) ends before this tile
    task.params["row0"] = 5
    kind_spec("moe_expert").run_cpu(task, [x, meta, torch.tensor([[8.0]]), *w], [y, hidden])
    assert not y[:3].isnan().any() and y[3:].isnan().all() and hidden[3:].isnan().all()


def test_sim_costs_routed_bytes():
    """On one node every block moves over NVLink. With the counts of a fixed routing the sim's
    bytes per (source, destination) link are routed tokens x H x itemsize; with the lowering's
    expectation they are top_k / E of capacity, i.e. capacity / (E / top_k)."""
    g, inputs = routed("random", "1x4", 8, 2)
    mem = execute_sequential(g, inputs)
    T_loc, E_loc, H, k, E = 16, 2, 16, 2, 8
    block = E_loc * T_loc  # rows of a (source, destination) pair; a move carries one expert's

    def actual(t: Task) -> float:  # a fill read from the run's counts: the moved rows / capacity
        if t.kind != "moe_move":
            return 1.0
        c = t.reads[1]
        n = mem[c.buffer][c.row0 : c.row1, c.col0 : c.col1].sum().item()
        return n / (t.reads[0].row1 - t.reads[0].row0)

    hw = mg.H200
    by_fill = {
        "capacity": task_model(g, hw, lambda t: 1.0),
        "expected": task_model(g, hw),
        "actual": task_model(g, hw, actual),
    }
    _, experts = inputs["router_logits"].float().topk(k, dim=-1)
    item = 4  # float32 rows
    seen = 0
    for t in g.tasks:
        if not t.name.startswith("dispatch r") or t.kind != "moe_move":
            continue
        s, d = (int(p) for p in t.name.split()[1][1:].split("->r"))
        group = int(t.name.split()[2][1:])  # expert_group=1: the group is one expert
        mine = experts[s * T_loc : (s + 1) * T_loc]
        tokens = (mine == d * E_loc + group).sum().item()
        # The count it reads is local to the sender: no link bytes.
        assert by_fill["actual"].remote[t.id] == tokens * H * item
        seen += tokens
        assert by_fill["capacity"].remote[t.id] == T_loc * H * item
        assert by_fill["expected"].remote[t.id] == pytest.approx(T_loc * H * item * k / E)
    assert 0 < seen < 4 * 3 * block  # tokens did cross links, far fewer than capacity


def test_relaunch_with_another_routing():
    """One runtime, launches with different counts: rows past a count (NaN-poisoned each launch,
    or left from a fuller routing) never reach the output. The full routing drops (segments of
    8 rows of 16 tokens); the reference applies the same policy."""
    rt = ReferenceRuntime(mg.schedule(build("2x4")))
    for kind, seed in (("full", 0), ("empty", 1), ("random", 2)):
        g, inputs = routed(kind, "2x4", 16, seed)
        want = mg.ops.get_op(OP).run_reference(inputs, g.params)
        got = rt.run(inputs).outputs
        assert not got["out"].isnan().any() and rel_err(got["out"], want["out"]) < 1e-4, kind
        # counts rewritten every launch: the full routing's drops do not stay
        assert torch.equal(got["dropped"], dropped_by_count(g, inputs["router_logits"])), kind
        assert torch.equal(got["dropped"], want["dropped"]), kind
