"""The megakernel's CPU-testable parts: table encoding, layout, backend errors, and the kernel
itself under Triton's interpreter (in a subprocess: TRITON_INTERPRET must be set before import)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import mgraph as mg
from helpers import run_interpreted
from mgraph.kinds import ROLES
from mgraph.ops.abi import (
    F_KIND,
    F_NPARAM,
    F_NREAD,
    F_NWAIT,
    F_NWRITE,
    F_PARAM0,
    Q_STATIC,
    TASK_FIELDS,
)
from mgraph.runtime.megakernel import encode_rank, layout
from mgraph.runtime.megakernel.encode import ALIGN, ROLE_ALL, kind_id
from mgraph.runtime.megakernel.runtime import TritonRuntime

pytest.importorskip("triton")

HERE = Path(__file__).parent


def test_layout_is_aligned_and_disjoint():
    g = mg.ops.gemm_allreduce(M=64, N=96, K=64, topology="1x2", tile=[32, 32], dtype=torch.bfloat16)
    lay = layout(g)
    for r in range(2):
        spans = sorted(
            (lay.offset[b.id], lay.offset[b.id] + b.nbytes) for b in g.buffers.values() if b.rank == r
        )
        assert all(s % ALIGN == 0 for s, _ in spans)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
        assert spans[-1][1] <= lay.arena_bytes
    per_rank = [sum(1 for e in g.events if e.rank == r) for r in range(2)]
    assert lay.flag_count == max(per_rank)


def test_encoded_tables_cover_the_rank_schedule():
    # allgather_gemm with gather="copy": compute and NVLink queues both hold tasks
    g = mg.ops.allgather_gemm(M=64, N=64, K=64, topology="1x2", tile=[16, 16])
    sched = mg.schedule(g, workers={"compute": 6, "nvlink": 2})
    for rank in range(2):
        t = encode_rank(sched, rank)
        mine = [x.id for x in g.tasks if x.rank == rank]
        assert sorted(t.local_tasks) == sorted(mine)
        assert t.tasks.shape == (len(mine), TASK_FIELDS)
        for local, tid in enumerate(t.local_tasks):
            task = g.tasks[tid]
            row = t.tasks[local]
            assert int(row[F_KIND]) == kind_id(task.kind)
            assert int(row[F_NREAD]) == len(task.reads) and int(row[F_NWRITE]) == len(task.writes)
            assert int(row[F_NWAIT]) == len(task.waits)
        # Queues: each role's slice holds that role's tasks in schedule order.
        for i, role in enumerate(ROLES):
            off, n, workers, static = t.qinfo[i].tolist()
            queue = [t.local_tasks[x] for x in t.queues[off : off + n].tolist()]
            assert queue == sched.ranks[rank].queues[role.value]
            # the static prefix: every GEMM of the compute queue, the ones reading peers'
            # shards included (their waits are on NVLink copies that wait for nothing: hoisted
            # to their segment's start, one hoisted wait per event)
            if role.value == "compute":
                assert static == n and all(g.tasks[tid].kind == "gemm" for tid in queue)
                waited = {e for tid in queue for e, _ in g.tasks[tid].waits}
                assert len(waited) > 0 and t.segwaits.shape[0] == len(waited)
            else:
                assert static == 0
        assert t.qinfo[0][Q_STATIC] > 0
        assert t.roles.tolist() == [0] * 6 + [1] * 2
        # Regions point at slots naming the right buffers.
        first = t.local_tasks[0]
        slot = int(t.regions[int(t.tasks[0][1])][0])
        assert t.slots[slot] == g.tasks[first].reads[0].buffer


def test_single_program_mode_runs_everything_in_global_order():
    g = mg.ops.gemm_allreduce(M=64, N=64, K=64, topology="1x2", tile=[32, 32])
    sched = mg.schedule(g)
    t = encode_rank(sched, None, single_program=True)
    assert t.roles.tolist() == [ROLE_ALL]
    off, n, _, _ = t.qinfo[ROLE_ALL].tolist()
    assert n == len(g.tasks)
    assert t.local_tasks == sched.order()


def _segments(t):
    names = ("start", "len", "a", "b", "k0", "k1", "nw", "w0", "w1", "wait0", "nwait")
    return [dict(zip(names, row, strict=True))
            for row in t.segs.tolist()]


def test_gemm_segments_and_epilogue_writes():
    """One shot on 1x2: every GEMM tile stores into the local partial AND the peer's receive
    buffer (two TMA writes), one segment covers all of them; two shot: each rank's tiles for
    the peer come first and store only into the peer (a segment per destination), and the
    owner's sums store into the peer's output, which the peer waits for at exit."""
    kw = dict(M=256, N=512, K=256, topology="1x2", tile=[128, 256], dtype=torch.bfloat16)
    one = mg.ops.gemm_allreduce(**kw, algorithm="oneshot")
    one.validate()
    for rank in range(2):
        t = encode_rank(mg.schedule(one), rank)
        gemms = [x for x in one.tasks if x.rank == rank and x.kind == "gemm"]
        assert t.qinfo[0][Q_STATIC] == len(gemms) == 4
        (seg,) = _segments(t)
        assert seg["len"] == 4 and seg["nw"] == 2
        assert t.slots[seg["w0"]] == f"partial@{rank}"
        assert t.slots[seg["w1"]] == f"partial_from{rank}@{1 - rank}"
        assert not t.exit_events  # every peer store feeds a local sum that waits for it
    two = mg.ops.gemm_allreduce(**kw, algorithm="twoshot")
    two.validate()
    for rank in range(2):
        t = encode_rank(mg.schedule(two), rank)
        segs = _segments(t)
        assert [s["nw"] for s in segs] == [1, 1]
        # the peer's tiles first (straight into its receive buffer), then the rank's own
        assert t.slots[segs[0]["w0"]] == f"partial_from{rank}@{1 - rank}"
        assert t.slots[segs[1]["w0"]] == f"partial@{rank}"
        assert len(t.exit_events) == 1  # the peer's sums stored into this rank's output
        (slot, total), = t.exit_events
        assert total == 2  # half of the 4 tiles, each one store
    assert not any(x.role == "nvlink" for x in two.tasks)  # no copy task left on one node


def test_accumulate_reduce_adds_from_the_prefix():
    """On 2 GPUs the default GEMM+AR and GEMM+RS reduce-add every tile into zeroed outputs from
    the GEMM epilogue: no partial buffers, no sum tasks, only GEMMs in the static prefix, and
    each rank waits at exit for its peer's adds."""
    kw = dict(M=256, N=512, K=256, topology="1x2", tile=[128, 256], dtype=torch.bfloat16)
    for op in (mg.ops.gemm_allreduce, mg.ops.gemm_reduce_scatter):
        g = op(**kw)
        g.validate()
        assert {t.kind for t in g.tasks} == {"gemm"}
        assert all(t.params.get("accumulate") for t in g.tasks)
        assert all(b.zeroed for b in g.buffers.values() if b.role == "output")
        for rank in range(2):
            t = encode_rank(mg.schedule(g), rank)
            assert t.prefix_adds and t.qinfo[0][Q_STATIC] == t.qinfo[0][1]
            assert len(t.exit_events) == 1
    # more than 2 writes per task cannot use the TMA prefix: those tasks reduce-add from the
    # dynamic GEMM body (megakernel_interp.py runs "gemm_allreduce-1x4-accumulate")
    four = mg.ops.gemm_allreduce(M=256, N=512, K=512, topology="1x4", tile=[128, 256],
                                 algorithm="accumulate")
    t = encode_rank(mg.schedule(four), 0)
    assert t.qinfo[0][Q_STATIC] == 0 and t.qinfo[0][1] > 0


