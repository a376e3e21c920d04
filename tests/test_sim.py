"""The cluster simulator: conservation, busy <= wall, hand-computed critical paths, calibration
against GPU.md, Chrome timelines, determinism, the 2x8 timing bound, API and CLI."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch

import mgraph as mg
from mgraph.builder import GraphBuilder
from mgraph.cli import main
from mgraph.kinds import Role
from mgraph.runtime.sim import (
    Phase,
    collective_times,
    simulate,
    sweep_comm_sms,
    with_comm_sms,
)
from mgraph.runtime.sim.baselines import Stage, on_sms, pipeline
from mgraph.scheduler import Schedule

SMALL = {
    "gemm_allreduce": dict(M=256, N=256, K=256, tile=[64, 64], chunk_bytes=32768),
    "gemm_reduce_scatter": dict(M=256, N=256, K=256, tile=[32, 64], chunk_bytes=16384),
    "allgather_gemm": dict(M=256, N=256, K=128, tile=[32, 32], chunk_bytes=16384),
    "ring_attention": dict(B=1, H=2, S=256, D=32, causal=True),
    # groups of one expert: the fill what-if's small graph stays bound by its transfers
    "moe_dispatch_combine": dict(T=64, H=32, E=8, top_k=2, F=64, expert_group=1),
}


def small(op: str, topology: str = "2x2") -> Schedule:
    graph = mg.ops.get_op(op)(topology=topology, dtype=torch.bfloat16, **SMALL[op])
    return mg.schedule(graph)


# -- conservation ------------------------------------------------------------------------------
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("topology", ["1x2", "2x1", "2x4"])
@pytest.mark.parametrize("op", sorted(SMALL))
def test_conservation(op, topology, adaptive):
    sched = small(op, topology)
    res = simulate(sched, adaptive=adaptive)
    graph = sched.graph
    whole = simulate(sched, adaptive=adaptive, fill=lambda t: 1.0)  # every byte of every region
    assert whole.bytes_by_link == graph.stats().bytes_by_link
    # By default, MoE transfers that move only the routed rows (moe_move) cost their expected
    # share of the capacity-sized regions (params["expected_fill"]); every other byte is moved.
    routed = any(t.kind == "moe_move" for t in graph.tasks)
    assert (res.bytes_by_link["nvlink"] < whole.bytes_by_link["nvlink"]) == routed
    assert res.bytes_by_link["rdma"] == whole.bytes_by_link["rdma"]
    assert res.stats["rdma_bytes"] == sum(t.bytes for t in res.transfers)
    assert sorted(r.task for r in res.trace.records) == list(range(len(graph.tasks)))
    assert res.outputs == {} and res.wall_s == res.predicted_s > res.makespan_s > 0
    for tr in res.transfers:
        assert tr.posted <= tr.start < tr.end < tr.arrive <= res.makespan_s + 1e-12


@pytest.mark.parametrize("op", sorted(SMALL))
def test_busy_never_exceeds_wall(op):
    res = simulate(small(op, "2x4"), adaptive=op == "gemm_allreduce")
    lanes = defaultdict(list)
    for r in res.trace.records:
        assert 0 <= r.start <= r.end <= res.makespan_s + 1e-12, r
        lanes[(r.rank, r.worker)].append((r.start, r.end))  # one SM: one task at a time
    for spans in lanes.values():
        spans.sort()
        assert sum(e - s for s, e in spans) <= res.makespan_s + 1e-12
        for (_, e0), (s1, _) in zip(spans, spans[1:], strict=False):
            assert s1 >= e0 - 1e-12
    for rank_busy in res.busy:
        assert all(0 < v <= 1 + 1e-9 for v in rank_busy.values()), rank_busy


@pytest.mark.parametrize("op", ["gemm_reduce_scatter", "gemm_allreduce"])
def test_busy_counts_sm_time_not_the_epilogue_stores_drain(op):
    """On one node the GEMM epilogues store (or reduce-add) into peers: a task's record ends when
    its stores have drained, after its SM has moved on, so record spans overlap on one SM; the
    busy fraction counts the SM's time only, never more than the SMs held."""
    graph = mg.ops.get_op(op)(topology="1x2", dtype=torch.bfloat16, M=2048, N=8192, K=8192)
    res = simulate(mg.schedule(graph))
    lanes = defaultdict(list)
    for r in res.trace.records:
        lanes[(r.rank, r.worker)].append((r.start, r.end))
    overlap = any(s1 < e0 - 1e-12 for spans in lanes.values()
                  for (_, e0), (s1, _) in zip(sorted(spans), sorted(spans)[1:], strict=False))
    assert overlap, "the case must have tasks whose stores drain after their SM moved on"
    for rank_busy in res.busy:
        assert all(0 < v <= 1 + 1e-9 for v in rank_busy.values()), rank_busy


