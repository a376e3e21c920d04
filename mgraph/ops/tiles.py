"""Tile bodies of the generic kinds every collective uses: gemm, reduce, copy.

CPU bodies are the meaning of each kind (the reference runtimes execute them); they accumulate in
fp32 and cast once on the store, as the GPU tile bodies do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..graph import Task
from ..kinds import TaskKind, kind_spec

GEMM = kind_spec(TaskKind.GEMM)
REDUCE = kind_spec(TaskKind.REDUCE)
COPY = kind_spec(TaskKind.COPY)


@GEMM.cpu
def _gemm_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    a, b = reads
    writes[0].copy_(a.float() @ b.float())


@GEMM.flops
def _gemm_flops(reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict):
    (m, k), (_, n) = reads[0], reads[1]
    return 2.0 * m * n * k


@REDUCE.cpu
def _reduce_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    acc = reads[0].float().clone()
    for r in reads[1:]:
        acc += r.float()
    writes[0].copy_(acc)


@REDUCE.flops
def _reduce_flops(reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict):
    m, n = writes[0]
    return float(m * n * (len(reads) - 1))


@COPY.cpu
def _copy_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    for w in writes:
        w.copy_(reads[0])


@COPY.flops
def _copy_flops(reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict):
    return 0.0
