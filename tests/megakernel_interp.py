"""Runs under TRITON_INTERPRET=1 in a subprocess (see test_megakernel_cpu.py): the megakernel's
tile bodies, tables, waits/signals and epochs on the CPU. Prints one JSON line per case."""

from __future__ import annotations

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"

import torch  # noqa: E402

import mgraph as mg  # noqa: E402
from mgraph.runtime.megakernel import TritonRuntime  # noqa: E402

CASES = {
    "gemm-1x1": ("gemm", "1x1", dict(M=64, N=64, K=128, tile=[32, 32])),
    "gemm_allreduce-1x1": ("gemm_allreduce", "1x1", dict(M=64, N=64, K=128, tile=[32, 32])),
    "gemm_allreduce-1x2": ("gemm_allreduce", "1x2", dict(M=64, N=96, K=128, tile=[32, 32], chunk_bytes=4096)),
    "gemm_reduce_scatter-1x2": ("gemm_reduce_scatter", "1x2", dict(M=64, N=64, K=128, tile=[16, 32])),
    "allgather_gemm-1x2": ("allgather_gemm", "1x2", dict(M=64, N=64, K=64, tile=[16, 16])),
    "gemm_allreduce-1x4": ("gemm_allreduce", "1x4", dict(M=64, N=64, K=256, tile=[16, 32], chunk_bytes=2048)),
    # the v2 node algorithms, each forced: epilogue pushes, per-program signals, exit events
    "gemm_allreduce-1x2-oneshot": ("gemm_allreduce", "1x2", dict(M=64, N=96, K=128, tile=[32, 32], algorithm="oneshot")),
    # (M 32: 4 GEMM and 4 reduce tasks a rank, every GEMM pushing to the 4 ranks' buffers)
    "gemm_allreduce-1x4-oneshot": ("gemm_allreduce", "1x4", dict(M=32, N=64, K=256, tile=[16, 32], algorithm="oneshot")),
    "gemm_allreduce-1x4-twoshot": ("gemm_allreduce", "1x4", dict(M=64, N=64, K=256, tile=[16, 32], algorithm="twoshot")),
    "gemm_reduce_scatter-1x4": ("gemm_reduce_scatter", "1x4", dict(M=64, N=64, K=256, tile=[16, 32])),
    "gemm_reduce_scatter-1x2-push": ("gemm_reduce_scatter", "1x2", dict(M=64, N=64, K=128, tile=[16, 32], algorithm="push")),
    "gemm_allreduce-1x2-twoshot": ("gemm_allreduce", "1x2", dict(M=64, N=96, K=128, tile=[32, 32], algorithm="twoshot")),
    "allgather_gemm-1x2-peer": ("allgather_gemm", "1x2", dict(M=64, N=64, K=64, tile=[16, 16], gather="peer")),
    # short edge tiles (sizes that are not multiples of the tile, K not of BK): TMA clips them
    "gemm-1x1-small-k": ("gemm", "1x1", dict(M=32, N=32, K=32, tile=[16, 16])),
    "gemm-1x1-edge": ("gemm", "1x1", dict(M=40, N=56, K=72, tile=[32, 32])),
    # 4 writes per task: reduce-adds from the dynamic GEMM body, not the prefix
    "gemm_allreduce-1x4-accumulate": ("gemm_allreduce", "1x4", dict(M=64, N=64, K=256, tile=[16, 32], algorithm="accumulate")),
    "gemm_allreduce-1x2-edge": ("gemm_allreduce", "1x2", dict(M=40, N=56, K=144, tile=[32, 32])),
    # tiles larger than the kernel's block (encode.MAX_BLOCK, 128 x 256): each task runs
    # 2 x 2, 2 x 1, 1 x 2 and 1 x 1 blocks, short at the edges; on 1x2 each block reduce-adds
    "gemm-1x1-multiblock": ("gemm", "1x1", dict(M=300, N=600, K=72, tile=[256, 512])),
    "gemm_reduce_scatter-1x2-multiblock": ("gemm_reduce_scatter", "1x2", dict(M=512, N=768, K=64, tile=[256, 512])),
    # silu(a @ gate) * (a @ up) from packed weights: blocks of BM x BN/2 outputs, short row
    # edges, a K tail
    "matmul_glu-1x1": ("matmul_glu", "1x1", dict(M=300, N=384, K=72, tile=[256, 256])),
    "matmul_glu-1x2-cols": ("matmul_glu", "1x2", dict(M=64, N=512, K=64, shard="cols", tile=[64, 128])),
    # multi-node: rdma tasks push FIFO commands that the native proxy executes (net.py)
    "gemm_allreduce-2x1": ("gemm_allreduce", "2x1", dict(M=64, N=64, K=128, tile=[32, 32], chunk_bytes=4096)),
    "allgather_gemm-2x1": ("allgather_gemm", "2x1", dict(M=64, N=64, K=64, tile=[16, 32])),
    "gemm_reduce_scatter-2x1": ("gemm_reduce_scatter", "2x1", dict(M=64, N=64, K=128, tile=[16, 32])),
    # (M 32: a rank's 4 GEMMs, 4 copies each waiting for its GEMM, 3 reduces waiting for 2)
    "gemm_allreduce-2x2": ("gemm_allreduce", "2x2", dict(M=32, N=64, K=256, tile=[16, 32], chunk_bytes=2048)),
    # three nodes: a reduce waits for chunks from two proxies (an event sums several words)
    # (N 32: a rank's 3 GEMMs; 3 reduces waiting for 1 chunk, 1 for 3 words)
    "gemm_allreduce-3x1": ("gemm_allreduce", "3x1", dict(M=96, N=32, K=192, tile=[32, 32], chunk_bytes=4096)),
}


