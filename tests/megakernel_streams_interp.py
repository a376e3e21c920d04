"""Runs under TRITON_INTERPRET=1 in a subprocess (tests/test_megakernel_streams.py): multi-node
graphs through the real native proxy with ``Settings(proxy_streams=...)`` for each stream count
in argv (one process for all of them: the interpreter's start-up is paid once). Prints one JSON
line per case and stream count.

Cases are sized so each rank has more rdma tasks than netplan.LANE_BLOCK: commands of several
lanes, per-lane "sent"/"arrive"/event words that waiters sum. (Under the interpreter the proxy's
transport is host memory, where copies are synchronous memmoves: what the stream count changes
here is the lane-to-stream grouping of coalesced copies; the streams themselves are tested on the
fake CUDA libraries, tests/test_native_streams.py.)"""

from __future__ import annotations

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"

import torch  # noqa: E402

import mgraph as mg  # noqa: E402
from mgraph.runtime.megakernel import TritonRuntime  # noqa: E402
from mgraph.runtime.megakernel.runtime import _SharedMemory  # noqa: E402
from mgraph.settings import Settings  # noqa: E402

# rdma tasks a rank: 12 (AR: lanes of 8 and 4) and 10 (RS, each waiting for two GEMM tiles:
# lanes of 8 and 2), so both lanes have copies to coalesce
CASES = {
    "gemm_allreduce-2x1": (
        "gemm_allreduce", dict(M=96, N=128, K=128, tile=[32, 32], chunk_bytes=1024)
    ),
    "gemm_reduce_scatter-2x1": ("gemm_reduce_scatter", dict(M=320, N=64, K=128, tile=[16, 32])),
}


def run_case(name: str, streams: int) -> None:
    op_name, kw = CASES[name]
    op = mg.ops.get_op(op_name)
    graph = op(topology="2x1", **kw)
    sched = mg.schedule(graph)
    settings = Settings(proxy_streams=streams)
    errs = []
    # One runtime, three launches, fresh inputs each: the outputs match torch over relaunches,
    # and every net word ends at exactly epochs x its raises per launch.
    rt = TritonRuntime(sched, rank=None, interpret=True, settings=settings,
                       shared=_SharedMemory(graph, torch.device("cpu")))
    try:
        for launch in range(3):
            inputs = op.random_inputs(graph, seed=5 + launch)
            want = op.run_reference(inputs, graph.params)["out"]
            got = rt.run(inputs).outputs["out"]
            errs.append(((got - want).norm() / want.norm()).item())
        plan, lay = rt.layout.net, rt.layout
        words = {
            r: rt.shared.flags[r][lay.net_base : lay.net_base + len(plan.words[r])].tolist()
            for r in graph.topology.ranks
        }
        # (start words are raised by the GPU's entry barrier only: one program runs every rank
        # here, so nothing waits for a peer's start)
        exact = all(
            words[r][w] == rt.epoch * plan.per_launch[r][w]
            for r in graph.topology.ranks
            for key, w in plan.words[r].items()
            if key[0] != "start"
        )
        stats = rt.net.proxy.loop_stats()
    finally:
        rt.close()
    print(json.dumps({
        "case": name, "streams": streams, "errors": errs, "epochs": rt.epoch, "exact": exact,
        "proxy_streams": stats["streams"], "commands": stats["commands"],
        "per_launch_commands": sum(len(c) for c in plan.commands.values()),
        "lanes": sorted(set(plan.lanes.values())),
        "lane_words": sorted({str(k) for r in graph.topology.ranks for k in plan.words[r]
                              if k[0] in ("sent", "arrive")}),
    }), flush=True)


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    for streams in map(int, argv):
        for name in CASES:
            run_case(name, streams)


if __name__ == "__main__":
    main(sys.argv[1:])
