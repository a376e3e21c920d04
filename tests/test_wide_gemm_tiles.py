"""Traced linears on one GPU get wide GEMM tasks (128 x 1024: four kernel blocks a task) where
the op still has a task for every SM of an H200 and its columns split into whole wide tasks;
otherwise, and on several ranks or with a plan's own tile, the op's tile stays."""

from __future__ import annotations

import torch
from torch import nn

import mgraph as mg
from helpers import rel_err


def _gemm_tiles(prog: mg.Program) -> set[tuple[int, int]]:
    return {t.writes[0].shape for t in prog.graph.tasks if t.kind == "gemm"}


def test_a_big_traced_linear_gets_wide_tasks_and_the_right_answer():
    torch.manual_seed(0)
    lin = nn.Linear(64, 1024, bias=False)
    x = torch.randn(132 * 128, 64)  # 132 row tiles x 1 wide column task: one per SM
    prog = mg.compile(lin, (x,))
    assert _gemm_tiles(prog) == {(128, 1024)}
    with torch.no_grad():
        assert rel_err(prog(x), lin(x)) < 1e-5


def test_small_or_ragged_or_planned_linears_keep_the_op_tile():
    lin = nn.Linear(64, 1024, bias=False)
    small = mg.compile(lin, (torch.randn(131 * 128, 64),))  # 131 tasks: an SM would idle
    assert _gemm_tiles(small) == {(128, 256)}
    ragged = mg.compile(nn.Linear(64, 1280, bias=False), (torch.randn(132 * 128, 64),))
    assert (128, 1024) not in _gemm_tiles(ragged)
    planned = mg.compile(
        lin, (torch.randn(132 * 128, 64),), plan={"": mg.ColwiseParallel(options={"tile": [64, 128]})}
    )
    assert _gemm_tiles(planned) == {(64, 128)}
