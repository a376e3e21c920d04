"""The cluster simulator: ``mg.run(schedule, backend="sim", hardware=...)``.

A discrete-event model of the persistent megakernel running a Schedule on every rank of a
cluster (engine.py), with compute tiles at the profile's per-SM rates (model.py), NVLink and NIC
bandwidth shared between concurrent transfers (flows.py), and the proxy/FIFO path of the RDMA
workers. It returns the same RunResult fields as the reference runtime (``outputs`` is empty:
nothing is computed) with ``wall_s`` the PREDICTED time, plus the baselines of baselines.py
modelled on the same hardware, so ``result.speedup()`` compares like with like.
"""

from __future__ import annotations

from pathlib import Path

from mgraph.hardware import HardwareProfile
from mgraph.kinds import ROLES
from mgraph.scheduler import Schedule
from mgraph.settings import Settings

from ..trace import Trace
from .baselines import BASELINES, BaselineResult, Phase, baselines, register_baseline
from .engine import Engine, TransferRecord
from .model import Fill
from .nccl import collective_times
from .result import SimResult
from .sweep import SweepPoint, sweep_comm_sms, with_comm_sms

__all__ = [
    "simulate",
    "SimResult",
    "TransferRecord",
    "BaselineResult",
    "Phase",
    "BASELINES",
    "register_baseline",
    "baselines",
    "collective_times",
    "launch_overhead",
    "SweepPoint",
    "sweep_comm_sms",
    "with_comm_sms",
]

_ROLE_NAMES = tuple(r.value for r in ROLES)


def simulate(
    schedule: Schedule,
    *,
    hardware: HardwareProfile | str | Path | None = None,
    settings: Settings | None = None,
    adaptive: bool = False,
    period_us: float = 20.0,
    baselines: bool = True,
    tolerance: float = 0.05,
    fill: Fill | None = None,
) -> SimResult:
    """Predict ``schedule`` on ``hardware`` (default: the profile it was scheduled for).

    ``adaptive``: the controller re-splits compute/nvlink workers every ``period_us`` with the
    work-balance rule. ``baselines``: also model the op's sequential and kernel-level-overlap
    baselines (ops without a registered baseline get none). ``tolerance``: how far a shared
    port's split may drift before flows are re-timed (flows.py). ``fill(task)``: the fraction of
    a task's bytes really moved or touched, a what-if for worst-case-sized buffers (default 1).
    """
    if isinstance(hardware, (str, Path)):
        hardware = HardwareProfile.load(hardware)
    hw = hardware or schedule.hardware
    settings = settings or Settings()
    engine = Engine(
        schedule, hw, fifo_slots=settings.fifo_slots, adaptive=adaptive, period=period_us * 1e-6,
        tolerance=tolerance, fill=fill,
    )  # fmt: skip
    makespan = engine.run()
    graph = schedule.graph
    busy_s = [dict.fromkeys(_ROLE_NAMES, 0.0) for _ in graph.topology.ranks]
    for r in engine.records:  # SM time: a task with epilogue stores frees its SM before its end
        busy_s[r.rank][r.role] += engine.sm_free.get(r.task, r.end) - r.start
    busy = [
        {role: busy_s[rank][role] / held for code, role in enumerate(_ROLE_NAMES)
         if (held := engine.held[rank][code]) > 0}
        for rank in graph.topology.ranks
    ]  # fmt: skip
    predicted = makespan + launch_overhead(graph, hw)
    stats = {
        "commands": engine.commands,
        "batches": engine.proxy_rounds,
        "rdma_bytes": engine.bytes["rdma"],
        "nvlink_bytes": engine.bytes["nvlink"],
        "tasks": len(engine.records),
    }
    # Busy fractions of what is not an SM: each host proxy, each NIC's send side (the union of
    # its queue pairs' writes on the wire).
    wire = _union_per_rank(engine.transfers, graph.topology.world_size)
    for rank, rank_busy in enumerate(busy):
        if engine.proxy_time[rank]:
            rank_busy["proxy"] = engine.proxy_time[rank] / makespan
        if wire[rank]:
            rank_busy["nic"] = wire[rank] / makespan
    trace = Trace(sorted(engine.records, key=lambda r: (r.start, r.rank, r.worker)), backend="sim")
    return SimResult(
        outputs={},
        trace=trace,
        wall_s=predicted,
        epoch=1,
        stats=stats,
        predicted_s=predicted,
        makespan_s=makespan,
        hardware=hw,
        workers=[dict(rs.workers) for rs in schedule.ranks],
        busy=busy,
        bytes_by_link=dict(engine.bytes),
        transfers=engine.transfers,
        baselines=_baselines(graph, hw) if baselines else {},
        adaptive=adaptive,
    )


def launch_overhead(graph, hw: HardwareProfile) -> float:
    """Seconds a launch costs outside the tasks: the kernel launch; on several GPUs the entry
    barrier, the ranks' host skew and the exit wait (``multi_gpu_launch_us``); and zeroing the
    ``zeroed`` buffers (accumulating outputs) at HBM rate before the kernel starts, as every
    runtime does (the megakernel with memsets in its CUDA graph), on the busiest rank."""
    zeroed = [0] * graph.topology.world_size
    for b in graph.buffers.values():
        if b.zeroed:
            zeroed[b.rank] += b.nbytes
    multi = hw.multi_gpu_launch_us if graph.topology.world_size > 1 else 0.0
    return (hw.launch_us + multi) * 1e-6 + max(zeroed) / (hw.hbm_gbps * 1e9)


def _baselines(graph, hw: HardwareProfile) -> dict[str, BaselineResult]:
    return baselines(graph, hw)


def _union_per_rank(transfers: list[TransferRecord], world: int) -> list[float]:
    spans: list[list[tuple[float, float]]] = [[] for _ in range(world)]
    for tr in transfers:
        spans[tr.src].append((tr.start, tr.end))
    out = [0.0] * world
    for rank, lst in enumerate(spans):
        end = -1.0
        for s, e in sorted(lst):
            if e > end:
                out[rank] += e - max(s, end)
                end = e
    return out