def network_epochs() -> None:
    """2x1 GEMM+AR relaunched on ONE runtime: the proxy and its net words live across launches,
    targets are epoch-tagged, and every launch's commands are executed exactly once."""
    from mgraph.runtime.megakernel.runtime import _SharedMemory

    op = mg.ops.get_op("gemm_allreduce")
    graph = op(topology="2x1", M=64, N=64, K=128, tile=[32, 32], chunk_bytes=4096)
    sched = mg.schedule(graph)
    rt = TritonRuntime(sched, rank=None, interpret=True, shared=_SharedMemory(graph, torch.device("cpu")))
    errs = []
    for launch in range(4):
        inputs = op.random_inputs(graph, seed=10 + launch)
        want = op.run_reference(inputs, graph.params)["out"]
        got = rt.run(inputs).outputs["out"]
        errs.append(((got - want).norm() / want.norm()).item())
    plan, lay = rt.layout.net, rt.layout
    words = {
        str(r): rt.shared.flags[r][lay.net_base : lay.net_base + len(plan.words[r])].tolist()
        for r in graph.topology.ranks
    }
    stats = rt.net.proxy.stats
    rt.close()
    print(json.dumps({
        "case": "network-epochs", "errors": errs, "epochs": rt.epoch, "words": words,
        "per_launch": {str(r): plan.per_launch[r] for r in graph.topology.ranks},
        "starts": {str(r): [plan.words[r][k] for k in plan.words[r] if k[0] == "start"]
                   for r in graph.topology.ranks},
        "commands": stats.commands,
        "per_launch_commands": sum(len(c) for c in plan.commands.values()),
    }), flush=True)


def network_bad_command() -> None:
    """A command the proxy must refuse (a destination buffer that does not exist): the proxy
    stops, aborts the kernel's waits at once, and the runtime raises the proxy's error, which
    names the command, instead of a watchdog timeout or a wrong answer."""
    from mgraph.runtime.megakernel.runtime import _SharedMemory
    from mgraph.runtime.proxy.command import Word

    op = mg.ops.get_op("gemm_allreduce")
    graph = op(topology="2x1", M=64, N=64, K=128, tile=[32, 32], chunk_bytes=4096)
    rt = TritonRuntime(mg.schedule(graph), rank=None, interpret=True,
                       shared=_SharedMemory(graph, torch.device("cpu")))
    rt.d["cmds"][0, Word.DST_BUF] = 999
    try:
        rt.run(op.random_inputs(graph, seed=0))
        outcome, message = "no error", ""
    except mg.MgraphError as exc:
        outcome, message = type(exc).__name__, str(exc)
    rt.close()
    print(json.dumps({"case": "network-bad-command", "errors": [0.0], "outcome": outcome,
                      "message": message}), flush=True)


