"""What the simulator knows about each task before it runs: the timing model's static half.

- compute: one worker is one SM. A math kind (gemm, attn_block, moe_expert) runs at its full-chip
  rate divided by the SM count, so a rank's compute speed scales with the SMs left to compute;
  any other kind (reduce, copy, finalize, route, combine) is memory bound: the larger of its flops
  at the tile rate and its bytes at the SM's share of HBM bandwidth.
- nvlink: a flow of the task's REMOTE bytes (reads of peers' memory, writes into it) at up to one
  SM's push rate, through its own GPU's issue port (what all of a GPU's SMs together push or pull:
  GPU.md measured 340 GB/s however many SMs try), the NVLink egress of the GPU that holds the
  data and the ingress of the GPU that receives it (link rate each; flows.py shares them). A
  task with no remote bytes is a local copy at the SM's share of HBM bandwidth.
- compute tasks whose epilogue also stores into node peers (the v2 data path): after the math
  the peer bytes drain through the GPU's push port (one FIFO pipe per GPU at
  ``nvlink_push_gbps``, not shared with NVLink workers' flows) while the SM takes its next task
  (TMA stores are asynchronous); the task ends, and signals, when its bytes have drained.
- rdma: the worker only pushes FIFO commands (a WRITE, plus a SIGNAL per extra event, as
  runtime/network.py encodes them); the transfer is the proxy's and the NIC's (engine.py).

Signals to a counter on another GPU of the node become visible ``nvlink_latency_us`` later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mgraph.graph import ITEMSIZE, Task, TaskGraph
from mgraph.hardware import HardwareProfile
from mgraph.kinds import Role, TaskKind
from mgraph.scheduler.costmodel import hbm_rate_per_sm, nvlink_rate_per_sm

__all__ = [
    "COMPUTE", "NVLINK", "RDMA", "MATH_RATE", "TaskModel", "task_model", "kind_rate", "expected_fill",
]  # fmt: skip

COMPUTE, NVLINK, RDMA = 0, 1, 2
_ROLE_CODE = {Role.COMPUTE.value: COMPUTE, Role.NVLINK.value: NVLINK, Role.RDMA.value: RDMA}

# Kinds whose cost is their math, at the named profile rate (TFLOP/s on all SMs). Tiles of these
# reuse their operands through L2 and shared memory, so their region bytes are not HBM traffic.
MATH_RATE: dict[str, str] = {
    TaskKind.GEMM.value: "tile_gemm_tflops",
    TaskKind.ATTN_BLOCK.value: "attention_tflops",
    TaskKind.MOE_EXPERT.value: "grouped_gemm_tflops",
}


def kind_rate(kind: str, hw: HardwareProfile) -> float:
    """FLOP/s of ``kind`` on the whole chip (non-math kinds: the tile GEMM rate)."""
    return getattr(hw, MATH_RATE.get(kind, "tile_gemm_tflops")) * 1e12


@dataclass
class TaskModel:
    """Per task id: role code, fixed duration, remote bytes and flow ports, rdma plumbing."""

    role: list[int]
    duration: list[float]  # compute / local nvlink: run time; rdma: command push time
    remote: list[int]  # nvlink: bytes over NVLink; rdma: bytes over the wire
    ports: list[tuple[tuple[int, float], ...]]  # nvlink flows: (port, share of the rate)
    dst: list[int]  # rdma: destination rank
    commands: list[int]  # rdma: FIFO commands
    signals: list[list[tuple[int, float]]]  # compute/nvlink: (event, visibility delay)
    dst_events: list[list[int]]  # rdma: raised on arrival at the destination
    src_events: list[list[int]]  # rdma: raised when the completion is back at the source
    nvlink_demand: float = 0.0  # bytes/s one nvlink worker drives (an SM's push rate)
    # bytes/s of a GPU's epilogue pushes (TMA stores are asynchronous: the GPU's push port
    # limits them, not one SM's store rate); they drain one after another (engine.epilogue)
    epilogue_demand: float = 0.0


def ports_of(world: int) -> dict[str, int]:
    """Port index bases: SM issue, NVLink egress, NVLink ingress, NIC out, NIC in (per rank)."""
    return {
        "issue": 0, "egress": world, "ingress": 2 * world, "nic_out": 3 * world,
        "nic_in": 4 * world,
    }  # fmt: skip


def port_capacities(world: int, hw: HardwareProfile) -> list[float]:
    # SMs of one GPU move at most the measured push rate over NVLink, below the link rate
    # (GPU.md: 340 vs 478 GB/s); each link direction is bounded by the link itself.
    return (
        [hw.nvlink_push_gbps * 1e9] * world
        + [hw.nvlink_gbps * 1e9] * (2 * world)
        + [hw.rdma_gbps * 1e9] * (2 * world)
    )


Fill = Callable[[Task], float]  # fraction of a task's bytes that is really moved or touched


def expected_fill(task: Task) -> float:
    """What a task reports of its own data-dependent bytes: ``params["expected_fill"]``, the
    expected touched fraction of its region bytes (MoE tasks whose bodies follow the routed
    counts, sized by capacity). An expectation set at lowering, not data: the sim has none."""
    return task.params.get("expected_fill", 1.0)


def task_model(graph: TaskGraph, hw: HardwareProfile, fill: Fill | None = None) -> TaskModel:
    """``fill``: the fraction of a task's bytes that is really moved or touched, for tasks sized
    for the worst case (MoE blocks hold capacity rows; only the routed ones move): it scales the
    bytes of transfers and of memory-bound compute tasks (math kinds are costed by flops). None:
    each task's own ``expected_fill`` (1 unless its lowering says otherwise); ``lambda t: 1.0``
    costs every byte of every region (capacity)."""
    if fill is None:
        fill = expected_fill
    topo = graph.topology
    world = topo.world_size
    node = [topo.node_of(r) for r in topo.ranks]
    base = ports_of(world)
    bufs = graph.buffers
    buf_rank = {bid: b.rank for bid, b in bufs.items()}
    buf_item = {bid: ITEMSIZE[b.dtype] for bid, b in bufs.items()}
    ev_rank = [e.rank for e in graph.events]
    per_sm = {k: kind_rate(k, hw) / hw.sms for k in MATH_RATE}
    tile_rate = kind_rate(TaskKind.GEMM.value, hw) / hw.sms
    hbm = hbm_rate_per_sm(hw)
    nvl_lat = hw.nvlink_latency_us * 1e-6
    push = hw.fifo_push_us * 1e-6
    n = len(graph.tasks)
    m = TaskModel(
        role=[0] * n, duration=[0.0] * n, remote=[0] * n, ports=[()] * n, dst=[-1] * n,
        commands=[0] * n, signals=[[] for _ in range(n)], dst_events=[[] for _ in range(n)],
        src_events=[[] for _ in range(n)], nvlink_demand=nvlink_rate_per_sm(hw),
        epilogue_demand=hw.nvlink_push_gbps * 1e9,
    )  # fmt: skip
    for t in graph.tasks:
        tid, rank = t.id, t.rank
        code = _ROLE_CODE[t.role]
        m.role[tid] = code
        if code == RDMA:
            w = t.writes[0]
            dst = buf_rank[w[0]]
            m.dst[tid] = dst
            m.remote[tid] = (w[2] - w[1]) * (w[4] - w[3]) * buf_item[w[0]]
            f = fill(t)
            if f != 1.0:
                m.remote[tid] *= f
            m.dst_events[tid] = [e for e in t.signals if ev_rank[e] == dst]
            m.src_events[tid] = [e for e in t.signals if ev_rank[e] != dst]
            m.commands[tid] = (
                1 + max(0, len(m.dst_events[tid]) - 1) + max(0, len(m.src_events[tid]) - 1)
            )
            m.duration[tid] = push * m.commands[tid]
            continue
        m.signals[tid] = [(e, 0.0 if ev_rank[e] == rank else nvl_lat) for e in t.signals]
        if code == COMPUTE:
            rate = per_sm.get(t.kind)
            if rate is not None:
                m.duration[tid] = t.flops / rate
            else:
                f = fill(t)
                nbytes = t.bytes if f == 1.0 else t.bytes * f
                a, b = t.flops / tile_rate, nbytes / hbm
                m.duration[tid] = a if a > b else b
            if all(buf_rank[w[0]] == rank for w in t.writes):
                continue
            # An epilogue that stores into node peers: after the math, those bytes drain
            # through the GPU's push port while the SM goes on (engine.epilogue).
            m.remote[tid] = sum(
                (w[2] - w[1]) * (w[4] - w[3]) * buf_item[w[0]]
                for w in t.writes if buf_rank[w[0]] != rank
            )
            continue
        # nvlink: per port, the share of the task's remote bytes that crosses it
        load: dict[int, int] = {}
        total = 0
        for regions, reading in ((t.reads, True), (t.writes, False)):
            for r in regions:
                holder = buf_rank[r[0]]
                if holder == rank:
                    continue
                nbytes = (r[2] - r[1]) * (r[4] - r[3]) * buf_item[r[0]]
                src, dst = (holder, rank) if reading else (rank, holder)
                assert node[src] == node[dst], f"nvlink task {t.name!r} leaves its node"
                for port in (base["egress"] + src, base["ingress"] + dst):
                    load[port] = load.get(port, 0) + nbytes
                total += nbytes
        f = fill(t) if total else 1.0
        if f != 1.0:
            load = {p: b * f for p, b in load.items()}
            total *= f
        if total:
            m.remote[tid] = total
            load[base["issue"] + rank] = total
            m.ports[tid] = tuple((p, b / total) for p, b in sorted(load.items()))
        else:
            m.duration[tid] = t.bytes / hbm
    return m
