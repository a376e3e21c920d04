"""NCCL-like collectives over the simulator's links: the time of one collective call.

Each collective has a few algorithms, each a latency term (a fixed cost plus a cost per step,
NVLink or network, the shape of NCCL's own tuning model in src/graph/tuning.cc) and a bandwidth
term over the links it loads hardest; ``best`` picks the fastest, as NCCL's tuner does.

- ring: one ring through all p ranks, cut into one channel per NIC of a node, so each channel's
  cross-node hop has a NIC of its own. Per rank it moves 2(p-1)/p D (all-reduce) or (p-1)/p D
  (reduce-scatter, all-gather) at ``min(NVLink bus bw, G x NIC bw)``.
- tree (all-reduce): NCCL's chain inside a node and binary tree across nodes, pipelined; D goes
  up and down once (2 D at 90% of the ring's bandwidth, NCCL's tree factor) with log-depth latency.
- hierarchical (multi-node): reduce-scatter inside the node over NVLink, the collective on D/G
  across nodes over each GPU's own NIC, all-gather inside the node; phases one after another.
- all-to-all: each rank's intra-node share over NVLink and inter-node share over its NIC, in
  parallel. p2p: one send to a peer (a ring step).
NVLink bus bandwidth is NCCL's measured one (``nccl_nvlink_gbps``, GPU.md), the network's the NIC
rate times ``nccl_rdma_efficiency``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mgraph.errors import UnknownNameError
from mgraph.hardware import HardwareProfile
from mgraph.topology import Topology

__all__ = ["Fabric", "COLLECTIVES", "collective_times", "best", "p2p_time"]


@dataclass(frozen=True)
class Fabric:
    nodes: int
    gpus: int
    nvlink: float  # bytes/s, NCCL bus bandwidth inside a node
    net: float  # bytes/s NCCL reaches through one NIC
    base: float  # seconds per call
    nvl_step: float  # seconds per NVLink step
    net_step: float  # seconds per network step

    @classmethod
    def of(cls, topology: Topology, hw: HardwareProfile) -> Fabric:
        return cls(
            topology.nodes, topology.gpus_per_node, hw.nccl_nvlink_gbps * 1e9,
            hw.rdma_gbps * 1e9 * hw.nccl_rdma_efficiency, hw.nccl_base_us * 1e-6,
            hw.nccl_nvlink_step_us * 1e-6, hw.nccl_net_step_us * 1e-6,
        )  # fmt: skip

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus

    @property
    def ring_bw(self) -> float:
        return self.nvlink if self.nodes == 1 else min(self.nvlink, self.gpus * self.net)

    def steps(self, total: int, inter: int) -> float:
        """Latency of ``total`` ring steps of which ``inter`` cross nodes."""
        return self.base + (total - inter) * self.nvl_step + inter * self.net_step


def _ring(f: Fabric, nbytes: float, passes: int) -> float:
    p, n = f.ranks, f.nodes
    return f.steps(passes * (p - 1), passes * (n - 1)) + passes * (p - 1) / p * nbytes / f.ring_bw


def _intra(f: Fabric, nbytes: float) -> float:
    """One reduce-scatter or all-gather of ``nbytes`` over the G GPUs of a node."""
    g = f.gpus
    if g == 1:
        return 0.0
    return f.steps(g - 1, 0) + (g - 1) / g * nbytes / f.nvlink


def _inter(f: Fabric, nbytes: float, passes: int) -> float:
    """A ring over the N rail peers (one NIC each) on ``nbytes`` per GPU."""
    n = f.nodes
    return f.base + passes * (n - 1) * f.net_step + passes * (n - 1) / n * nbytes / f.net


def all_reduce(f: Fabric, nbytes: float) -> dict[str, float]:
    if f.ranks == 1:
        return {"local": 0.0}
    out = {"ring": _ring(f, nbytes, 2)}
    depth = math.ceil(math.log2(f.nodes)) if f.nodes > 1 else 0
    out["tree"] = (
        f.base
        + 2 * ((f.gpus - 1) * f.nvl_step + depth * f.net_step)
        + 2 * nbytes / (0.9 * f.ring_bw)
    )
    if f.nodes > 1:
        out["hierarchical"] = 2 * _intra(f, nbytes) + _inter(f, nbytes / f.gpus, 2)
    return out


def reduce_scatter(f: Fabric, nbytes: float) -> dict[str, float]:
    """``nbytes``: the full input on each rank (each rank keeps 1/p of it)."""
    if f.ranks == 1:
        return {"local": 0.0}
    out = {"ring": _ring(f, nbytes, 1)}
    if f.nodes > 1:
        out["hierarchical"] = _intra(f, nbytes) + _inter(f, nbytes / f.gpus, 1)
    return out


def all_gather(f: Fabric, nbytes: float) -> dict[str, float]:
    """``nbytes``: the full output on each rank (each rank contributes 1/p of it)."""
    return reduce_scatter(f, nbytes)  # the same traffic, reversed


def all_to_all(f: Fabric, nbytes: float) -> dict[str, float]:
    """``nbytes``: what each rank sends, spread evenly over all ranks (itself included)."""
    p, g = f.ranks, f.gpus
    if p == 1:
        return {"local": 0.0}
    intra = nbytes * (g - 1) / p / f.nvlink
    inter = nbytes * (p - g) / p / f.net
    steps = f.base + (f.nvl_step if g > 1 else 0.0) + (f.net_step if f.nodes > 1 else 0.0)
    return {"direct": steps + max(intra, inter)}


def p2p_time(f: Fabric, nbytes: float, cross_node: bool) -> float:
    """One send of ``nbytes`` to a peer, every rank sending at once (a ring step)."""
    if cross_node:
        return f.base + f.net_step + nbytes / f.net
    return f.base + f.nvl_step + nbytes / f.nvlink


COLLECTIVES = {
    "all_reduce": all_reduce,
    "reduce_scatter": reduce_scatter,
    "all_gather": all_gather,
    "all_to_all": all_to_all,
}


def collective_times(
    name: str, nbytes: float, topology: Topology, hw: HardwareProfile
) -> dict[str, float]:
    """Seconds of collective ``name`` on ``nbytes`` for each algorithm."""
    try:
        fn = COLLECTIVES[name]
    except KeyError:
        raise UnknownNameError(
            f"unknown collective {name!r}; modelled: {', '.join(sorted(COLLECTIVES))}"
        ) from None
    return fn(Fabric.of(topology, hw), nbytes)


def best(times: dict[str, float]) -> tuple[str, float]:
    """The fastest algorithm and its time (ties: the name first in sorted order)."""
    name = min(sorted(times), key=times.__getitem__)
    return name, times[name]