# -- critical paths on hand graphs, one worker per role ------------------------------------------
# Round numbers: 1 GFLOP/s and 1 GB/s per SM (an NVLink worker pulls at 1 GB/s and pushes at 2),
# so a 64x64x64 gemm takes 524.288 us.
HW = mg.HardwareProfile.model_validate(
    mg.H200.model_dump()
    | dict(
        name="toy", sms=4, tile_gemm_tflops=0.004, hbm_gbps=4.0, nvlink_push_gbps=2.0,
        nvlink_worker_gbps=1.0, nvlink_worker_push_gbps=2.0, nvlink_gbps=100.0, rdma_gbps=1.0, rdma_latency_us=3.0,
        proxy_command_us=5.0, rdma_chunk_us=0.5, fifo_push_us=2.0, nvlink_latency_us=10.0,
        launch_us=0.0, multi_gpu_launch_us=0.0, nvlink_beside_compute=1.0, sources={},
    )
)  # fmt: skip
GEMM_US = 2 * 64**3 / 1e9 * 1e6  # 524.288
TILE_BYTES = 64 * 64 * 4  # 16384: 16.384 us at 1 GB/s


def chain(topology: str, link: Role, mover: int = 0) -> mg.TaskGraph:
    """gemm on rank 0 -> copy to rank 1 over ``link`` by a worker of rank ``mover`` (0: it
    writes into the peer, 1: it reads from the peer) -> reduce (memory bound) on rank 1."""
    b = GraphBuilder("hand", mg.Topology.parse(topology), "float32", {})
    x0, y0 = b.buffer("x", 0, 64, 64), b.buffer("y", 0, 64, 64)
    y1, z1 = b.buffer("y", 1, 64, 64), b.buffer("z", 1, 64, 64)
    g = b.task(0, Role.COMPUTE, "gemm", [x0.region(), x0.region()], [y0.region()])
    c = b.task(mover, link, "copy", [y0.region()], [y1.region()], waits=b.after(mover, [g]))
    b.task(1, Role.COMPUTE, "reduce", [y1.region()], [z1.region()], waits=b.after(1, [c]))
    return b.finish().validate()


def one_each(graph: mg.TaskGraph) -> Schedule:
    return mg.schedule(graph, HW, workers={"compute": 1, "nvlink": 1, "rdma": 1})


@pytest.mark.parametrize("mover", [0, 1])
def test_nvlink_worker_slows_while_its_gpu_has_compute_left(mover):
    """``nvlink_beside_compute``: a worker whose GPU still has compute tasks (here rank 1's
    reduce, claimed and waiting for the copy) moves at that fraction of its alone rate; a worker
    whose GPU's compute is all done (rank 0 after its gemm) at the alone rate. The scheduler's
    cost model slows every NVLink task of a rank with compute tasks (the static partition)."""
    from mgraph.scheduler.costmodel import task_costs

    hw = HW.model_copy(update={"nvlink_beside_compute": 0.5})
    graph = chain("1x2", Role.NVLINK, mover)
    sched = mg.schedule(graph, hw, workers={"compute": 1, "nvlink": 1, "rdma": 1})
    res = simulate(sched, hardware=hw, baselines=False)
    alone = TILE_BYTES / 1e3 / (2.0 if mover == 0 else 1.0)
    copy = alone if mover == 0 else alone / 0.5
    assert res.predicted_s * 1e6 == pytest.approx(GEMM_US + copy + 10.0 + 32.768, rel=1e-9)
    cost = next(c for t, c in zip(graph.tasks, task_costs(graph, hw), strict=True)
                if t.role == "nvlink")  # fmt: skip
    assert cost * 1e6 == pytest.approx(alone / 0.5, rel=1e-12)  # both ranks have compute
    b = GraphBuilder("hand", mg.Topology.parse("1x2"), "float32", {})  # a copy, no compute
    y0, y1 = b.buffer("y", 0, 64, 64), b.buffer("y", 1, 64, 64)
    b.task(1, Role.NVLINK, "copy", [y0.region()], [y1.region()])
    g2 = b.finish().validate()
    assert task_costs(g2, hw)[0] * 1e6 == pytest.approx(TILE_BYTES / 1e3, rel=1e-12)
    res2 = simulate(mg.schedule(g2, hw, workers={"compute": 0, "nvlink": 1, "rdma": 0}),
                    hardware=hw, baselines=False)  # fmt: skip
    assert res2.predicted_s * 1e6 == pytest.approx(TILE_BYTES / 1e3, rel=1e-9)


