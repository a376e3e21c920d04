"""Cost model: how long one task takes on ONE worker of its role, from the graph's cost hints
(``Task.flops``, ``Task.bytes``) and a HardwareProfile.

The scheduler uses these numbers twice: summed per rank and role they are the work the static SM
partition splits (balance.py), and along paths they are the critical-path priorities
(policies.py). They are estimates for ordering and partitioning, not predictions of wall time:
the simulator owns timing.
"""

from __future__ import annotations

from ..graph import Task, TaskGraph
from ..hardware import HardwareProfile
from ..kinds import ROLES, Role

__all__ = [
    "compute_rate_per_sm",
    "hbm_rate_per_sm",
    "nvlink_rate_per_sm",
    "nvlink_task_rate",
    "task_cost",
    "task_costs",
    "role_work",
]

_COMPUTE, _NVLINK, _RDMA = Role.COMPUTE.value, Role.NVLINK.value, Role.RDMA.value


def compute_rate_per_sm(hw: HardwareProfile) -> float:
    """FLOP/s of one compute worker: the full-chip tile GEMM rate shared by all SMs."""
    return hw.tile_gemm_tflops * 1e12 / hw.sms


def hbm_rate_per_sm(hw: HardwareProfile) -> float:
    return hw.hbm_gbps * 1e9 / hw.sms


def nvlink_rate_per_sm(hw: HardwareProfile) -> float:
    """Bytes/s one nvlink worker pushes: the SM push rate is reached by ``nvlink_push_sms``
    workers, so each contributes an equal share of it (more workers add nothing)."""
    return hw.nvlink_push_gbps * 1e9 / hw.nvlink_push_sms


def nvlink_task_rate(hw: HardwareProfile) -> float:
    """Bytes/s one megakernel NVLink worker moves through its tasks, as measured (per-tile tasks
    pay a wait and a system-scope signal each): what the SM partition plans with."""
    return hw.nvlink_task_gbps * 1e9


def task_cost(task: Task, hw: HardwareProfile) -> float:
    """Seconds one worker of the task's role spends on it (rdma: until the data has landed)."""
    if task.role == _COMPUTE:
        # flops / per-SM GEMM rate is the rule; the HBM term keeps memory-bound tiles (reduce,
        # copy: few flops, many bytes) from looking free.
        return max(task.flops / compute_rate_per_sm(hw), task.bytes / hbm_rate_per_sm(hw))
    if task.role == _NVLINK:
        return task.bytes / nvlink_task_rate(hw)
    # An rdma worker only pushes a command; the transfer itself is the NIC's and the proxy's.
    # For the critical path it is what delays the consumer: proxy + wire + latency. Task.bytes
    # counts both ends of the copy, the wire carries one.
    wire = task.bytes / 2 / (hw.rdma_gbps * 1e9)
    return (hw.proxy_command_us + hw.rdma_latency_us) * 1e-6 + wire


def task_costs(graph: TaskGraph, hw: HardwareProfile) -> list[float]:
    """``task_cost`` of every task, indexed by task id."""
    comp = compute_rate_per_sm(hw)
    hbm = hbm_rate_per_sm(hw)
    nvl = nvlink_task_rate(hw)
    rdma_fixed = (hw.proxy_command_us + hw.rdma_latency_us) * 1e-6
    rdma_rate = 2 * hw.rdma_gbps * 1e9
    out = [0.0] * len(graph.tasks)
    # Inlined task_cost: this runs over 40k+ tasks per schedule.
    for t in graph.tasks:
        role = t.role
        if role == _COMPUTE:
            a, b = t.flops / comp, t.bytes / hbm
            out[t.id] = a if a > b else b
        elif role == _NVLINK:
            out[t.id] = t.bytes / nvl
        else:
            out[t.id] = rdma_fixed + t.bytes / rdma_rate
    return out


def role_work(graph: TaskGraph, costs: list[float]) -> dict[int, dict[str, tuple[int, float]]]:
    """rank -> role -> (tasks, summed cost in worker-seconds); every rank and role present."""
    work = {r: {role.value: [0, 0.0] for role in ROLES} for r in graph.topology.ranks}
    for t in graph.tasks:
        cell = work[t.rank][t.role]
        cell[0] += 1
        cell[1] += costs[t.id]
    return {r: {role: (n, c) for role, (n, c) in roles.items()} for r, roles in work.items()}
