"""Cost model: how long one task takes on ONE worker of its role, from the graph's cost hints
(``Task.flops``, region bytes) and a HardwareProfile.

The scheduler uses these numbers twice: summed per rank and role they are the work the static SM
partition splits (balance.py), and along paths they are the critical-path priorities
(policies.py). The simulator (runtime/sim/model.py) costs a task alone on its worker with the
SAME rules and constants (``MATH_RATE``, ``nvlink_worker_gbps`` and ``nvlink_worker_push_gbps``,
``nvlink_beside_compute``, ``epilogue_peer_gbps``); it adds what a schedule decides (bandwidth
shared between concurrent flows, waits, the proxy's queue, when compute runs beside an NVLink
worker), so it owns timing.

- compute: a math kind at its full-chip rate over the SM count; any other kind is memory bound
  (the larger of its flops at the tile rate and its bytes at one SM's share of HBM); plus the
  bytes its epilogue stores into node peers at ``epilogue_peer_gbps`` (the SM waits for them).
- nvlink: the bytes it reads from other GPUs at ``nvlink_worker_gbps`` (pull) plus the bytes it
  writes into them at ``nvlink_worker_push_gbps`` (push): what one megakernel NVLink worker was
  measured to move each way with no compute on the GPU, times ``nvlink_beside_compute`` on a
  rank that also has compute tasks (a fused op: its GEMM tiles share the GPU with the worker for
  the whole gather, measured 0.54x in bench_tp v7's traces); a task with neither is a local
  copy at HBM rate.
- rdma: proxy command + latency + wire, what delays the consumer (the worker only pushes).
"""

from __future__ import annotations

from ..graph import ITEMSIZE, Task, TaskGraph
from ..hardware import HardwareProfile
from ..kinds import ROLES, Role, TaskKind

__all__ = [
    "MATH_RATE",
    "kind_rate",
    "compute_rate_per_sm",
    "hbm_rate_per_sm",
    "nvlink_rate_per_sm",
    "nvlink_seconds",
    "compute_ranks",
    "epilogue_rate_per_sm",
    "remote_bytes",
    "task_cost",
    "task_costs",
    "role_work",
]

_COMPUTE, _NVLINK, _RDMA = Role.COMPUTE.value, Role.NVLINK.value, Role.RDMA.value

# Kinds whose cost is their math, at the named profile rate (TFLOP/s on all SMs). Tiles of these
# reuse their operands through L2 and shared memory, so their region bytes are not HBM traffic.
MATH_RATE: dict[str, str] = {
    TaskKind.GEMM.value: "tile_gemm_tflops",
    "gemm_glu": "tile_gemm_tflops",  # two GEMM products a tile (mgraph/ops/matmul_glu.py)
    TaskKind.ATTN_BLOCK.value: "attention_tflops",
    TaskKind.MOE_EXPERT.value: "grouped_gemm_tflops",
}


def kind_rate(kind: str, hw: HardwareProfile) -> float:
    """FLOP/s of ``kind`` on the whole chip (non-math kinds: the tile GEMM rate)."""
    return getattr(hw, MATH_RATE.get(kind, "tile_gemm_tflops")) * 1e12


def compute_rate_per_sm(hw: HardwareProfile) -> float:
    """FLOP/s of one compute worker: the full-chip tile GEMM rate shared by all SMs."""
    return hw.tile_gemm_tflops * 1e12 / hw.sms


def hbm_rate_per_sm(hw: HardwareProfile) -> float:
    return hw.hbm_gbps * 1e9 / hw.sms


def nvlink_rate_per_sm(hw: HardwareProfile, push: bool = False, beside: bool = False) -> float:
    """Bytes/s over NVLink one megakernel NVLink worker moves through its tasks, as measured:
    reading from a peer (pull) or, with ``push``, writing into one (per-tile tasks pay waits and
    system-scope signals; far below a bulk push probe's rate). ``beside``: while compute tiles
    run on the GPU's other SMs (``nvlink_beside_compute`` of the alone rate)."""
    rate = (hw.nvlink_worker_push_gbps if push else hw.nvlink_worker_gbps) * 1e9
    return rate * hw.nvlink_beside_compute if beside else rate