def test_slowed_flows_keep_the_bytes_they_moved():
    """FlowNet.set_demands re-rates a flow in flight: what it moved at the old rate stays moved."""
    from mgraph.runtime.sim.flows import Flow, FlowNet

    net = FlowNet([10.0])
    f = Flow(0, 100.0, 5.0, ((0, 1.0),))
    net.start(f, 0.0)
    assert f.finish_time() == pytest.approx(20.0)
    (changed,) = net.set_demands([f], [2.5], 4.0)  # 20 bytes moved, 80 left at 2.5/s
    assert changed is f and f.finish_time() == pytest.approx(4.0 + 32.0)
    g = Flow(1, 100.0, 8.0, ((0, 1.0),))
    net.start(g, 4.0)  # port load 10.5 > 10: both scaled by 10/10.5
    net.set_demands([f], [5.0], 4.0)  # load 13: both scaled by 10/13
    assert f.rate == pytest.approx(5.0 * 10 / 13) and g.rate == pytest.approx(8.0 * 10 / 13)


@pytest.mark.parametrize("mover", [0, 1])
def test_critical_path_nvlink_chain(mover):
    res = simulate(one_each(chain("1x2", Role.NVLINK, mover)), baselines=False)
    # gemm + NVLink copy (rank 0 pushes at 2 GB/s, rank 1 pulls at 1 GB/s) + reduce (2 x 16 KiB
    # at 1 GB/s); the gemm's flag to a puller on rank 1, or the pusher's to the reduce, crosses
    # NVLink once (10 us)
    copy = TILE_BYTES / 1e3 / (2.0 if mover == 0 else 1.0)
    want = GEMM_US + copy + 10.0 + 32.768
    assert res.predicted_s * 1e6 == pytest.approx(want, rel=1e-9)


def test_critical_path_rdma_chain():
    res = simulate(one_each(chain("2x1", Role.RDMA)), baselines=False)
    # gemm + FIFO push + proxy command + NIC work + wire at 1 GB/s + latency + reduce
    want = GEMM_US + 2.0 + 5.0 + 0.5 + 16.384 + 3.0 + 32.768
    assert res.predicted_s * 1e6 == pytest.approx(want, rel=1e-9)
    (tr,) = res.transfers
    assert tr.bytes == TILE_BYTES and tr.end - tr.start == pytest.approx(16.384e-6)


@pytest.mark.parametrize("workers, waves", [(1, 3), (2, 2), (3, 2)])
def test_critical_path_join(workers, waves):
    """Two independent gemms, then a gemm reading both: 3 gemm times on one worker, 2 on more."""
    b = GraphBuilder("hand", mg.Topology.parse("1x1"), "float32", {})
    x = b.buffer("x", 0, 64, 64)
    ys = [b.buffer(f"y{i}", 0, 64, 64) for i in range(3)]
    g1 = b.task(0, Role.COMPUTE, "gemm", [x.region(), x.region()], [ys[0].region()])
    g2 = b.task(0, Role.COMPUTE, "gemm", [x.region(), x.region()], [ys[1].region()])
    b.task(0, Role.COMPUTE, "gemm", [ys[0].region(), ys[1].region()], [ys[2].region()],
           waits=b.after(0, [g1, g2]))  # fmt: skip
    sched = mg.schedule(b.finish().validate(), HW, workers={"compute": workers})
    assert simulate(sched).predicted_s * 1e6 == pytest.approx(waves * GEMM_US, rel=1e-9)


