"""Runs under TRITON_INTERPRET=1 in a subprocess (see test_megakernel_cpu.py): the megakernel's
tile bodies, tables, waits/signals and epochs on the CPU. Prints one JSON line per case."""

from __future__ import annotations

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"

import torch  # noqa: E402

import mgraph as mg  # noqa: E402
from mgraph.runtime.megakernel import TritonRuntime, run_in_process  # noqa: E402

CASES = {
    "gemm-1x1": ("gemm", "1x1", dict(M=64, N=64, K=128, tile=[32, 32])),
    "gemm_allreduce-1x1": ("gemm_allreduce", "1x1", dict(M=64, N=64, K=128, tile=[32, 32])),
    "gemm_allreduce-1x2": ("gemm_allreduce", "1x2", dict(M=64, N=96, K=128, tile=[32, 32], chunk_bytes=4096)),
    "gemm_reduce_scatter-1x2": ("gemm_reduce_scatter", "1x2", dict(M=64, N=64, K=128, tile=[16, 32])),
    "allgather_gemm-1x2": ("allgather_gemm", "1x2", dict(M=64, N=64, K=64, tile=[16, 16])),
    "gemm_allreduce-1x4": ("gemm_allreduce", "1x4", dict(M=64, N=64, K=256, tile=[16, 32], chunk_bytes=2048)),
    # multi-node: rdma tasks push FIFO commands that the native proxy executes (net.py)
    "gemm_allreduce-2x1": ("gemm_allreduce", "2x1", dict(M=64, N=64, K=128, tile=[32, 32], chunk_bytes=4096)),
    "allgather_gemm-2x1": ("allgather_gemm", "2x1", dict(M=64, N=64, K=64, tile=[16, 32])),
    "gemm_reduce_scatter-2x1": ("gemm_reduce_scatter", "2x1", dict(M=64, N=64, K=128, tile=[16, 32])),
    "gemm_allreduce-2x2": ("gemm_allreduce", "2x2", dict(M=64, N=64, K=256, tile=[16, 32], chunk_bytes=2048)),
}


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    for name in names:
        op_name, topo, kw = CASES[name]
        op = mg.ops.get_op(op_name)
        graph = op(topology=topo, **kw)
        sched = mg.schedule(graph)
        errs = []
        for launch in range(3):  # relaunches: epochs, no counter reset, fresh data each time
            inputs = op.random_inputs(graph, seed=launch)
            want = op.run_reference(inputs, graph.params)["out"]
            if graph.topology.world_size == 1:
                rt = TritonRuntime(sched, interpret=True) if launch == 0 else rt  # noqa: F821
                got = rt.run(inputs).outputs["out"]
            else:
                got = run_in_process(sched, inputs)["out"]
            errs.append(((got - want).norm() / want.norm()).item())
        print(json.dumps({"case": name, "errors": errs}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))