def nvlink_seconds(
    hw: HardwareProfile, pulled: float, pushed: float, beside: bool = False
) -> float:
    """Seconds one NVLink worker spends reading ``pulled`` bytes from peers and writing
    ``pushed`` bytes into them (a task doing both does one after the other), alone or, with
    ``beside``, while compute runs on the GPU's other SMs."""
    return pulled / nvlink_rate_per_sm(hw, beside=beside) + pushed / nvlink_rate_per_sm(
        hw, push=True, beside=beside
    )


def compute_ranks(graph: TaskGraph) -> frozenset[int]:
    """Ranks with compute tasks: there the cost model costs NVLink workers beside compute
    (the static partition runs both roles for the whole launch)."""
    compute = _COMPUTE
    return frozenset({t.rank for t in graph.tasks if t.role == compute})


def epilogue_rate_per_sm(hw: HardwareProfile) -> float:
    """Bytes/s of node-peer stores one compute SM's GEMM epilogue retires while the SM waits."""
    return hw.epilogue_peer_gbps * 1e9


def remote_bytes(graph: TaskGraph) -> tuple[list[int], list[int]]:
    """Per task id: (bytes it reads from other ranks' buffers, bytes it writes into them)."""
    bufs = graph.buffers
    holder = {bid: b.rank for bid, b in bufs.items()}
    item = {bid: ITEMSIZE[b.dtype] for bid, b in bufs.items()}
    reads = [0] * len(graph.tasks)
    writes = [0] * len(graph.tasks)
    for t in graph.tasks:
        rank = t.rank
        for regions, out in ((t.reads, reads), (t.writes, writes)):
            n = 0
            for r in regions:
                if holder[r[0]] != rank:
                    n += (r[2] - r[1]) * (r[4] - r[3]) * item[r[0]]
            out[t.id] = n
    return reads, writes


def task_cost(task: Task, hw: HardwareProfile, graph: TaskGraph) -> float:
    """Seconds one worker of the task's role spends on it (rdma: until the data has landed)."""
    beside = task.role == _NVLINK and any(
        t.role == _COMPUTE and t.rank == task.rank for t in graph.tasks
    )
    return _cost(task, hw, *_remote_of(graph, task), beside)


def _remote_of(graph: TaskGraph, task: Task) -> tuple[int, int]:
    bufs = graph.buffers
    out = []
    for regions in (task.reads, task.writes):
        out.append(sum(
            (r[2] - r[1]) * (r[4] - r[3]) * ITEMSIZE[bufs[r[0]].dtype]
            for r in regions if bufs[r[0]].rank != task.rank
        ))  # fmt: skip
    return out[0], out[1]


def _cost(t: Task, hw: HardwareProfile, remote_read: int, remote_write: int, beside: bool) -> float:
    return _Rates(hw).cost(t, remote_read, remote_write, beside)