def test_flows_share_the_push_rate():
    """Two concurrent NVLink copies on two workers share the GPU's 2 GB/s issue port: 1 GB/s
    each, as one worker alone would get; with a 1 GB/s port they take twice as long."""
    b = GraphBuilder("hand", mg.Topology.parse("1x2"), "float32", {})
    src = [b.buffer(f"s{i}", 0, 64, 64) for i in range(2)]
    dst = [b.buffer(f"d{i}", 1, 64, 64) for i in range(2)]
    for s, d in zip(src, dst, strict=True):
        b.task(0, Role.NVLINK, "copy", [s.region()], [d.region()])
    graph = b.finish().validate()
    for push_gbps, want_us in ((2.0, 16.384), (1.0, 32.768)):
        hw = HW.model_copy(update={"nvlink_push_gbps": push_gbps})  # 1 GB/s per worker
        sched = mg.schedule(graph, hw, workers={"nvlink": 2})
        assert simulate(sched).predicted_s * 1e6 == pytest.approx(want_us)


# -- calibration against GPU.md (the team's H200 notes) (bf16, 2 GPUs of one node) -----------------------------
def within(got_s: float, lo_ms: float, hi_ms: float | None = None, tol: float = 0.10) -> bool:
    hi_ms = lo_ms if hi_ms is None else hi_ms
    return lo_ms * (1 - tol) <= got_s * 1e3 <= hi_ms * (1 + tol)


def test_calibration_gemm_allreduce():
    graph = mg.ops.gemm_allreduce(M=8192, N=8192, K=8192, topology="1x2", dtype=torch.bfloat16)
    res = simulate(mg.schedule(graph))  # per GPU 8192x8192x4096, as GPU.md measured
    seq = res.baseline("sequential")
    assert within(seq.parts["compute_s"], 0.74, 0.77)  # cuBLAS 8192x8192x4096
    assert within(seq.parts["comm_s"], 0.52)  # NCCL all_reduce 128 MB
    assert within(seq.time_s, 1.23)  # cuBLAS then NCCL
    # The fused kernel cannot beat the GEMM alone. How it compares with sequential is what the
    # GPU measured, checked against the committed predictions in test_profile.py.
    assert seq.parts["compute_s"] < res.predicted_s


def test_calibration_collectives():
    topo = mg.Topology.parse("1x2")
    ar = collective_times("all_reduce", 64 * 2**20, topo, mg.H200)
    assert within(min(ar.values()), 0.30)  # NCCL all_reduce 64 MB: 0.30 ms


@pytest.mark.parametrize(
    "op, kw, measured_ms",
    [
        ("gemm_reduce_scatter", dict(M=8192, N=8192, K=8192), 1.09),  # matmul + NCCL RS
        ("allgather_gemm", dict(M=8192, N=16384, K=4096), 0.89),  # NCCL AG + matmul
    ],
)
def test_calibration_sequential_baselines(op, kw, measured_ms):
    graph = mg.ops.get_op(op)(topology="1x2", dtype=torch.bfloat16, **kw)
    assert within(simulate(mg.schedule(graph)).baseline("sequential").time_s, measured_ms)


def test_calibration_ring_attention():
    """FA2 + NCCL P2P ring, overlapped, S=32768 over 2 GPUs: 54.3 ms (compute bound 49.3)."""
    graph = mg.ops.ring_attention(B=4, H=16, S=32768, D=128, block=4096, topology="1x2",
                                  dtype=torch.bfloat16)  # fmt: skip
    res = simulate(mg.schedule(graph))
    assert within(res.baseline("overlap").time_s, 54.3)