def test_reduce_scatter_pushes_ride_the_gemm_epilogues():
    g = mg.ops.gemm_reduce_scatter(M=512, N=512, K=256, topology="1x4", tile=[128, 256],
                                   dtype=torch.bfloat16)
    g.validate()
    assert not any(x.role == "nvlink" for x in g.tasks)
    t = encode_rank(mg.schedule(g), 1)
    segs = _segments(t)
    # destinations 2, 3, 0, then the rank's own rows: one segment each
    assert [t.slots[s["w0"]] for s in segs] == [
        "partial_from1@2", "partial_from1@3", "partial_from1@0", "partial@1"]
    st = g.stats()
    assert st.bytes_by_link["nvlink"] == 4 * 3 * (512 // 4) * 512 * 2  # 3/4 of every partial


def test_triton_backend_rejects_what_it_cannot_run():
    # a user op registered without triton=: its kind has no tile body
    @mg.register_op("test_mk_cpu_no_body", whole_rows=False)
    def no_body(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    g = no_body.opdef(topology="1x1", rows=32, cols=16)
    with pytest.raises(mg.ScheduleError, match="test_mk_cpu_no_body"):
        TritonRuntime(mg.schedule(g), interpret=True)
    # rows that are not whole 16-byte units are no longer refused: the GEMM body runs them by
    # pointers (tests/test_gemm_rows.py)
    odd = mg.ops.gemm(M=32, N=36, K=64, topology="1x1", tile=[16, 36], dtype=torch.bfloat16)
    TritonRuntime(mg.schedule(odd), interpret=True)
    # K below the K step (64) is no longer refused: TMA zero-fills past A's and B's ends
    # (megakernel_interp.py runs "gemm-1x1-small-k" against torch)
    small_k = mg.ops.gemm(M=32, N=32, K=32, topology="1x1", tile=[16, 16])
    TritonRuntime(mg.schedule(small_k), interpret=True)


def test_multi_rank_graph_needs_torchrun():
    g = mg.ops.gemm_allreduce(M=64, N=64, K=128, topology="1x2", tile=[32, 32])
    with pytest.raises(mg.MgraphError, match="torchrun"):
        TritonRuntime(mg.schedule(g), interpret=True)


@pytest.mark.slow
def test_megakernel_under_the_interpreter_matches_torch():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(HERE))
    proc = run_interpreted([str(HERE / "megakernel_interp.py")], env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 32, proc.stdout
    for row in rows:
        assert max(row["errors"]) < 1e-5, row
        if "epochs" in row:  # an op's case: relaunches of one runtime, each launch checked
            assert len(row["errors"]) == row["epochs"] >= 2, row
    # Multi-node: one runtime, 4 launches through the native proxy. Every net word ends at
    # epochs x its raises per launch (start words are not used by the single program), and the
    # proxy executed each launch's commands exactly once.
    net = next(r for r in rows if r["case"] == "network-epochs")
    for rank, words in net["words"].items():
        for w, (value, per) in enumerate(zip(words, net["per_launch"][rank], strict=True)):
            assert value == (0 if w in net["starts"][rank] else net["epochs"] * per), (rank, w)
    assert net["commands"] == net["epochs"] * net["per_launch_commands"]
    # A command the proxy refuses surfaces as the proxy's error, naming the command.
    bad = next(r for r in rows if r["case"] == "network-bad-command")
    assert bad["outcome"] == "ProxyError", bad
    assert "buf999" in bad["message"] and "has no buffer 999" in bad["message"], bad
    # A wait that never completes inside the kernel: the error record becomes a named
    # WatchdogTimeout that says which task waited for which event on which rank.
    # A kind defined outside mgraph (declared params, a Triton body) runs through the generated
    # dispatch, each task reading its own params.
    custom = next(r for r in rows if r["case"] == "custom-kind")
    assert custom["errors"][0] < 1e-6, custom
    # Per-buffer dtypes: float32 partials in a bfloat16 graph, read and written as float32 by a
    # body that takes bufdt; a copy between dtypes is refused before launch.
    # The controller in the kernel (Settings(adaptive=True), one program per worker): a program
    # ran tasks of both roles, every launch ran every task once (fresh data each launch), the
    # heads were reset at exit; without it the heads keep counting launches.
    adaptive = next(r for r in rows if r["case"] == "adaptive-roles")["runs"]
    assert adaptive["True"]["both"] and adaptive["True"]["decisions"] >= 12, adaptive
    assert adaptive["True"]["heads"][:2] == [0, 0], adaptive
    assert adaptive["False"]["both"] == [] and adaptive["False"]["heads"][:2] == [24, 24], adaptive
    mixed = next(r for r in rows if r["case"] == "mixed-dtypes")
    assert mixed["dtype"] == "torch.bfloat16" and mixed["mid_dtype"] == "torch.float32", mixed
    assert mixed["mid_error"] < 1e-6 and mixed["out_rel"] <= 2**-7, mixed  # one bf16 ulp
    assert "copy task" in mixed["refused"] and "between dtypes" in mixed["refused"], mixed
    dog = next(r for r in rows if r["case"] == "kernel-watchdog")
    assert dog["outcome"] == "WatchdogTimeout", dog
    assert f"event {dog['event']!r} (rank {dog['rank']})" in dog["message"], dog
    assert "task 'node-reduce" in dog["message"] and "value" in dog["message"], dog


def test_event_scopes_are_gpu_unless_they_cross_gpus():
    g = mg.ops.gemm_allreduce(M=64, N=64, K=64, topology="1x2", tile=[32, 32],
                              algorithm="twoshot")
    t = encode_rank(mg.schedule(g), 0)
    by_name = {g.tasks[tid].name: local for local, tid in enumerate(t.local_tasks)}

    def sig_flags(name):
        row = t.tasks[by_name[name]]
        return [int(t.signals[i][1]) for i in range(int(row[7]), int(row[7]) + int(row[8]))]

    def wait_flags(name):
        row = t.tasks[by_name[name]]
        return [int(t.waits[i][3]) for i in range(int(row[5]), int(row[5]) + int(row[6]))]

    mine = [g.tasks[tid] for tid in t.local_tasks]
    pushing = next(x for x in mine if x.kind == "gemm" and g.buffers[x.writes[0].buffer].rank == 1)
    keeping = next(x for x in mine if x.kind == "gemm" and g.buffers[x.writes[0].buffer].rank == 0)
    assert sig_flags(pushing.name) == [1]  # its epilogue stored into rank 1: system scope
    # the owner's sum waits on one event that a local and a remote GEMM raise: system scope
    assert sig_flags(keeping.name) == [1]
    reduce = next(x for x in mine if x.kind == "reduce")
    assert wait_flags(reduce.name) == [1]
    assert sig_flags(reduce.name) == [1]  # "landed" on the peer whose output it stored into
    # a single-GPU graph never needs system scope (attention's tasks wait on each other; a
    # GEMM+AR on one GPU is GEMM tiles alone)
    solo = mg.ops.ring_attention(topology="1x1", B=1, H=2, S=256, D=64, block=64, causal=True)
    ts = encode_rank(mg.schedule(solo), 0)
    assert set(ts.signals[:, 1].tolist()) == {0} and set(ts.waits[:, 3].tolist()) == {0}


def test_generated_dispatch_names_a_body_it_cannot_call():
    from mgraph.runtime.megakernel.dispatch import ABI_NAMES, _params_of, dispatch_source

    def body(tp, regions, scale_factor):  # 'scale_factor' is no value of the kernel's
        pass

    with pytest.raises(mg.RegistrationError, match="scale_factor"):
        _params_of("mine", body)
    block, _ = dispatch_source({"gemm": kind_id("gemm"), "copy": kind_id("copy")}, "    ")
    assert f"if kind == {kind_id('gemm')}:" in block and f"if kind == {kind_id('copy')}:" in block
    # every argument the generated call passes is an ABI value the kernel has in scope
    for line in block.splitlines():
        if "(" in line and "if kind" not in line:
            args = line[line.index("(") + 1 : line.rindex(")")].split(", ")
            assert set(args) <= set(ABI_NAMES), line


def test_task_params_are_packed_in_declared_order():
    import struct

    from mgraph.builder import GraphBuilder, piece
    from mgraph.kinds import KINDS, Role
    from mgraph.topology import Topology

    b = GraphBuilder("p", Topology.parse("1x1"), "float32", {})
    b.global_input("x", (16, 16))
    b.global_output("out", (16, 16))
    x = b.bound_buffer("x", 0, "x", [piece((16, 16))])
    out = b.bound_buffer("out", 0, "out", [piece((16, 16))], role="output")
    b.task(0, Role.COMPUTE, "copy", [x.region()], [out.region()], params={"alpha": 1.5, "n": 7})
    graph = b.finish()
    saved = KINDS["copy"].params
    KINDS["copy"].params = ("n", "alpha")  # as if copy declared two params
    try:
        t = encode_rank(mg.schedule(graph), 0)
        row = t.tasks[0]
        p0, n = int(row[F_PARAM0]), int(row[F_NPARAM])
        words = t.params[p0 : p0 + n].tolist()
        assert words == [7, struct.unpack("<i", struct.pack("<f", 1.5))[0]]
        graph.tasks[0].params = {"n": 7}
        with pytest.raises(mg.ScheduleError, match="no param 'alpha'"):
            encode_rank(mg.schedule(graph), 0)
    finally:
        KINDS["copy"].params = saved


def test_worst_tile_error_finds_one_bad_tile():
    from mgraph.runtime.memory import worst_tile_error

    want = torch.randn(512, 512)
    got = want + 1e-4 * torch.randn(512, 512)
    assert worst_tile_error(got, want) < 1e-3
    got[300:303, 40:43] += 1.0  # 9 wrong elements in one tile (a race in one tile)
    assert ((got - want).norm() / want.norm()).item() < 1e-2  # the whole-output norm passes it
    assert worst_tile_error(got, want) > 1e-2  # the tile check at the same tolerance does not
    got[0, 0] = float("nan")
    assert worst_tile_error(got, want) == float("inf")


def test_one_input_in_two_buffers_of_a_rank():
    """A rank may hold an input twice (a chunk and the whole): a single-process run fills each
    buffer with its own part; SPMD callers, who pass one tensor per name, get a named error."""
    from mgraph.builder import GraphBuilder, piece
    from mgraph.kinds import Role
    from mgraph.runtime.megakernel import local_shards

    b = GraphBuilder("twice", mg.Topology.parse("1x1"), "float32", {})
    b.global_input("x", (64, 16))
    b.global_output("out", (96, 16))
    part = b.bound_buffer("x_rows", 0, "x", [piece((64, 16), d0=(0, 32))])
    whole = b.bound_buffer("x_all", 0, "x", [piece((64, 16))])
    out = b.bound_buffer("out", 0, "out", [piece((96, 16))], role="output")
    b.task(0, Role.COMPUTE, "copy", [part.region()], [out.region((0, 32))], name="part")
    b.task(0, Role.COMPUTE, "copy", [whole.region()], [out.region((32, 96))], name="whole")
    g = b.finish()
    g.validate()
    rt = TritonRuntime(mg.schedule(g), interpret=True)
    x = torch.randn(64, 16)
    rt.load_inputs({"x": x})
    assert torch.equal(rt.views[part.id].reshape(32, 16), x[:32])
    assert torch.equal(rt.views[whole.id].reshape(64, 16), x)
    with pytest.raises(mg.InputError, match="two buffers"):
        local_shards(g, 0, {"x": x})
