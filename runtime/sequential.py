"""The simplest executor: every task of every rank, one at a time, in a topological order.

It is the oracle the threaded reference runtime and property tests compare against: no queues,
no workers, no counters, just the graph's meaning.
"""

from __future__ import annotations

import torch

from mgraph.graph import TaskGraph
from mgraph.kinds import KINDS
from mgraph.validate import topo_order

from .memory import Memory, allocate, gather_outputs, region_view, shard_inputs

__all__ = ["run_sequential", "execute_sequential"]


def execute_sequential(graph: TaskGraph, inputs: dict[str, torch.Tensor]) -> Memory:
    """Every buffer of every rank after running all tasks one at a time."""
    mem = allocate(graph)
    shard_inputs(graph, inputs, mem)
    for tid in topo_order(graph):
        task = graph.tasks[tid]
        reads = [region_view(mem, r) for r in task.reads]
        writes = [region_view(mem, w) for w in task.writes]
        KINDS[task.kind].run_cpu(task, reads, writes)
    return mem


def run_sequential(graph: TaskGraph, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return gather_outputs(graph, execute_sequential(graph, inputs))
