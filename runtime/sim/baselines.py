"""Baselines in the simulator's own model, so a speedup compares like with like.

- ``sequential``: the op's math (GEMM, attention or expert GEMMs) on ALL SMs, then (or before)
  the NCCL-like collective of nccl.py at its best algorithm; one kernel launch each.
- ``overlap``: kernel-level overlap. The op is cut into ``chunks`` pieces; a compute stream and a
  communication stream run them as a pipeline, and while a collective runs the compute kernel
  has ``nccl_sms`` fewer SMs. Each chunk's collective pays its latency again and a small chunk
  wastes part of its last wave of tiles, so the best chunk count (1-16) is reported. Ring attention's overlap is the classic ring: attention on the block
  in hand while NCCL send/recv moves the next one (FA2 + NCCL P2P, GPU.md's baseline).

Compute comes from the graph's own tasks: the math-kind tiles of each rank, list-scheduled in
order on all SMs at the same per-SM rates the fused kernel's tiles get (so wave quantization is
modelled alike); what the collective moves comes from the op's params. An
op's baseline is a plain function registered by name; ops without one get no baselines.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from mgraph.errors import RegistrationError
from mgraph.graph import ITEMSIZE, TaskGraph
from mgraph.hardware import HardwareProfile

from .model import MATH_RATE, kind_rate
from .nccl import Fabric, best, collective_times, p2p_time

__all__ = [
    "BaselineResult",
    "Phase",
    "BASELINES",
    "register_baseline",
    "baselines",
    "math_tiles",
    "on_sms",
    "Stage",
    "pipeline",
]


@dataclass(frozen=True)
class Phase:
    """One step of an op outside the megakernel: compute tiles, or a collective."""

    kind: str  # "compute" | a collective of nccl.COLLECTIVES | "ring" (ring attention steps)
    tiles: tuple[float, ...] = ()  # compute, ring: seconds of each tile on one SM (slowest rank)
    nbytes: float = 0.0  # collective: its size as nccl.py defines it; ring: bytes per step


@dataclass
class BaselineResult:
    name: str
    time_s: float
    parts: dict[str, Any] = field(default_factory=dict)  # component times (s) and choices

    def to_dict(self) -> dict[str, Any]:
        parts = {k: (v * 1e3 if k.endswith("_s") else v) for k, v in self.parts.items()}
        parts = {(k[:-2] + "_ms" if k.endswith("_s") else k): v for k, v in parts.items()}
        return {"name": self.name, "time_ms": self.time_s * 1e3, **parts}


BaselineFn = Callable[[TaskGraph, HardwareProfile], list[Phase]]
BASELINES: dict[str, BaselineFn] = {}


def register_baseline(op: str) -> Callable[[BaselineFn], BaselineFn]:
    """Decorator: ``fn(graph, hardware) -> phases`` describes ``op`` done the classic way."""

    def attach(fn: BaselineFn) -> BaselineFn:
        if op in BASELINES:
            raise RegistrationError(f"op {op!r} already has a baseline", hint="register it once")
        BASELINES[op] = fn
        return fn

    return attach


def math_tiles(graph: TaskGraph, hw: HardwareProfile) -> tuple[float, ...]:
    """Seconds on one SM of each math-kind tile of the rank with the most math, in order."""
    per_rank: list[list[float]] = [[] for _ in graph.topology.ranks]
    rates = {k: kind_rate(k, hw) / hw.sms for k in MATH_RATE}
    for t in graph.tasks:
        rate = rates.get(t.kind)
        if rate is not None:
            per_rank[t.rank].append(t.flops / rate)
    return tuple(max(per_rank, key=sum))


def on_sms(tiles: Sequence[float], sms: int) -> float:
    """Makespan of ``tiles`` taken in order by ``sms`` SMs (each takes the next when free)."""
    if not tiles:
        return 0.0
    if len(tiles) <= sms:
        return max(tiles)
    first = tiles[0]
    if all(t == first for t in tiles):  # uniform tiles: whole waves
        return -(-len(tiles) // sms) * first
    free = [0.0] * sms
    for t in tiles:
        heapq.heapreplace(free, free[0] + t)
    return max(free)


def _item(graph: TaskGraph) -> int:
    return ITEMSIZE[graph.dtype]


@register_baseline("gemm_allreduce")
def _gemm_allreduce(graph: TaskGraph, hw: HardwareProfile) -> list[Phase]:
    p = graph.params
    return [
        Phase("compute", math_tiles(graph, hw)),
        Phase("all_reduce", nbytes=p["M"] * p["N"] * _item(graph)),
    ]


@register_baseline("gemm_reduce_scatter")
def _gemm_reduce_scatter(graph: TaskGraph, hw: HardwareProfile) -> list[Phase]:
    p = graph.params
    return [
        Phase("compute", math_tiles(graph, hw)),
        Phase("reduce_scatter", nbytes=p["M"] * p["N"] * _item(graph)),
    ]


@register_baseline("allgather_gemm")
def _allgather_gemm(graph: TaskGraph, hw: HardwareProfile) -> list[Phase]:
    p = graph.params
    return [
        Phase("all_gather", nbytes=p["M"] * p["K"] * _item(graph)),
        Phase("compute", math_tiles(graph, hw)),
    ]


@register_baseline("ring_attention")
def _ring_attention(graph: TaskGraph, hw: HardwareProfile) -> list[Phase]:
    p = graph.params
    kv = 2 * p["B"] * p["H"] * p["S"] * p["D"] * _item(graph)  # k and v, all ranks
    return [Phase("ring", math_tiles(graph, hw), nbytes=kv / graph.topology.world_size)]


@register_baseline("moe_dispatch_combine")
def _moe(graph: TaskGraph, hw: HardwareProfile) -> list[Phase]:
    p = graph.params
    # What NCCL moves: each rank's routed token rows (T/W tokens x top_k copies), not capacity.
    routed = p["T"] // graph.topology.world_size * p["top_k"] * p["H"] * _item(graph)
    return [
        Phase("all_to_all", nbytes=routed),
        Phase("compute", math_tiles(graph, hw)),
        Phase("all_to_all", nbytes=routed),
    ]


# -- evaluating phases ------------------------------------------------------------------------
def baselines(graph: TaskGraph, hw: HardwareProfile) -> dict[str, BaselineResult]:
    """``sequential`` and ``overlap`` for ``graph``'s op; empty when the op has no baseline."""
    fn = BASELINES.get(graph.op)
    if fn is None:
        return {}
    phases = fn(graph, hw)
    return {"sequential": _sequential(graph, hw, phases), "overlap": _overlap(graph, hw, phases)}


