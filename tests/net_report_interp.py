"""Run by tests/test_net_report.py under TRITON_INTERPRET=1: a 2x1 GEMM+AllReduce launched once
through the native proxy, then runtime/megakernel/net_report.py read on it as it stands (every
word at its count) and with one chunk's flag word taken back by one (that word named); then a
launch whose proxy was stopped first, under MGRAPH_NET_REPORT's setting: its watchdog error
carries the report. Prints one JSON line."""

from __future__ import annotations

import json
import os

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"

import torch  # noqa: E402

import mgraph as mg  # noqa: E402
from mgraph.errors import WatchdogTimeout  # noqa: E402
from mgraph.runtime.megakernel.net_report import net_report  # noqa: E402
from mgraph.runtime.megakernel.runtime import TritonRuntime, _SharedMemory  # noqa: E402
from mgraph.settings import Settings  # noqa: E402


def main() -> None:
    op = mg.ops.get_op("gemm_allreduce")
    graph = op(topology="2x1", M=64, N=64, K=128, tile=[32, 32], chunk_bytes=4096)
    sched = mg.schedule(graph)
    rt = TritonRuntime(sched, rank=None, interpret=True, shared=_SharedMemory(graph, torch.device("cpu")))
    try:
        rt.run(op.random_inputs(graph, seed=0))
        whole = net_report(rt, settle_s=0.0)
        plan = rt.layout.net
        send = next(t for t in graph.tasks if t.name.startswith("rail-send r1->r0"))
        word = plan.words[0][("task", send.id)]
        rt.shared.flags[0][rt.layout.net_base + word] -= 1
        short = net_report(rt, settle_s=0.0)
    finally:
        rt.close()
    # A watchdog timeout with the report on: a proxy that stopped before the launch (its
    # commands stay in the FIFO), a bound of 1000 polls a wait.
    settings = Settings(watchdog_s=0.001, net_report=True)
    rt = TritonRuntime(sched, rank=None, interpret=True,
                       shared=_SharedMemory(graph, torch.device("cpu")), settings=settings)
    rt.net.proxy.abort()
    try:
        rt.run(op.random_inputs(graph, seed=0))
        timeout = ""
    except WatchdogTimeout as exc:
        timeout = str(exc)
    finally:
        rt.close()
    print(json.dumps({"whole": whole, "short": short, "send": send.name, "word": word,
                      "timeout": timeout}))


if __name__ == "__main__":
    main()
