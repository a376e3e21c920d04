"""The megakernel's CPU-testable parts: table encoding, layout, backend errors, and the kernel
itself under Triton's interpreter (in a subprocess: TRITON_INTERPRET must be set before import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mgraph as mg
from mgraph.kinds import ROLES
from mgraph.ops.abi import F_KIND, F_NREAD, F_NWAIT, F_NWRITE, TASK_FIELDS
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
    g = mg.ops.gemm_allreduce(M=64, N=96, K=64, topology="1x2", tile=[32, 32])
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
            off, n, workers = t.qinfo[i].tolist()
            queue = [t.local_tasks[x] for x in t.queues[off : off + n].tolist()]
            assert queue == sched.ranks[rank].queues[role.value]
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
    off, n, _ = t.qinfo[ROLE_ALL].tolist()
    assert n == len(g.tasks)
    assert t.local_tasks == sched.order()


def test_triton_backend_rejects_what_it_cannot_run():
    ring = mg.ops.ring_attention(B=1, H=1, S=32, D=16, topology="1x1")
    with pytest.raises(mg.ScheduleError, match="attn_block"):
        TritonRuntime(mg.schedule(ring), interpret=True)
    odd = mg.ops.gemm(M=32, N=36, K=64, topology="1x1", tile=[16, 36], dtype=torch.bfloat16)
    with pytest.raises(mg.ScheduleError, match="16 bytes"):
        TritonRuntime(mg.schedule(odd), interpret=True)
    small_k = mg.ops.gemm(M=32, N=32, K=32, topology="1x1", tile=[16, 16])
    with pytest.raises(mg.ScheduleError, match="multiple of 64"):
        TritonRuntime(mg.schedule(small_k), interpret=True)


def test_multi_rank_graph_needs_torchrun():
    g = mg.ops.gemm_allreduce(M=64, N=64, K=128, topology="1x2", tile=[32, 32])
    with pytest.raises(mg.MgraphError, match="torchrun"):
        TritonRuntime(mg.schedule(g), interpret=True)


def test_megakernel_under_the_interpreter_matches_torch():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(HERE))
    proc = subprocess.run(
        [sys.executable, str(HERE / "megakernel_interp.py")], env=env, capture_output=True,
        text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 13, proc.stdout
    for row in rows:
        assert max(row["errors"]) < 1e-5, row
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


def test_event_scopes_are_gpu_unless_they_cross_gpus():
    g = mg.ops.gemm_allreduce(M=64, N=64, K=64, topology="1x2", tile=[32, 32])
    t = encode_rank(mg.schedule(g), 0)
    by_name = {g.tasks[tid].name: local for local, tid in enumerate(t.local_tasks)}
    def sig_flags(name):
        row = t.tasks[by_name[name]]
        return [int(t.signals[i][1]) for i in range(int(row[7]), int(row[7]) + int(row[8]))]
    def wait_flags(name):
        row = t.tasks[by_name[name]]
        return [int(t.waits[i][3]) for i in range(int(row[5]), int(row[5]) + int(row[6]))]
    push = next(n for n in by_name if n.startswith("push r0->r1"))
    gemm_feeding_push = next(
        g.tasks[tid].name for tid in t.local_tasks
        if g.tasks[tid].kind == "gemm" and g.tasks[tid].writes[0][1:] == g.tasks[
            t.local_tasks[by_name[push]]].reads[0][1:]
    )
    assert sig_flags(gemm_feeding_push) == [0]  # its consumer (the push) runs on this GPU
    assert wait_flags(push) == [0]
    assert sig_flags(push) == [1]  # raises the owner's event on the other GPU
    reduce = next(n for n in by_name if n.startswith("node-reduce"))
    assert 1 in wait_flags(reduce)  # waits for a peer's push: system scope
