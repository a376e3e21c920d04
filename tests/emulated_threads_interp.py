"""By hand (`python tests/emulated_threads_interp.py [launches] [proxy batch]`, about 2 min a
launch on 2 cores; not in CI for that reason): two emulated nodes (2x1
GEMM+AllReduce, the proportions of tests/test_megakernel_gpu.py's uncapped 4096x4096x2048 case:
32 x 16 GEMM tiles a rank, 16 rail-send and 16 rail-gather chunks of one tile row each, lanes 0-3),
each rank its own runtime, FIFO and native proxy as on the GPU, both ranks' kernels at once and
every program on its own thread (tests/interp_threads.py), so the entry barrier's start SIGNALs,
the pushes, the proxies' batches and coalescing, and the waits on net words interleave as they
do between two processes. Prints one JSON line: each launch's error against torch, failures
(with MGRAPH_NET_REPORT's report), and each proxy's counters. At 696c6c3: one
launch correct (rel. error 1.4e-7), 33 commands a proxy, each alone in its batch (the
interpreter pushes slower than the proxy drains, so batching and coalescing are not exercised)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import interp_threads  # noqa: E402

interp_threads.install()

import torch  # noqa: E402

import mgraph as mg  # noqa: E402
from mgraph.runtime.megakernel.runtime import TritonRuntime, _SharedMemory  # noqa: E402
from mgraph.settings import Settings  # noqa: E402


def main() -> None:
    launches = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    op = mg.ops.get_op("gemm_allreduce")
    graph = op(M=256, N=256, K=64, topology="2x1", tile=[8, 16], chunk_bytes=8 * 256 * 4)
    sched = mg.schedule(graph, workers={"compute": 4, "rdma": 1})
    shared = _SharedMemory(graph, torch.device("cpu"))
    settings = Settings(watchdog_s=20.0, proxy_batch=batch, net_report=True)
    rts = [
        TritonRuntime(sched, rank=r, interpret=True, interpret_roles=True, shared=shared,
                      settings=settings)
        for r in (0, 1)
    ]  # fmt: skip
    errors, failures = [], []
    try:
        for launch in range(launches):
            inputs = op.random_inputs(graph, seed=launch)
            want = op.run_reference(inputs, graph.params)["out"]
            got, failed = interp_threads.run_ranks(rts, graph, inputs)
            failures += [f"launch {launch} rank {r}: {exc}"[:3000] for r, exc in failed]
            if failures:
                break
            full = torch.zeros_like(want)
            for r in (0, 1):
                buf = next(b for b in graph.buffers.values()
                           if b.rank == r and b.role == "output")  # fmt: skip
                (rows, cols), = [p for p in buf.binding.pieces]
                full[rows[0]:rows[1], cols[0]:cols[1]] = got[r].reshape(
                    rows[1] - rows[0], cols[1] - cols[0])
            errors.append(((full - want).norm() / want.norm()).item())
    finally:
        stats = [rt.net.proxy.loop_stats() if rt.net is not None else {} for rt in rts]
        for rt in rts:
            rt.close()
    print(json.dumps({"errors": errors, "failures": failures, "stats": stats}), flush=True)


if __name__ == "__main__":
    main()