def kernel_watchdog() -> None:
    """A sum's wait asks for one signal more than the graph sends (its count raised in the
    device table, past every static check): the wait times out inside the kernel, which records
    (rank, program, task, event, value, target) and aborts; check() turns the record into a
    WatchdogTimeout naming the task, the event and its rank."""
    from mgraph.runtime.megakernel.runtime import _SharedMemory
    from mgraph.settings import Settings

    op = mg.ops.get_op("gemm_allreduce")
    graph = op(topology="1x2", M=64, N=64, K=128, tile=[32, 32], algorithm="twoshot")
    sched = mg.schedule(graph)
    rt = TritonRuntime(sched, rank=None, interpret=True, settings=Settings(watchdog_s=0.005),
                       shared=_SharedMemory(graph, torch.device("cpu")))
    local = next(i for i, tid in enumerate(rt.tables.local_tasks)
                 if graph.tasks[tid].kind == "reduce")
    first_wait = int(rt.tables.tasks[local][5])
    rt.d["waits"][first_wait][1] += 1  # one more signal than will ever come
    event = graph.events[rt.tables.event_slots[int(rt.d["waits"][first_wait][0])]]
    try:
        rt.run(op.random_inputs(graph, seed=0))
        outcome, message = "no error", ""
    except mg.MgraphError as exc:
        outcome, message = type(exc).__name__, str(exc)
    finally:
        rt.close()
    print(json.dumps({"case": "kernel-watchdog", "errors": [0.0], "outcome": outcome,
                      "message": message, "event": event.name, "rank": event.rank}), flush=True)


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mgraph.ops.abi import (  # noqa: E402
    F_READ0,
    F_WRITE0,
    buffer_base,
    load_f32,
    load_region,
    param_f32,
    param_i32,
    store_any,
)

_READ0, _WRITE0 = tl.constexpr(F_READ0), tl.constexpr(F_WRITE0)


@triton.jit
def axpb_tile(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr, RB_M: tl.constexpr,
              RB_N: tl.constexpr):
    """every write = alpha * read + beta, alpha (float) and beta (int) from the task's params"""
    s, sm0, sm1, sn0, sn1 = load_region(regions, tl.load(tp + _READ0))
    d, dm0, dm1, dn0, dn1 = load_region(regions, tl.load(tp + _WRITE0))
    alpha = param_f32(params, tp, 0)
    beta = param_i32(params, tp, 1).to(tl.float32)
    om = tl.arange(0, RB_M)
    on = tl.arange(0, RB_N)
    mask = (om < sm1 - sm0)[:, None] & (on < sn1 - sn0)[None, :]
    src = buffer_base(bufaddr, s, DT)
    dst = buffer_base(bufaddr, d, DT)
    sc = tl.load(bufcols + s)
    dc = tl.load(bufcols + d)
    x = tl.load(src + (sm0 + om)[:, None] * sc + (sn0 + on)[None, :], mask=mask)
    y = (alpha * x.to(tl.float32) + beta).to(DT)
    tl.store(dst + (dm0 + om)[:, None] * dc + (dn0 + on)[None, :], y, mask=mask)


@triton.jit
def scale_f32_tile(tp, params, regions, bufaddr, bufcols, bufdt, DT: tl.constexpr,
                   RB_M: tl.constexpr, RB_N: tl.constexpr):
    """write = alpha * read, each in its buffer's own dtype (bufdt)"""
    s, sm0, sm1, sn0, sn1 = load_region(regions, tl.load(tp + _READ0))
    d, dm0, dm1, dn0, dn1 = load_region(regions, tl.load(tp + _WRITE0))
    om = tl.arange(0, RB_M)
    on = tl.arange(0, RB_N)
    mask = (om < sm1 - sm0)[:, None] & (on < sn1 - sn0)[None, :]
    x = load_f32(bufaddr, bufdt, s, (sm0 + om)[:, None] * tl.load(bufcols + s) + (sn0 + on)[None, :],
                 mask, DT)
    store_any(bufaddr, bufdt, d, (dm0 + om)[:, None] * tl.load(bufcols + d) + (dn0 + on)[None, :],
              param_f32(params, tp, 0) * x, mask, DT)


