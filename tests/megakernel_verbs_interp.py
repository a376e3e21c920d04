"""Runs under TRITON_INTERPRET=1 in a subprocess (tests/test_megakernel_verbs.py) with
LD_LIBRARY_PATH holding the fake libibverbs of tests/fake_verbs as ``libibverbs.so.1``: the
megakernel with ``Settings(transport="verbs")`` dlopens it by its usual name, as it would the
real one. argv[1]: that library's path (to read the fake's counters and turn its knobs).
Prints one JSON line per case.

- ``verbs-2x1``: a 2x1 GEMM+AllReduce launched twice on one runtime. Each rank has its own NIC
  context, queue pair and native proxy; the one interpreted program's pushes are split onto the
  ranks' FIFOs. Reported: the errors against torch, whether every net word ends at exactly
  epochs x its raises per launch, and the NIC counters beside what the plan predicts.
- ``failed-write``: the fake NIC fails a work request (the peer never answered): the launch
  stops with the proxy's error naming it, not at the watchdog.
- ``no-device``: the fake reports no RDMA device: building the runtime raises.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"

import torch  # noqa: E402
from fake_verbs import FakeVerbs  # noqa: E402

import mgraph as mg  # noqa: E402
from mgraph.runtime.megakernel import TritonRuntime  # noqa: E402
from mgraph.runtime.megakernel.runtime import _SharedMemory  # noqa: E402
from mgraph.runtime.proxy import Opcode  # noqa: E402
from mgraph.settings import Settings  # noqa: E402

VERBS = Settings(transport="verbs")


def graph_and_op():
    op = mg.ops.get_op("gemm_allreduce")
    graph = op(topology="2x1", M=64, N=64, K=64, tile=[32, 32], chunk_bytes=2048)
    return op, graph


def runtime(graph) -> TritonRuntime:
    shared = _SharedMemory(graph, torch.device("cpu"))
    return TritonRuntime(
        mg.schedule(graph), rank=None, interpret=True, shared=shared, settings=VERBS
    )


def verbs_2x1(fake: FakeVerbs) -> None:
    op, graph = graph_and_op()
    rt = runtime(graph)
    try:
        errs = []
        for launch in range(2):
            inputs = op.random_inputs(graph, seed=3 + launch)
            want = op.run_reference(inputs, graph.params)["out"]
            got = rt.run(inputs).outputs["out"]
            errs.append(((got - want).norm() / want.norm()).item())
        plan, lay = rt.layout.net, rt.layout
        exact = all(
            rt.shared.flags[r][lay.net_base + w].item() == rt.epoch * plan.per_launch[r][w]
            for r in graph.topology.ranks
            for key, w in plan.words[r].items()
            if key[0] != "start"  # raised by the GPU's entry barrier only
        )
        net = rt.net
        nic = [t.stats() for t in net.transports]
        loops = [p.loop_stats() for p in net.proxies]
        row = {
            "case": "verbs-2x1",
            "errors": errs,
            "epochs": rt.epoch,
            "exact": exact,
            "transports": sorted({type(t).__name__ for t in net.transports}),
            "proxy_ranks": [p.rank for p in net.proxies],
            "memory": sorted({k for t in net.transports for k in t.memory_kinds.values()}),
            "split": net.splitter.moved if net.splitter is not None else -1,
            "commands": sum(s["commands"] for s in loops),
            "per_launch_commands": sum(len(c) for c in plan.commands.values()),
            # each command raising an event on a peer sends one immediate
            "per_launch_remote_events": sum(
                1
                for cmds in plan.commands.values()
                for c in cmds
                if c.dst_rank != c.src_rank and c.event >= 0
            ),
            "per_launch_write_bytes": sum(
                c.bytes for cmds in plan.commands.values() for c in cmds if c.opcode == Opcode.WRITE
            ),
            "imms": sum(s["imms"] for s in nic),
            "recv_completions": sum(s["recv_completions"] for s in nic),
            "fake_imms": fake.stat("imms"),
            "fake_bytes": fake.stat("bytes"),
            "fake_errors": fake.stat("errors"),
            "host_regs": fake.stat("host_regs"),
        }
    finally:
        rt.close()
    print(json.dumps(row), flush=True)


def failed_write(fake: FakeVerbs) -> None:
    from fake_verbs import RETRY_EXC_ERR

    from mgraph.errors import MgraphError

    op, graph = graph_and_op()
    rt = runtime(graph)
    fake.fail_next(RETRY_EXC_ERR)
    row = {"case": "failed-write", "raised": None}
    start = time.monotonic()
    try:
        rt.run(op.random_inputs(graph, seed=1))
    except MgraphError as exc:
        row.update(raised=type(exc).__name__, message=str(exc))
    finally:
        rt.close()
    row["seconds"] = time.monotonic() - start
    print(json.dumps(row), flush=True)


def no_device(fake: FakeVerbs) -> None:
    from mgraph.errors import RdmaUnavailableError

    _, graph = graph_and_op()
    fake.set_devices(0)
    row = {"case": "no-device", "raised": None}
    try:
        runtime(graph)
    except RdmaUnavailableError as exc:
        row.update(raised=type(exc).__name__, message=str(exc))
    finally:
        fake.set_devices(2)
    print(json.dumps(row), flush=True)


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    fake = FakeVerbs(Path(argv[0]))
    fake.reset()
    verbs_2x1(fake)
    failed_write(fake)
    no_device(fake)


if __name__ == "__main__":
    main(sys.argv[1:])
