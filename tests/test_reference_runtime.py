"""The CPU reference runtime: five ops against torch, relaunches, watchdog, traces."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mgraph as mg
from helpers import rel_err
from mgraph.runtime.reference import ReferenceRuntime
from mgraph.scheduler import schedule
from mgraph.settings import Settings

SMALL = {
    "gemm_allreduce": dict(M=64, N=96, K=32, tile=[16, 32], chunk_bytes=2048),
    "gemm_reduce_scatter": dict(M=64, N=64, K=32, tile=[8, 32], chunk_bytes=1024),
    "allgather_gemm": dict(M=64, N=64, K=32, tile=[8, 16], chunk_bytes=1024),
    "ring_attention": dict(B=1, H=2, S=64, D=16, causal=True),
    "moe_dispatch_combine": dict(T=32, H=16, E=8, top_k=2, F=32),
}


def run_and_check(graph, seed=0, tol=1e-4, policy="critical_path"):
    op = mg.ops.get_op(graph.op)
    inputs = op.random_inputs(graph, seed=seed)
    result = mg.run(schedule(graph, policy=policy), inputs, backend="reference")
    want = op.run_reference(inputs, graph.params)
    for name in graph.outputs:
        err = rel_err(result.outputs[name], want[name])
        assert err < tol, f"{graph.op} {graph.topology} {name}: rel err {err}"
    return result


@pytest.mark.parametrize("topology", ["1x2", "2x1", "2x2", "2x4"])
@pytest.mark.parametrize("op", sorted(SMALL))
def test_ops_match_torch(op, topology):
    graph = mg.ops.get_op(op)(topology=topology, **SMALL[op])
    result = run_and_check(graph)
    if graph.topology.nodes > 1 and graph.stats().bytes_by_link["rdma"]:
        # Every RDMA byte of the graph went through a FIFO + proxy.
        assert result.stats["rdma_bytes"] == graph.stats().bytes_by_link["rdma"]
        assert result.stats["commands"] >= sum(1 for t in graph.tasks if t.role == "rdma")


@pytest.mark.parametrize("policy", ["topological", "critical_path", "remote_first"])
def test_policies_all_run(policy):
    graph = mg.ops.gemm_allreduce(topology="2x2", **SMALL["gemm_allreduce"])
    run_and_check(graph, policy=policy)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mt=st.integers(1, 3), nt=st.integers(1, 3), kw=st.integers(1, 3), seed=st.integers(0, 99),
    topology=st.sampled_from(["1x2", "2x1", "2x2"]),
)
def test_gemm_allreduce_drawn_shapes(mt, nt, kw, seed, topology):
    world = mg.Topology.parse(topology).world_size
    graph = mg.ops.gemm_allreduce(
        M=16 * mt, N=8 * nt * 3, K=world * kw, topology=topology, tile=[16, 8], chunk_bytes=512,
    )
    run_and_check(graph, seed=seed)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    s_blocks=st.integers(1, 3), heads=st.integers(1, 2), causal=st.booleans(),
    topology=st.sampled_from(["1x2", "2x1", "2x2"]),
)
def test_ring_attention_drawn_shapes(s_blocks, heads, causal, topology):
    world = mg.Topology.parse(topology).world_size
    S = 2 * world * 8 * s_blocks
    graph = mg.ops.ring_attention(B=1, H=heads, S=S, D=8, causal=causal, topology=topology)
    run_and_check(graph)


def test_rejected_shapes_raise_named_errors():
    with pytest.raises(mg.ShapeError, match="gemm_allreduce"):
        mg.ops.gemm_allreduce(M=64, N=64, K=30, topology="2x2")
    with pytest.raises(mg.ShapeError, match="ring_attention"):
        mg.ops.ring_attention(B=1, H=1, S=60, D=8, causal=True, topology="2x2")


def test_relaunch_100_times_without_reset():
    graph = mg.ops.gemm_allreduce(topology="2x2", **SMALL["gemm_allreduce"])
    op = mg.ops.get_op(graph.op)
    rt = ReferenceRuntime(schedule(graph))
    for i in range(100):
        inputs = op.random_inputs(graph, seed=i)  # new data each launch: stale results would show
        result = rt.run(inputs)
        want = op.run_reference(inputs, graph.params)["out"]
        assert rel_err(result.outputs["out"], want) < 1e-4, f"launch {i}"
        assert result.epoch == i + 1
    # Counters were never reset: each event now holds 100 launches' worth of signals.
    some = next(e for e in range(len(graph.events)) if rt.total_signals[e])
    assert rt.counters.values[some] == 100 * rt.total_signals[some]


def test_missing_signal_trips_the_watchdog_fast():
    # twoshot: a GEMM's signal feeds the owner's sum (the default on 2 GPUs, accumulate, has
    # GEMMs only, whose signals nothing waits for on the CPU)
    graph = mg.ops.gemm_allreduce(topology="1x2", M=32, N=32, K=32, tile=[16, 16],
                                  algorithm="twoshot")
    sched = schedule(graph)
    victim = next(t for t in graph.tasks if t.kind == "gemm" and t.signals)
    event = victim.signals.pop()  # deliberately drop one signal after scheduling
    rt = ReferenceRuntime(sched, Settings(watchdog_s=1.0))
    start = time.perf_counter()
    with pytest.raises(mg.WatchdogTimeout) as info:
        rt.run(mg.ops.get_op(graph.op).random_inputs(graph))
    assert time.perf_counter() - start < 5
    msg = str(info.value)
    ev = graph.events[event]
    assert f"event {ev.name!r}" in msg and f"rank {ev.rank}" in msg
    assert "worker" in msg and "value" in msg and "target" in msg and "task '" in msg


def test_failing_tile_body_names_the_task():
    graph = mg.ops.gemm_allreduce(topology="1x2", M=32, N=32, K=32, tile=[16, 16])
    sched = schedule(graph)
    bad = next(t for t in graph.tasks if t.kind == "gemm")
    bad.reads[1] = bad.reads[1]._replace(row0=0, row1=3)  # wrong inner dimension
    with pytest.raises(mg.MgraphError, match=re.escape(f"task '{bad.name}'")):
        ReferenceRuntime(sched, Settings(watchdog_s=2.0)).run(
            mg.ops.get_op(graph.op).random_inputs(graph)
        )


def test_input_errors_before_launch():
    graph = mg.ops.gemm_allreduce(topology="1x2", M=32, N=32, K=32, tile=[16, 16])
    sched = schedule(graph)
    a, b = torch.randn(32, 32), torch.randn(32, 32)
    with pytest.raises(mg.InputError, match="missing \\['b'\\]"):
        mg.run(sched, {"a": a})
    with pytest.raises(mg.InputError, match="shape"):
        mg.run(sched, {"a": torch.randn(16, 32), "b": b})
    with pytest.raises(mg.DTypeError, match="bfloat16"):
        mg.run(sched, {"a": a.bfloat16(), "b": b})
    with pytest.raises(mg.UnknownNameError, match="reference"):
        mg.run(sched, {"a": a, "b": b}, backend="cuda-magic")


def test_trace_exports_chrome_json(tmp_path):
    graph = mg.ops.gemm_allreduce(topology="2x2", **SMALL["gemm_allreduce"])
    result = run_and_check(graph)
    assert len(result.trace.records) == len(graph.tasks)
    assert {r.task for r in result.trace.records} == set(range(len(graph.tasks)))
    for r in result.trace.records:
        assert 0 <= r.start <= r.end
        assert graph.tasks[r.task].rank == r.rank and graph.tasks[r.task].role == r.role
    path = tmp_path / "t.json"
    result.trace.save(path)
    doc = json.loads(path.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(graph.tasks)
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mt=st.integers(1, 3), nt=st.integers(1, 3), kw=st.integers(1, 3), seed=st.integers(0, 99),
    topology=st.sampled_from(["1x2", "2x1", "2x2"]),
)
def test_gemm_reduce_scatter_drawn_shapes(mt, nt, kw, seed, topology):
    world = mg.Topology.parse(topology).world_size
    graph = mg.ops.gemm_reduce_scatter(
        M=world * 8 * mt, N=8 * nt * 3, K=world * kw, topology=topology, tile=[8, 8],
        chunk_bytes=512,
    )
    run_and_check(graph, seed=seed)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mt=st.integers(1, 3), nt=st.integers(1, 3), k=st.integers(1, 24), seed=st.integers(0, 99),
    topology=st.sampled_from(["1x2", "2x1", "2x2"]),
)
def test_allgather_gemm_drawn_shapes(mt, nt, k, seed, topology):
    world = mg.Topology.parse(topology).world_size
    graph = mg.ops.allgather_gemm(
        M=world * 8 * mt, N=world * 8 * nt, K=k, topology=topology, tile=[8, 8], chunk_bytes=512,
    )
    run_and_check(graph, seed=seed)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    tokens=st.integers(1, 3), experts=st.integers(1, 3), top_k=st.integers(1, 3),
    hidden=st.sampled_from([8, 24]), seed=st.integers(0, 99),
    topology=st.sampled_from(["1x2", "2x1", "2x2"]),
)
def test_moe_drawn_shapes(tokens, experts, top_k, hidden, seed, topology):
    world = mg.Topology.parse(topology).world_size
    E = world * experts
    graph = mg.ops.moe_dispatch_combine(
        T=world * 8 * tokens, H=hidden, E=E, top_k=min(top_k, E), F=16, topology=topology,
    )
    run_and_check(graph, seed=seed)