def mixed_dtypes() -> None:
    """A bfloat16 graph with float32 buffers (partials): a body taking ``bufdt`` reads and
    writes each buffer in its own dtype; a copy from float32 into bf16 is refused before launch."""
    from mgraph.builder import GraphBuilder, piece
    from mgraph.errors import DTypeError
    from mgraph.kinds import Role, define_kind
    from mgraph.topology import Topology

    spec = define_kind("scale_f32_test", [Role.COMPUTE], "write = alpha * read, any dtypes",
                       params=("alpha",))

    @spec.cpu
    def _cpu(task, reads, writes):
        writes[0].copy_(task.params["alpha"] * reads[0].float())

    @spec.flops
    def _flops(reads, writes, params):
        return 0.0

    spec.triton(scale_f32_tile)

    def build(kind):
        b = GraphBuilder("mixed", Topology.parse("1x1"), "bfloat16", {})
        b.global_input("x", (64, 64), dtype="float32")
        b.global_output("out", (64, 64))
        x = b.bound_buffer("x", 0, "x", [piece((64, 64))])
        mid = b.buffer("mid", 0, 64, 64, dtype="float32")
        out = b.bound_buffer("out", 0, "out", [piece((64, 64))], role="output")
        e = b.event(0, "mid ready")
        params = {"alpha": 3.0} if kind == "scale_f32_test" else {}
        for src, dst, ev_in, ev_out, a in ((x, mid, None, e, 3.0), (mid, out, e, None, 0.5)):
            b.task(0, Role.COMPUTE, kind, [src.region()], [dst.region()],
                   waits=[] if ev_in is None else [(ev_in, 1)],
                   signals=[] if ev_out is None else [ev_out],
                   params={"alpha": a} if params else {}, name=f"{src.name}->{dst.name}")
        return b.finish()

    graph = build("scale_f32_test")
    graph.validate()
    xs = torch.randn(64, 64)
    rt = TritonRuntime(mg.schedule(graph), interpret=True)
    got = rt.run({"x": xs}).outputs["out"]
    want = (1.5 * xs).to(torch.bfloat16)
    mid = rt.views["mid@0"].reshape(64, 64)  # float32 partials, exact: 3 x is one fp32 rounding
    refused = ""
    try:
        TritonRuntime(mg.schedule(build("copy")), interpret=True)
    except DTypeError as exc:
        refused = str(exc)
    print(json.dumps({"case": "mixed-dtypes", "dtype": str(got.dtype),
                      "mid_dtype": str(mid.dtype), "mid_error": (mid - 3.0 * xs).abs().max().item(),
                      "errors": [(mid - 3.0 * xs).abs().max().item()],
                      "out_rel": ((got.float() - want.float()) / want.float().abs().clamp_min(1e-3))
                      .abs().max().item(),
                      "refused": refused}), flush=True)


def adaptive_roles() -> None:
    """The controller in the kernel (control.py), one interpreter program per worker: 6 compute
    and 6 nvlink copies that wait for nothing, 2 + 2 programs, 3 launches with and without
    Settings(adaptive=True). The interpreter runs program 0 to its end first, so with the
    controller it takes the nvlink queue once the compute one is empty: roles change, and the
    next launch must still run every task exactly once (the heads reset at exit)."""
    from mgraph.builder import GraphBuilder, piece
    from mgraph.kinds import Role
    from mgraph.runtime.megakernel.control import C_DECISIONS
    from mgraph.settings import Settings
    from mgraph.topology import Topology

    b = GraphBuilder("adaptive", Topology.parse("1x1"), "float32", {})
    b.global_input("x", (96, 32))
    b.global_output("out", (96, 32))
    x = b.bound_buffer("x", 0, "x", [piece((96, 32))])
    out = b.bound_buffer("out", 0, "out", [piece((96, 32))], role="output")
    for i in range(12):
        rows = (8 * i, 8 * (i + 1))
        role = Role.COMPUTE if i % 2 else Role.NVLINK
        b.task(0, role, "copy", [x.region(rows)], [out.region(rows)], name=f"copy {i}")
    graph = b.finish()
    graph.validate()
    sched = mg.schedule(graph, workers={"compute": 2, "nvlink": 2})
    rows = {}
    for adaptive in (False, True):
        rt = TritonRuntime(sched, interpret=True, interpret_roles=True, trace=True,
                           settings=Settings(adaptive=adaptive))
        errs, roles_of = [], {}
        for _launch in range(3):
            xs = torch.randn(96, 32)
            got = rt.run({"x": xs}).outputs["out"]
            errs.append((got - xs).abs().max().item())
            pids = rt.d["trace"].reshape(-1, 4)[:, 3].tolist()  # start, ready, end, program
            for local, tid in enumerate(rt.tables.local_tasks):
                roles_of.setdefault(int(pids[local]), set()).add(graph.tasks[tid].role)
        rows[str(adaptive)] = dict(
            errors=errs, heads=rt.d["heads"].tolist(), decisions=int(rt.d["ctl"][C_DECISIONS]),
            both=[p for p, r in roles_of.items() if len(r) == 2])
    print(json.dumps({"case": "adaptive-roles", "errors": rows["True"]["errors"] + rows["False"]["errors"],
                      "runs": rows}), flush=True)


