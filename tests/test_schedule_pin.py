"""Single-node schedules are pinned: the order and SM partition that ``mg.schedule`` gives the
three fused ops at 1x2 (the configurations benchmarked on 2 H200) must not move when the
scheduler or the simulator changes for multi-node topologies (issue 18: the 2x8 incast fix).

Each case hashes, per rank, the workers per role and every role queue as (task id, task name)
in order. The digests are what commit a502788 gave; a change that moves them changes what the
GPU benchmarks measure, so it must say so and re-pin here on purpose.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

import mgraph as mg

# op, dims, lowering options -> (digest, workers of rank 0)
PINNED = [
    ("gemm_allreduce", dict(M=8192, N=8192, K=8192), {}, "ef8c4586c53facbb", (132, 0, 0)),
    ("gemm_allreduce", dict(M=1024, N=8192, K=16384), {}, "8898737354a17d2f", (132, 0, 0)),
    ("gemm_allreduce", dict(M=2048, N=4096, K=2048), {"algorithm": "oneshot"},
     "a776fdb261250742", (132, 0, 0)),
    ("gemm_allreduce", dict(M=2048, N=4096, K=2048), {"algorithm": "twoshot"},
     "f1d726e6b868a344", (132, 0, 0)),
    # re-pinned on purpose (v11): GEMM+RS's and AG+GEMM's tiles in L2-friendly bands of tile
    # rows (collectives.grouped, as gemm's and GEMM+AR's), after both lost at K=14336 (NOTES v11)
    ("gemm_reduce_scatter", dict(M=8192, N=8192, K=8192), {}, "8d942bdc08addbc7", (132, 0, 0)),
    ("gemm_reduce_scatter", dict(M=2048, N=4096, K=2048), {"algorithm": "push"},
     "b6269ff1d3f8c323", (132, 0, 0)),
    # re-pinned on purpose (v9): AG's default chunk 1 MiB, from the v9 sweep
    # (benchmarks/results/v9; NOTES v9); and (v11) the banded tile order above
    ("allgather_gemm", dict(M=8192, N=16384, K=4096), {}, "241476b259a2371b", (108, 24, 0)),
    ("allgather_gemm", dict(M=1024, N=16384, K=8192), {}, "7a3d95b461d6f308", (124, 8, 0)),
    ("allgather_gemm", dict(M=2048, N=8192, K=2048), {"gather": "peer"},
     "7c74c1a52d63f1d9", (132, 0, 0)),
]  # fmt: skip


def schedule_digest(schedule: mg.Schedule) -> str:
    tasks = schedule.graph.tasks
    parts = [
        (rs.rank, sorted(rs.workers.items()),
         sorted((role, [(t, tasks[t].name) for t in q]) for role, q in rs.queues.items()))
        for rs in schedule.ranks
    ]  # fmt: skip
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


@pytest.mark.parametrize(("op", "dims", "opts", "digest", "workers"), PINNED)
def test_single_node_schedule_is_pinned(op, dims, opts, digest, workers):
    graph = mg.ops.get_op(op)(topology="1x2", dtype=torch.bfloat16, **dims, **opts)
    sched = mg.schedule(graph)
    for rs in sched.ranks:
        assert (rs.workers["compute"], rs.workers["nvlink"], rs.workers["rdma"]) == workers
    assert schedule_digest(sched) == digest, (
        f"{op} {dims} {opts} at 1x2: the schedule moved (order or partition); single-node "
        "schedules are pinned while they are benchmarked on GPUs"
    )


def test_digest_sees_a_reordering():
    """The digest is not blind to order: swapping two queued tasks changes it."""
    graph = mg.ops.get_op("gemm_allreduce")(topology="1x2", dtype=torch.bfloat16,
                                            M=1024, N=1024, K=1024)  # fmt: skip
    sched = mg.schedule(graph)
    before = schedule_digest(sched)
    q = sched.ranks[0].queues["compute"]
    q[0], q[1] = q[1], q[0]
    assert schedule_digest(sched) != before
