"""Gated linear units traced as one op (``mg.compile(..., glu=True)``; off by default, measured
slower so far): ``act(gate_proj(x)) * up_proj(x)`` with SiLU becomes one ``matmul_glu`` node
(mgraph/trace/glu.py) reading the two weights packed block by block, whose ``gemm_glu`` tasks
compute both products of a tile in one dot and apply the unit in the epilogue (gemm's body runs
them: one K loop in the kernel). Checked against
eager torch on random inputs on the reference runtime (and under tensor parallelism), in the
megakernel under TRITON_INTERPRET=1 (this file re-run as a script), and the forms that must NOT
fuse stay as they were."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mgraph as mg
from helpers import interpreter_rows, rel_err


class MLP(nn.Module):
    def __init__(self, hidden: int = 64, ffn: int = 128, act=F.silu, swap: bool = False,
                 leak: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)
        self.act, self.swap, self.leak = act, swap, leak

    def forward(self, x):
        g, u = self.act(self.gate_proj(x)), self.up_proj(x)
        y = self.down_proj(u * g if self.swap else g * u)
        return (y, u) if self.leak else y


def _ops(prog: mg.Program) -> list[str]:
    return [n.op for n in prog.lowered.nodes]


@pytest.mark.parametrize("swap", [False, True])
def test_silu_gate_times_up_is_one_op_and_matches_eager(swap):
    torch.manual_seed(0)
    mlp, x = MLP(swap=swap), torch.randn(2, 48, 64)
    prog = mg.compile(mlp, (x,), glu=True)
    assert _ops(prog) == ["matmul_glu", "matmul"], _ops(prog)
    assert {t.kind for t in prog.graph.tasks} == {"gemm_glu", "gemm"}
    with torch.no_grad():
        assert rel_err(prog(x), mlp(x)) < 1e-5
    unfused = mg.compile(mlp, (x,))  # the default (the fused op measured slower: NOTES v14)
    assert _ops(unfused) == ["matmul", "matmul", "elementwise", "matmul"]


def test_packing_round_trips_and_weight_updates_reach_the_packed_copy():
    from mgraph.ops.matmul_glu import pack_glu, unpack_glu

    gate, up = torch.randn(32, 256), torch.randn(32, 256)
    w = pack_glu(gate, up)
    assert torch.equal(w[:, :128], gate[:, :128]) and torch.equal(w[:, 128:256], up[:, :128])
    assert all(torch.equal(a, b) for a, b in zip(unpack_glu(w), (gate, up), strict=True))
    torch.manual_seed(3)
    mlp, x = MLP(), torch.randn(2, 48, 64)
    prog = mg.compile(mlp, (x,), glu=True)
    with torch.no_grad():
        prog(x)
        mlp.up_proj.weight.mul_(0.5)  # in place: the version counter says it changed
        assert rel_err(prog(x), mlp(x)) < 1e-5


def test_other_forms_are_left_alone():
    x = torch.randn(2, 48, 64)
    ragged = mg.compile(MLP(ffn=192), (x,), glu=True)  # not whole 128-column packed blocks
    assert "matmul_glu" not in _ops(ragged)
    gelu = mg.compile(MLP(act=F.gelu), (x,), glu=True)  # another activation
    assert "matmul_glu" not in _ops(gelu)
    leak = mg.compile(MLP(leak=True), (x,), glu=True)  # up's activation is also an output
    assert "matmul_glu" not in _ops(leak)


def test_tensor_parallel_glu_matches_eager():
    torch.manual_seed(1)
    mlp, x = MLP(ffn=256), torch.randn(2, 48, 64)  # 128 columns a rank: whole packed blocks
    plan = {"gate_proj": mg.ColwiseParallel(), "up_proj": mg.ColwiseParallel(),
            "down_proj": mg.RowwiseParallel()}
    prog = mg.compile(mlp, (x,), plan=plan, topology="1x2", glu=True)
    assert "matmul_glu" in _ops(prog)
    glu = next(n for n in prog.lowered.nodes if n.op == "matmul_glu")
    assert glu.params["shard"] == "cols"
    with torch.no_grad():
        assert rel_err(prog(x), mlp(x)) < 1e-5


def test_gemm_glu_runs_in_gemms_body_one_branch_one_k_loop():
    """gemm_glu tasks run in gemm's Triton body, from ONE dispatch branch for both kinds: a body
    of their own inlined a second copy of the pipelined K loop, and ptxas serialised every
    wgmma of the kernel (mgraph/ops/matmul_glu.py). The glu epilogue is compiled only into
    kernels that run gemm_glu tasks (the GLU constexpr), so others keep their code."""
    pytest.importorskip("triton")
    from mgraph.kinds import KINDS
    from mgraph.runtime.megakernel.dispatch import body_constexprs, dispatch_source
    from mgraph.runtime.megakernel.encode import kind_id

    assert KINDS["gemm_glu"].triton_body is KINDS["gemm"].triton_body
    kinds = {k: kind_id(k) for k in ("gemm", "gemm_glu", "ewise")}
    block, _ = dispatch_source(kinds, "")
    calls = [line for line in block.splitlines() if "_body_" in line]
    assert len(calls) == 2 and f"kind == {kinds['gemm_glu']}" in block, block
    x = torch.randn(2, 48, 64)
    for glu in (True, False):
        graph = mg.compile(MLP(), (x,), glu=glu).graph
        assert body_constexprs(graph, [t.id for t in graph.tasks])["GLU"] is glu


def test_glu_in_the_megakernel_under_the_interpreter():
    pytest.importorskip("triton")
    rows = interpreter_rows("test_glu_fusion.py")
    assert list(rows) == ["mlp", "mlp-tile"], rows
    for r in rows.values():
        assert r["kinds"] == ["gemm", "gemm_glu"] and r["error"] < 1e-5, r


if __name__ == "__main__":
    assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
    torch.manual_seed(2)
    mlp, x = MLP(hidden=64, ffn=384), torch.randn(1, 200, 64)  # 200 rows: a short row edge
    for case, plan in (("mlp", None),
                       ("mlp-tile", {p: mg.ColwiseParallel(options={"tile": [128, 256]})
                                     for p in ("gate_proj", "up_proj")})):
        prog = mg.compile(mlp, (x,), plan=plan, backend="triton", glu=True,
                          backend_options={"interpret": True})
        with torch.no_grad():
            err = rel_err(prog(x), mlp(x))
        print(json.dumps({"case": case, "error": err,
                          "kinds": sorted({t.kind for t in prog.graph.tasks})}), flush=True)