class _Rates:
    """The per-SM rates of one HardwareProfile, computed once: ``task_costs`` costs ~10^5 tasks
    and the rate functions (pydantic attribute reads and divisions) were most of its time. Each
    rate is the same expression as its function's, so every cost is the same float."""

    __slots__ = (
        "hw", "math", "compute", "hbm", "epilogue", "rdma_fixed", "rdma_wire", "nvlink"
    )  # fmt: skip

    def __init__(self, hw: HardwareProfile) -> None:
        self.hw = hw
        self.math = {kind: getattr(hw, rate) * 1e12 / hw.sms for kind, rate in MATH_RATE.items()}
        self.compute = compute_rate_per_sm(hw)
        self.hbm = hbm_rate_per_sm(hw)
        self.epilogue = epilogue_rate_per_sm(hw)
        self.rdma_fixed = (hw.proxy_command_us + hw.rdma_latency_us) * 1e-6
        self.rdma_wire = hw.rdma_gbps * 1e9
        # beside -> (pull rate, push rate): nvlink_seconds' two rates
        self.nvlink = {
            beside: (nvlink_rate_per_sm(hw, beside=beside),
                     nvlink_rate_per_sm(hw, push=True, beside=beside))
            for beside in (False, True)
        }  # fmt: skip

    def cost(self, t: Task, remote_read: int, remote_write: int, beside: bool) -> float:
        fill = t.params.get("expected_fill", 1.0) if t.params else 1.0
        if t.role == _COMPUTE:
            rate = self.math.get(t.kind)
            if rate is not None:
                base = t.flops / rate
            else:
                base = max(t.flops / self.compute, t.bytes * fill / self.hbm)
            return base + remote_write / self.epilogue
        if t.role == _NVLINK:
            if remote_read or remote_write:
                pull, push = self.nvlink[beside]  # nvlink_seconds' expression
                return remote_read * fill / pull + remote_write * fill / push
            return t.bytes * fill / self.hbm
        # An rdma worker only pushes a command; the transfer itself is the NIC's and the
        # proxy's. For the critical path it is what delays the consumer: proxy + wire + latency.
        # Task.bytes counts both ends of the copy, the wire carries one.
        return self.rdma_fixed + t.bytes / 2 / self.rdma_wire


def task_costs(graph: TaskGraph, hw: HardwareProfile) -> list[float]:
    """``task_cost`` of every task, indexed by task id."""
    # One pass (~10^5 tasks at 2x8): the remote bytes ``remote_bytes`` would give, summed the
    # same way, but a task's reads only for an nvlink task (the only role whose cost reads them).
    beside = compute_ranks(graph)
    rates = _Rates(hw)
    cost = rates.cost
    # _Rates.cost's compute branch, inlined (most tasks are compute tasks): the same
    # expressions on the same rates, so the same floats
    math_rate, compute_rate, hbm, epilogue = rates.math, rates.compute, rates.hbm, rates.epilogue
    compute, nvlink = _COMPUTE, _NVLINK
    where = {bid: (b.rank, ITEMSIZE[b.dtype]) for bid, b in graph.buffers.items()}
    out = [0.0] * len(graph.tasks)
    for t in graph.tasks:
        rank = t.rank
        remote_write = 0
        for r in t.writes:
            holder, item = where[r[0]]
            if holder != rank:
                remote_write += (r[2] - r[1]) * (r[4] - r[3]) * item
        role = t.role
        if role == compute:
            rate = math_rate.get(t.kind)
            if rate is not None:
                base = t.flops / rate
            else:
                params = t.params  # a membership test, no call, for those without a fill
                fill = params["expected_fill"] if "expected_fill" in params else 1.0
                # max() of the two without the call: the same float (max keeps the first
                # unless the second is larger)
                base = t.flops / compute_rate
                moved = t.bytes * fill / hbm
                if moved > base:
                    base = moved
            out[t.id] = base + remote_write / epilogue
            continue
        remote_read = 0
        if role == nvlink:
            for r in t.reads:
                holder, item = where[r[0]]
                if holder != rank:
                    remote_read += (r[2] - r[1]) * (r[4] - r[3]) * item
        out[t.id] = cost(t, remote_read, remote_write, rank in beside)
    return out


def role_work(graph: TaskGraph, costs: list[float]) -> dict[int, dict[str, tuple[int, float]]]:
    """rank -> role -> (tasks, summed cost in worker-seconds); every rank and role present."""
    work = {r: {role.value: [0, 0.0] for role in ROLES} for r in graph.topology.ranks}
    for t in graph.tasks:
        cell = work[t.rank][t.role]
        cell[0] += 1
        cell[1] += costs[t.id]
    return {r: {role: (n, c) for role, (n, c) in roles.items()} for r, roles in work.items()}