def custom_kind() -> None:
    """A kind defined here, with declared params and a Triton body, runs in the megakernel:
    the dispatch is generated from the registry (no kernel edit) and each task reads its own
    params row (a float and an int)."""
    from mgraph.builder import GraphBuilder, piece
    from mgraph.kinds import Role, define_kind
    from mgraph.topology import Topology

    spec = define_kind("axpb_test", [Role.COMPUTE], "every write = alpha * read + beta",
                       params=("alpha", "beta"))

    @spec.cpu
    def _cpu(task, reads, writes):
        writes[0].copy_(task.params["alpha"] * reads[0].float() + task.params["beta"])

    @spec.flops
    def _flops(reads, writes, params):
        return 0.0

    spec.triton(axpb_tile)
    b = GraphBuilder("axpb_test", Topology.parse("1x1"), "float32", {})
    b.global_input("x", (64, 64))
    b.global_output("out", (64, 64))
    x = b.bound_buffer("x", 0, "x", [piece((64, 64))])
    out = b.bound_buffer("out", 0, "out", [piece((64, 64))], role="output")
    for i in range(4):
        rows = (16 * i, 16 * (i + 1))
        b.task(0, Role.COMPUTE, "axpb_test", [x.region(rows)], [out.region(rows)],
               params={"alpha": 0.5 * (i + 1), "beta": i - 1}, name=f"axpb {i}")
    graph = b.finish()
    graph.validate()
    xs = torch.randn(64, 64)
    rt = TritonRuntime(mg.schedule(graph), interpret=True)
    got = rt.run({"x": xs}).outputs["out"]
    want = torch.cat([0.5 * (i + 1) * xs[16 * i:16 * (i + 1)] + (i - 1) for i in range(4)])
    print(json.dumps({"case": "custom-kind", "errors": [((got - want).norm() / want.norm()).item()]}),
          flush=True)


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    for name in names:
        if name == "kernel-watchdog":
            kernel_watchdog()
            continue
        if name == "custom-kind":
            custom_kind()
            continue
        if name == "mixed-dtypes":
            mixed_dtypes()
            continue
        if name == "adaptive-roles":
            adaptive_roles()
            continue
        if name == "network-epochs":
            network_epochs()
            continue
        if name == "network-bad-command":
            network_bad_command()
            continue
        op_name, topo, kw = CASES[name]
        op = mg.ops.get_op(op_name)
        graph = op(topology=topo, **kw)
        sched = mg.schedule(graph)
        # Relaunches of ONE runtime (epochs, no counter reset, fresh data each time): every
        # rank's arena in this process for several ranks (run_in_process's runtime, kept for
        # the relaunch). 3 launches on one rank; 2 on several, where a launch costs more.
        if graph.topology.world_size == 1:
            rt, launches = TritonRuntime(sched, interpret=True), 3
        else:
            from mgraph.runtime.megakernel.runtime import _SharedMemory

            rt = TritonRuntime(sched, rank=None, interpret=True,
                               shared=_SharedMemory(graph, torch.device("cpu")))
            launches = 2
        errs = []
        try:
            for launch in range(launches):
                inputs = op.random_inputs(graph, seed=launch)
                want = op.run_reference(inputs, graph.params)["out"]
                got = rt.run(inputs).outputs["out"]
                errs.append(((got - want).norm() / want.norm()).item())
        finally:
            rt.close()
        print(json.dumps({"case": name, "errors": errs, "epochs": rt.epoch}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or [*CASES, "network-epochs", "network-bad-command", "kernel-watchdog",
                           "custom-kind", "mixed-dtypes", "adaptive-roles"])