def _comm(graph: TaskGraph, hw: HardwareProfile, phase: Phase, scale: float = 1.0):
    return best(collective_times(phase.kind, phase.nbytes * scale, graph.topology, hw))


def _sequential(graph: TaskGraph, hw: HardwareProfile, phases: list[Phase]) -> BaselineResult:
    launch = hw.launch_us * 1e-6
    parts: dict[str, Any] = {"compute_s": 0.0, "comm_s": 0.0, "launches": 0}
    total = 0.0
    algos = []
    for ph in phases:
        if ph.kind == "compute":
            t = on_sms(ph.tiles, hw.sms)
            parts["compute_s"] += t
            total += t
        elif ph.kind == "ring":  # all-gather the KV slices, then attention over all of them
            gather = Phase("all_gather", nbytes=ph.nbytes * graph.topology.world_size)
            algo, t = _comm(graph, hw, gather)
            algos.append(algo)
            compute = on_sms(ph.tiles, hw.sms)
            parts["compute_s"] += compute
            parts["comm_s"] += t
            total += t + compute
            parts["launches"] += 1
        else:
            algo, t = _comm(graph, hw, ph)
            algos.append(algo)
            parts["comm_s"] += t
            total += t
        parts["launches"] += 1
    parts["algorithms"] = ",".join(algos)
    total += parts["launches"] * launch
    return BaselineResult("sequential", total, parts)