# -- timelines, determinism, speed ---------------------------------------------------------------
def test_chrome_timeline_is_valid(tmp_path):
    res = simulate(small("gemm_allreduce", "2x2"))
    path = tmp_path / "t.json"
    res.save_timeline(path)
    doc = json.loads(path.read_text())
    named, spans = set(), defaultdict(list)
    for ev in doc["traceEvents"]:
        assert {"ph", "name", "pid"} <= set(ev)
        if ev["ph"] == "M" and ev["name"] == "thread_name":
            assert (ev["pid"], ev["tid"]) not in named
            named.add((ev["pid"], ev["tid"]))
        elif ev["ph"] == "X":
            assert {"tid", "ts", "dur", "cat"} <= set(ev) and ev["dur"] >= 0
            spans[(ev["pid"], ev["tid"])].append((ev["ts"], ev["ts"] + ev["dur"]))
    assert set(spans) <= named  # every lane is named
    lanes = {(r.rank, r.role, r.worker) for r in res.trace.records}
    nics = {(t.src, t.dst) for t in res.transfers}
    assert len(named) == len(lanes) + len(nics)  # one lane per rank and worker, one per NIC pair
    for s in spans.values():  # lanes never overlap themselves
        s.sort()
        assert all(b[0] >= a[1] - 1e-6 for a, b in zip(s, s[1:], strict=False))
    assert doc["otherData"]["backend"] == "sim"


def test_deterministic_and_json_round_trip():
    sched = small("moe_dispatch_combine", "2x4")
    a, b = simulate(sched), simulate(Schedule.from_json(sched.to_json()))
    assert a.predicted_s == b.predicted_s
    assert [(r.task, r.worker, r.start, r.end) for r in a.trace.records] == [
        (r.task, r.worker, r.start, r.end) for r in b.trace.records
    ]
    c, d = simulate(sched, adaptive=True), simulate(sched, adaptive=True)
    assert c.predicted_s == d.predicted_s


def test_2x8_gemm_allreduce_moves_d_per_node():
    """The 45k-task 2x8 case simulates and moves D per node over RDMA (its simulation time is
    a benchmark's business: timed CPU tests fail under load)."""
    graph = mg.ops.gemm_allreduce(M=8192, N=8192, K=4096, topology="2x8", dtype=torch.bfloat16)
    res = simulate(mg.schedule(graph))
    assert res.bytes_by_link["rdma"] == 8192 * 8192 * 2 * 2  # D per node, 2 nodes


# -- API, sweep, baselines, CLI ----------------------------------------------------------------
def test_run_api_needs_no_inputs():
    graph = mg.ops.gemm_allreduce(topology="2x2", **SMALL["gemm_allreduce"])
    slow = mg.H200.model_copy(update={"rdma_gbps": 5.0})
    fast_res = mg.run(graph, backend="sim")
    slow_res = mg.run(graph, backend="sim", hardware=slow)
    assert slow_res.hardware is slow and slow_res.wall_s > fast_res.wall_s
    with pytest.raises(mg.UnknownNameError):
        fast_res.baseline("nccl_magic")


def test_sweep_and_comm_sms():
    # The gather's NVLink copies (gemm_allreduce's node pushes ride on its GEMM epilogues now)
    sched = small("allgather_gemm", "1x2")
    points = sweep_comm_sms(sched, [1, 4, 8])
    assert [p.comm_sms for p in points] == [1, 4, 8]
    assert points[0].predicted_s > points[1].predicted_s  # one nvlink SM is too few
    assert with_comm_sms(sched, 8).ranks[0].workers == {"compute": 124, "nvlink": 8, "rdma": 0}
    with pytest.raises(mg.ScheduleError):
        with_comm_sms(sched, 132)


