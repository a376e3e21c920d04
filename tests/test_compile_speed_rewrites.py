"""Compile-speed rewrites that must not change a result: the tracer pauses the collector and
leaves it as it found it, validation's structure and transfer checks share one pass (a structure error anywhere still wins over a transfer error, and the
first transfer error in task order is the one raised), the policies rank priorities column by
column (the order one sort of the tuples gives), task_costs inlines the compute cost (the same
floats as ``_Rates.cost``), policy_input reuses what topo_order's simulation built, and the builder counts bytes and flops shapes in one pass."""

from __future__ import annotations

import gc
import random

import pytest
import torch
import torch.nn as nn

import mgraph as mg
from mgraph.builder import GraphBuilder
from mgraph.hardware import H200
from mgraph.kinds import KINDS, Role
from mgraph.scheduler.costmodel import _Rates, compute_ranks, remote_bytes, task_costs
from mgraph.scheduler.policies import Columns, policy_input
from mgraph.trace import trace
from mgraph.validate import CounterOrder, topo_order


def builder(topology: str = "2x2") -> GraphBuilder:
    return GraphBuilder("toy", mg.Topology.parse(topology), "float32", {})


def test_structure_error_wins_over_an_earlier_transfer_error():
    b = builder()
    a, far = b.buffer("a", 0, 4, 4), b.buffer("far", 2, 4, 4)
    b.task(0, Role.COMPUTE, "copy", [a.region()], [far.region()], name="sneaky")  # transfer
    b.task(0, Role.COMPUTE, "copy", [a.region()], [a.region()], waits=[(99, 1)], name="late")
    with pytest.raises(mg.GraphError, match="'late'.*bad wait") as info:
        b.finish().validate()
    assert not isinstance(info.value, mg.TransferError)


def test_first_transfer_error_in_task_order_is_raised():
    b = builder()
    a, c, far = b.buffer("a", 0, 4, 4), b.buffer("c", 1, 4, 4), b.buffer("far", 2, 4, 4)
    b.task(0, Role.COMPUTE, "copy", [a.region()], [c.region()], name="fine")
    b.task(0, Role.NVLINK, "copy", [a.region((0, 2))], [c.region()], name="first")  # shapes
    b.task(0, Role.COMPUTE, "copy", [a.region()], [far.region()], name="second")
    with pytest.raises(mg.TransferError, match="'first'.*shape"):
        b.finish().validate()


def test_compute_task_signalling_another_node_is_rejected():
    b = builder()
    a = b.buffer("a", 0, 4, 4)
    ev = b.event(2, "far")
    b.task(0, Role.COMPUTE, "copy", [a.region((0, 2))], [a.region((2, 4))], signals=[ev],
           name="loud")  # fmt: skip
    with pytest.raises(mg.TransferError, match="'loud'.*signals event 'far' on rank 2"):
        b.finish().validate()


def test_columns_rank_as_one_sort_of_tuples():
    rng = random.Random(0)
    n = 3000
    # few distinct values: most keys tie on the first columns, the order rests on the later
    # ones and on the id
    cols = (
        [rng.choice([0, 1, 2]) for _ in range(n)],
        [-rng.choice([0.0, 0.5, 1.5, 2.0]) for _ in range(n)],
        [rng.randrange(4) for _ in range(n)],
    )
    for k in (1, 2, 3):
        pri = Columns(*cols[:k])
        tuples = [tuple(c[i] for c in cols[:k]) for i in range(n)]
        assert pri.ranked() == sorted(range(n), key=tuples.__getitem__)
        assert len(pri) == n and pri[7] == tuples[7]


def test_task_costs_match_the_cost_of_each_task():
    g = mg.ops.gemm_allreduce(M=64, N=64, K=64, topology="2x2", tile=[16, 16])
    assert {t.role for t in g.tasks} == {"compute", "nvlink", "rdma"}
    reads, writes = remote_bytes(g)
    beside = compute_ranks(g)
    rates = _Rates(H200)
    want = [rates.cost(t, reads[t.id], writes[t.id], t.rank in beside) for t in g.tasks]
    assert task_costs(g, H200) == want  # exact: the same float operations


def test_builder_counts_bytes_and_flops_of_each_task():
    b = builder("1x2")
    x = b.buffer("x", 0, 32, 16)
    w = b.buffer("w", 0, 16, 8, dtype="bfloat16")
    y = b.buffer("y", 0, 32, 8)
    t = b.task(0, Role.COMPUTE, "gemm", [x.region((0, 32)), w.region()], [y.region()])
    assert t.bytes == 32 * 16 * 4 + 16 * 8 * 2 + 32 * 8 * 4
    assert t.flops == KINDS["gemm"].flops_fn([(32, 16), (16, 8)], [(32, 8)], {}) == 2.0 * 32 * 8 * 16
    given = b.task(0, Role.COMPUTE, "gemm", [x.region(), w.region()], [y.region()], flops=7)
    assert given.flops == 7.0 and given.flops.__class__ is float
    copy = b.task(0, Role.COMPUTE, "copy", [y.region((0, 16))], [y.region((16, 32))])
    assert copy.flops == 0.0 and copy.bytes == 2 * 16 * 8 * 4


class _Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")


def test_trace_leaves_the_collector_as_it_found_it():
    # trace pauses the collector while torch.export runs (its first call imports ~1200
    # modules); the caller's setting must survive, also when tracing fails
    was = gc.isenabled()
    try:
        for enabled in (True, False):
            gc.enable() if enabled else gc.disable()
            og = trace(nn.Linear(8, 8), torch.randn(4, 8))
            assert [n.op for n in og.nodes] == ["matmul", "elementwise"]
            assert gc.isenabled() == enabled
            with pytest.raises(mg.TraceError, match="boom"):
                trace(_Fails(), torch.randn(4, 8))
            assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()


class _Masked(nn.Module):
    def __init__(self, fill: bool) -> None:
        super().__init__()
        self.fill = fill

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fill:  # masked_fill has no mgraph op: the tracer fails after torch.export
            return x.masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), 0.0)
        return x * torch.ones(8, 8).tril()  # the mask is folded


def test_trace_leaves_the_intra_op_threads_as_it_found_them():
    # the tracer folds constants on one intra-op thread; the caller's count must survive,
    # also when the tracer (after torch.export) fails
    was = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        og = trace(_Masked(fill=False), torch.randn(8, 8))
        assert [n.op for n in og.nodes] == ["elementwise"] and og.constants
        assert torch.get_num_threads() == 2
        with pytest.raises(mg.UnsupportedOpError, match="masked_fill"):
            trace(_Masked(fill=True), torch.randn(8, 8))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(was)


def test_policy_input_reuses_topo_orders_tables():
    g = mg.ops.gemm_allreduce(M=64, N=64, K=64, topology="2x2", tile=[16, 16])
    costs = task_costs(g, H200)
    order = topo_order(g)
    assert isinstance(order, CounterOrder)
    signals = [0] * len(g.events)
    for t in g.tasks:
        for e in t.signals:
            signals[e] += 1
    assert order.total == signals and order.waits == [len(t.waits) for t in g.tasks]
    shared = policy_input(g, costs, order)
    built = policy_input(g, costs, list(order))  # a plain list: policy_input builds its own
    assert shared.released is order.released and built.released is not order.released
    for field in ("order", "pos", "full", "partial", "released", "waits"):
        assert getattr(shared, field) == getattr(built, field), field
    # dict order too: list_order visits waiters in this order
    assert [list(v) for v in shared.released.values()] == [list(v) for v in built.released.values()]
    assert list(shared.released) == list(built.released)
