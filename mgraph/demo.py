"""``mgraph demo``: the five fused ops on a small 2x2 cluster, run on the CPU and checked.

For each op: build the task graph, schedule it, run it on the reference runtime (threads for
workers, FIFO + proxy for RDMA), compare with the op's torch reference and write the timeline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .api import run
from .ops import get_op

__all__ = ["DEMO_CASES", "DemoRow", "run_demo"]

# Small shapes that still give every op several tiles per rank, chunks and both link classes.
DEMO_CASES: dict[str, dict[str, Any]] = {
    "gemm_allreduce": dict(M=256, N=256, K=256, tile=[64, 64], chunk_bytes=32768),
    "gemm_reduce_scatter": dict(M=256, N=256, K=256, tile=[32, 64], chunk_bytes=16384),
    "allgather_gemm": dict(M=256, N=256, K=128, tile=[32, 32], chunk_bytes=16384),
    "ring_attention": dict(B=1, H=2, S=256, D=32, causal=True),
    "moe_dispatch_combine": dict(T=64, H=32, E=8, top_k=2, F=64),
}


@dataclass
class DemoRow:
    op: str
    tasks: int
    nvlink_bytes: int
    rdma_bytes: int
    wall_s: float
    rel_err: float
    ok: bool
    trace: str


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def run_demo(
    topology: str = "2x2", out_dir: str | Path = "mgraph-demo", tol: float = 1e-4, seed: int = 0,
    ops: list[str] | None = None,
) -> list[DemoRow]:
    from .scheduler import schedule

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, params in DEMO_CASES.items():
        if ops and name not in ops:
            continue
        op = get_op(name)
        graph = op(topology=topology, dtype=torch.float32, **params)
        graph.validate()
        inputs = op.random_inputs(graph, seed=seed)
        start = time.perf_counter()
        result = run(schedule(graph), inputs, backend="reference")
        wall = time.perf_counter() - start
        want = op.run_reference(inputs, graph.params)
        err = max(rel_err(result.outputs[k], want[k]) for k in graph.outputs)
        trace_path = out / f"{name}.trace.json"
        result.trace.save(trace_path)
        st = graph.stats()
        rows.append(
            DemoRow(name, len(graph.tasks), st.bytes_by_link["nvlink"], st.bytes_by_link["rdma"],
                    wall, err, err < tol, str(trace_path))
        )
    return rows
