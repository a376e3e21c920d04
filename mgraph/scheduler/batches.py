"""Proxy batches: a rank's rdma queue cut into the groups of commands the host proxy submits at
once (one doorbell, one completion poll per batch instead of per command).

A batch is a run of consecutive rdma tasks to ONE destination rank, at most
``hardware.proxy_batch`` long. One destination per batch because a batch becomes one posted
work-request list on one queue pair; consecutive, because the rdma worker pushes commands in
queue order and a batch must never wait for a command queued after one that has not been
pushed yet.
"""

from __future__ import annotations

from ..graph import TaskGraph
from ..hardware import HardwareProfile
from .checks import rdma_destination

__all__ = ["proxy_batches"]


def proxy_batches(
    graph: TaskGraph, rdma_queue: list[int], hardware: HardwareProfile
) -> list[list[int]]:
    limit = hardware.proxy_batch
    batches: list[list[int]] = []
    current: list[int] = []
    current_dst = -1
    for tid in rdma_queue:
        dst = rdma_destination(graph, tid)
        if current and (dst != current_dst or len(current) == limit):
            batches.append(current)
            current = []
        current.append(tid)
        current_dst = dst
    if current:
        batches.append(current)
    return batches