def _overlap(graph: TaskGraph, hw: HardwareProfile, phases: list[Phase]) -> BaselineResult:
    launch = hw.launch_us * 1e-6
    shared = max(1, hw.sms - hw.nccl_sms)  # SMs left to compute while NCCL runs
    if phases[0].kind == "ring":
        return _ring_overlap(graph, hw, phases[0], shared, launch)
    best_result: BaselineResult | None = None
    for chunks in (1, 2, 4, 8, 16):
        streams: list[Stage] = []
        order: list[list[int]] = [[] for _ in range(chunks)]
        for c in range(chunks):
            prev = -1
            for ph in phases:
                if ph.kind == "compute":
                    part = ph.tiles[c * len(ph.tiles) // chunks : (c + 1) * len(ph.tiles) // chunks]
                    alone, beside = on_sms(part, hw.sms), on_sms(part, shared)
                    streams.append(Stage("compute", alone + launch, beside + launch, prev))
                else:
                    t = _comm(graph, hw, ph, 1.0 / chunks)[1] + launch
                    streams.append(Stage("comm", t, t, prev))
                prev = len(streams) - 1
                order[c].append(prev)
        time = pipeline(streams, _interleave(order))
        if best_result is None or time < best_result.time_s:
            best_result = BaselineResult(
                "overlap", time, {"chunks": chunks, "nccl_sms": hw.nccl_sms}
            )
    assert best_result is not None
    return best_result


def _interleave(order: list[list[int]]) -> list[int]:
    """Issue order: stage s of chunk c before stage s-1 of chunk c+1 (software pipelining)."""
    stages = len(order[0])
    out = []
    for wave in range(len(order) + stages - 1):
        for s in range(stages - 1, -1, -1):
            c = wave - s
            if 0 <= c < len(order):
                out.append(order[c][s])
    return out


def _ring_overlap(graph, hw, phase: Phase, shared: int, launch: float) -> BaselineResult:
    topo = graph.topology
    world = topo.world_size
    fab = Fabric.of(topo, hw)
    # All ranks send at once; with several nodes some hop crosses the network every step.
    step_comm = p2p_time(fab, phase.nbytes, cross_node=topo.nodes > 1) + launch
    alone = on_sms(phase.tiles, hw.sms) / world + launch
    beside = on_sms(phase.tiles, shared) / world + launch
    streams: list[Stage] = []
    comms: list[int] = []  # comms[j] brings block j+1; it forwards block j, so follows comms[j-1]
    for k in range(world):
        if k + 1 < world:  # receive block k+1 while computing on block k
            streams.append(Stage("comm", step_comm, step_comm, comms[-1] if comms else -1))
            comms.append(len(streams) - 1)
        streams.append(Stage("compute", alone, beside, comms[k - 1] if k else -1))
    time = pipeline(streams, list(range(len(streams))))
    step_compute = alone
    return BaselineResult("overlap", time, {"steps": world, "step_comm_s": step_comm,
                                            "step_compute_s": step_compute})  # fmt: skip


class Stage(NamedTuple):
    """One kernel of a two-stream pipeline: seconds alone and beside the other stream."""

    stream: str  # "compute" | "comm"
    alone: float
    beside: float
    after: int  # index of the stage it waits for, -1 for none


def pipeline(stages: list[Stage], issue: list[int]) -> float:
    """Makespan of two in-order streams running ``stages`` in ``issue`` order; a stage runs at
    its ``beside`` speed while the other stream is busy, at its ``alone`` speed otherwise."""
    queues: dict[str, deque[int]] = {"compute": deque(), "comm": deque()}
    for i in issue:
        queues[stages[i].stream].append(i)
    done = [False] * len(stages)
    left = [1.0] * len(stages)  # fraction of each stage still to run
    now = 0.0
    while queues["compute"] or queues["comm"]:
        running = [
            q[0]
            for q in queues.values()
            if q and (stages[q[0]].after < 0 or done[stages[q[0]].after])
        ]
        assert running, "pipeline deadlock: a stage waits on one issued after it"
        both = len(running) == 2
        rate = {}
        for i in running:
            secs = stages[i].beside if both else stages[i].alone
            rate[i] = 1.0 / max(secs, 1e-15)
        step = min(left[i] / rate[i] for i in running)
        now += step
        for i in running:
            left[i] -= step * rate[i]
            if left[i] <= 1e-12:
                done[i] = True
                queues[stages[i].stream].popleft()
    return now