def test_baseline_pipeline_rules():
    assert on_sms([1.0] * 10, 4) == 3.0 and on_sms([3.0, 1.0, 1.0, 1.0], 2) == 3.0
    # compute 2 s alone (3 s beside comm), comm 1 s after it: nothing overlaps.
    assert pipeline([Stage("compute", 2, 3, -1), Stage("comm", 1, 1, 0)], [0, 1]) == 3.0
    # Independent: for 1 s both run (compute does 1/3 of its work), then 2/3 alone at 2 s each.
    t = pipeline([Stage("compute", 2, 3, -1), Stage("comm", 1, 1, -1)], [0, 1])
    assert t == pytest.approx(1 + (1 - 1 / 3) * 2)
    for op in SMALL:  # one chunk is the sequential schedule (not so for the ring's p2p steps)
        if op != "ring_attention":
            res = simulate(small(op, "2x2"))
            seq = res.baseline("sequential").time_s
            assert res.baseline("overlap").time_s <= seq * (1 + 1e-9)
    assert Phase("compute").tiles == ()


def test_cli_simulate(tmp_path, capsys):
    trace, out = tmp_path / "t.json", tmp_path / "s.json"
    argv = [
        "simulate",
        "--op",
        "gemm_allreduce",
        "--shape",
        "256,256,256",
        "--topology",
        "2x2",
        "--set",
        "tile=[64,64]",
        "--sweep-comm-sms",
        "--trace",
        str(trace),
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "fused megakernel" in text and "best static split" in text and "sequential" in text
    doc = json.loads(out.read_text())
    assert doc["predicted_ms"] > 0 and doc["sweep"] and json.loads(trace.read_text())
    assert main(["simulate", "--op", "gemm_allreduce", "--shape", "256,256,256",
                 "--topology", "2x2", "--comm-sms", "8"]) == 0  # fmt: skip


def test_fill_what_if_and_old_profile_json():
    sched = small("moe_dispatch_combine", "2x2")
    # every byte against half of every byte (the default fill is each task's expected_fill,
    # below 1 for MoE's capacity-sized moves: half would move more than the default there)
    full, half = simulate(sched, fill=lambda task: 1.0), simulate(sched, fill=lambda task: 0.5)
    stats = sched.graph.stats().bytes_by_link
    assert half.bytes_by_link == {k: v / 2 for k, v in stats.items()}
    assert half.predicted_s < full.predicted_s
    # A profile saved before the simulator's constants existed still loads, with the defaults;
    # the old names of the NVLink worker constants are migrated (one cap: nvlink_max_sms).
    doc = json.loads(mg.H200.model_dump_json())
    for key in ("launch_us", "nccl_nvlink_gbps", "grouped_gemm_tflops", "nccl_sms", "sources"):
        del doc[key]
    doc["nvlink_task_gbps"] = doc.pop("nvlink_worker_gbps")
    del doc["nvlink_worker_push_gbps"]
    doc["nvlink_push_sms"] = 16
    old = mg.HardwareProfile.model_validate(doc)
    fields = mg.HardwareProfile.model_fields
    for key in ("launch_us", "nccl_nvlink_gbps", "grouped_gemm_tflops", "nccl_sms"):
        assert getattr(old, key) == fields[key].default
    assert old.nvlink_worker_gbps == mg.H200.nvlink_worker_gbps
    # one NVLink worker rate then: it costs pushes too
    assert old.nvlink_worker_push_gbps == old.nvlink_worker_gbps != mg.H200.nvlink_worker_push_gbps
    assert old.nvlink_push_sms == old.nvlink_max_sms == mg.H200.nvlink_max_sms


def test_deadlocked_queues_raise():
    """A queue that lists a consumer before its producer stalls the single worker: the simulator
    says so (as the reference runtime's watchdog would) instead of returning a time."""
    b = GraphBuilder("hand", mg.Topology.parse("1x1"), "float32", {})
    x, y, z = (b.buffer(n, 0, 64, 64) for n in "xyz")
    g1 = b.task(0, Role.COMPUTE, "gemm", [x.region(), x.region()], [y.region()])
    b.task(0, Role.COMPUTE, "gemm", [y.region(), y.region()], [z.region()], waits=b.after(0, [g1]))
    good = mg.schedule(b.finish().validate(), HW, workers={"compute": 1})
    rank = good.ranks[0].model_copy(update={"queues": {"compute": [1, 0], "nvlink": [], "rdma": []}})
    bad = Schedule(graph=good.graph, hardware=HW, policy="broken", ranks=[rank])
    with pytest.raises(mg.ScheduleError, match="stalled after 0 of 2"):
        simulate(bad)
