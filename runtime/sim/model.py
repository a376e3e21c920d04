"""What the simulator knows about each task before it runs: the timing model's static half.

- compute: one worker is one SM. A math kind (gemm, attn_block, moe_expert) runs at its full-chip
  rate divided by the SM count, so a rank's compute speed scales with the SMs left to compute;
  any other kind (reduce, copy, finalize, route, combine) is memory bound: the larger of its flops
  at the tile rate and its bytes at the SM's share of HBM bandwidth.
- nvlink: a flow of the task's REMOTE bytes (reads of peers' memory, writes into it) at up to
  what one NVLink worker was measured to drive (``nvlink_worker_gbps`` for the bytes it pulls,
  ``nvlink_worker_push_gbps`` for the bytes it pushes), through its own GPU's issue port (what all of a GPU's SMs together push or pull:
  GPU.md measured 340 GB/s however many SMs try), the NVLink egress of the GPU that holds the
  data and the ingress of the GPU that receives it (link rate each; flows.py shares them). That
  demand is the alone rate: the engine drives it at ``nvlink_beside_compute`` of it while the
  worker's GPU has compute tasks left (engine.py). A task with no remote bytes is a local copy
  at the SM's share of HBM bandwidth.
- compute tasks whose epilogue also stores into node peers (the v2 data path): the SM waits
  for those stores at ``epilogue_peer_gbps`` (measured: 7-8 us per 64 KiB tile beside the same
  GEMM storing locally), then takes its next task while the bytes drain through the GPU's push
  port (one FIFO pipe per GPU at ``nvlink_push_gbps``, not shared with NVLink workers' flows);
  the task ends, and signals, when its bytes have drained.
- rdma: the worker only pushes FIFO commands, as the megakernel's network plan encodes them
  (runtime/megakernel/netplan.py): one WRITE whose arrival raises one flag that every event of
  the destination counts, plus a SIGNAL per extra event on the source; the transfer is the
  proxy's and the NIC's (engine.py).

Every per-worker constant is the scheduler's (mgraph/scheduler/costmodel.py): one profile.

Signals to a counter on another GPU of the node become visible ``nvlink_latency_us`` later.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from mgraph.graph import ITEMSIZE, Task, TaskGraph
from mgraph.hardware import HardwareProfile
from mgraph.kinds import Role, TaskKind
from mgraph.scheduler.costmodel import (
    MATH_RATE,
    epilogue_rate_per_sm,
    hbm_rate_per_sm,
    kind_rate,
    nvlink_rate_per_sm,
    nvlink_seconds,
)

__all__ = [
    "COMPUTE", "NVLINK", "RDMA", "MATH_RATE", "TaskModel", "task_model", "kind_rate", "expected_fill",
]  # fmt: skip

COMPUTE, NVLINK, RDMA = 0, 1, 2
_ROLE_CODE = {Role.COMPUTE.value: COMPUTE, Role.NVLINK.value: NVLINK, Role.RDMA.value: RDMA}


@dataclass
class TaskModel:
    """Per task id: role code, fixed duration, remote bytes and flow ports, rdma plumbing."""

    role: list[int]
    duration: list[float]  # compute: math + epilogue wait; local nvlink: run time; rdma: push
    remote: list[int]  # nvlink: bytes over NVLink; rdma: bytes over the wire
    ports: list[tuple[tuple[int, float], ...]]  # nvlink flows: (port, share of the rate)
    dst: list[int]  # rdma: destination rank
    commands: list[int]  # rdma: FIFO commands
    signals: list[list[tuple[int, float]]]  # compute/nvlink: (event, visibility delay)
    dst_events: list[list[int]]  # rdma: raised on arrival at the destination
    src_events: list[list[int]]  # rdma: raised when the completion is back at the source
    # nvlink: bytes/s the task's one worker drives alone (no compute on its GPU), from the
    # measured pull rate for the bytes it reads from peers and the push rate for the bytes it
    # writes into them; the engine scales it by nvlink_beside_compute while compute runs
    demand: list[float] = field(default_factory=list)
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
    epilogue = epilogue_rate_per_sm(hw)
    pull, push_rate = nvlink_rate_per_sm(hw), nvlink_rate_per_sm(hw, push=True)
    n = len(graph.tasks)
    m = TaskModel(
        role=[0] * n, duration=[0.0] * n, remote=[0] * n, ports=[()] * n, dst=[-1] * n,
        commands=[0] * n, signals=[[] for _ in range(n)], dst_events=[[] for _ in range(n)],
        src_events=[[] for _ in range(n)], demand=[0.0] * n,
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
            # netplan: the WRITE's one arrival flag serves every destination event
            m.commands[tid] = 1 + max(0, len(m.src_events[tid]) - 1)
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
            # An epilogue that stores into node peers: the SM waits for its stores to retire,
            # then those bytes drain through the GPU's push port while the SM goes on
            # (engine.epilogue).
            m.remote[tid] = sum(
                (w[2] - w[1]) * (w[4] - w[3]) * buf_item[w[0]]
                for w in t.writes
                if buf_rank[w[0]] != rank
            )
            m.duration[tid] += m.remote[tid] / epilogue
            continue
        # nvlink: per port, the share of the task's remote bytes that crosses it
        load: dict[int, int] = {}
        total = pulled = 0
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
                if reading:
                    pulled += nbytes
        f = fill(t) if total else 1.0
        if f != 1.0:
            load = {p: b * f for p, b in load.items()}
            total *= f
            pulled *= f
        if total:
            m.remote[tid] = total
            m.demand[tid] = (
                pull if pulled == total else push_rate if pulled == 0
                else total / nvlink_seconds(hw, pulled, total - pulled)
            )  # fmt: skip
            load[base["issue"] + rank] = total
            m.ports[tid] = tuple((p, b / total) for p, b in sorted(load.items()))
        else:
            m.duration[tid] = t.bytes / hbm
    return m
