"""Tracing a module onto each fused op gives the hand-built op's graph; the layout-following ops
(matmul, elementwise, norms, attention, relayout) match torch standalone; layouts and runs."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mgraph as mg
from helpers import check_graph, rel_err
from mgraph.layout import (
    REPLICATE,
    ROWS,
    Layout,
    binding_runs,
    canonical,
    layout_runs,
    permute_layout,
    view_layout,
)
from mgraph.ops.moe_tiles import route_topk, swiglu


def same_stats(a: mg.TaskGraph, b: mg.TaskGraph) -> None:
    sa, sb = a.stats(), b.stats()
    assert sa.tasks == sb.tasks
    assert sa.flops_per_rank == pytest.approx(sb.flops_per_rank)
    assert sa.bytes_by_link == sb.bytes_by_link
    assert sa.rdma_sent_per_node == sb.rdma_sent_per_node
    assert sa.nvlink_per_node == sb.nvlink_per_node


class Proj(nn.Module):
    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.proj = nn.Linear(k, n, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


LINEAR_CASES = [
    ("gemm_allreduce", mg.RowwiseParallel()),
    ("gemm_reduce_scatter", mg.RowwiseParallel(output_layouts=mg.Shard(0))),
    ("allgather_gemm", mg.ColwiseParallel(input_layouts=mg.Shard(0))),
]


@pytest.mark.parametrize("op, style", LINEAR_CASES, ids=[c[0] for c in LINEAR_CASES])
@pytest.mark.parametrize("topology", ["2x2", "2x4"])
def test_planned_linear_is_the_fused_op(op, style, topology):
    torch.manual_seed(0)
    M, K, N = 64, 32, 64
    model = Proj(K, N)
    x = torch.randn(M, K)
    prog = mg.compile(model, (x,), plan={"proj": style}, topology=topology)
    assert [n.op for n in prog.opgraph.nodes] == [op]
    same_stats(prog.graph, mg.ops.get_op(op)(M=M, N=N, K=K, topology=topology))
    if topology == "2x2":
        assert rel_err(prog(x), model(x).detach()) < 1e-5


class SDPA(nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)


@pytest.mark.parametrize("causal", [True, False])
def test_context_parallel_attention_is_ring_attention(causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    model = SDPA(causal)
    plan = {"": mg.ContextParallel(options={"block": 8})}
    prog = mg.compile(model, (q, k, v), plan=plan, topology="2x2")
    assert [n.op for n in prog.opgraph.nodes] == ["ring_attention"]
    ref = mg.ops.ring_attention(B=1, H=2, S=64, D=16, causal=causal, block=8, topology="2x2")
    same_stats(prog.graph, ref)
    assert rel_err(prog(q, k, v), model(q, k, v)) < 1e-5


class Experts(nn.Module):
    """An MoE block whose router logits come in: exactly moe_dispatch_combine's inputs."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.experts = nn.ModuleList(
            nn.ModuleDict(
                {
                    n: nn.Linear(*io, bias=False)
                    for n, io in (
                        ("gate_proj", (hidden, ffn)),
                        ("up_proj", (hidden, ffn)),
                        ("down_proj", (ffn, hidden)),
                    )
                }
            )
            for _ in range(experts)
        )

    def forward(self, x, router_logits):
        weights, chosen = route_topk(router_logits, self.top_k)
        out = torch.zeros_like(x)
        for e, ex in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            if token.numel():
                y = swiglu(
                    x[token],
                    ex["gate_proj"].weight.t(),
                    ex["up_proj"].weight.t(),
                    ex["down_proj"].weight.t(),
                )
                out.index_add_(0, token, y * weights[token, slot, None])
        return out


def test_expert_parallel_block_is_moe_dispatch_combine():
    torch.manual_seed(0)
    T, H, E, k, F_ = 32, 16, 8, 2, 32
    model = Experts(H, F_, E, k)
    x, logits = torch.randn(T, H), torch.randn(T, E)
    prog = mg.compile(model, (x, logits), plan={"": mg.ExpertParallel()}, topology="2x2")
    assert [n.op for n in prog.opgraph.nodes] == ["moe_dispatch_combine"]
    same_stats(
        prog.graph, mg.ops.moe_dispatch_combine(T=T, H=H, E=E, top_k=k, F=F_, topology="2x2")
    )
    with torch.no_grad():
        assert rel_err(prog(x, logits), model(x, logits)) < 1e-5


# -- the layout-following ops, standalone --------------------------------------------------------
SHARD1 = Layout("shard", 1).to_json()


@pytest.mark.parametrize("topology", ["1x2", "2x2"])
def test_tilewise_ops_match_torch(topology):
    rows = ROWS.to_json()
    check_graph(mg.ops.elementwise(rows=16, cols=8, fn="silu", layout=rows, topology=topology))
    check_graph(
        mg.ops.elementwise(
            rows=16, cols=8, fn="mul", other="row", tile_rows=4, layout=SHARD1, topology=topology
        )
    )
    check_graph(
        mg.ops.elementwise(
            rows=16,
            cols=8,
            fn="div",
            other="col",
            swap=True,
            layout=rows,
            tile_rows=4,
            topology=topology,
        )
    )
    check_graph(mg.ops.elementwise(rows=16, cols=8, fn="pow", scalar=2.0, topology=topology))
    check_graph(mg.ops.rms_norm(rows=16, cols=8, shape=[2, 8, 8], layout=SHARD1, topology=topology))
    check_graph(mg.ops.layer_norm(rows=16, cols=8, layout=rows, topology=topology))
    check_graph(mg.ops.softmax(rows=16, cols=8, topology=topology))
    check_graph(mg.ops.row_reduce(rows=16, cols=8, fn="amax", layout=rows, topology=topology))


@pytest.mark.parametrize("topology", ["1x2", "2x2"])
def test_matmul_attention_relayout_match_torch(topology):
    zigzag1 = Layout("shard", 1, True).to_json()
    check_graph(mg.ops.matmul(M=16, N=8, K=8, shard="cols", topology=topology))
    check_graph(
        mg.ops.matmul(
            M=16, N=8, K=8, shape=[1, 16, 8], layout=zigzag1, tile=[4, 4], topology=topology
        )
    )
    check_graph(
        mg.ops.attention(
            B=2, H=4, S=16, D=8, causal=True, block=4, layout=SHARD1, topology=topology
        )
    )
    check_graph(mg.ops.attention(B=2, H=4, S=16, D=8, block=8, topology=topology))
    # head split + transpose of a column-sharded projection; zigzag sequence moved to dim 2
    check_graph(
        mg.ops.relayout(
            rows=16,
            cols=16,
            in_shape=[1, 16, 16],
            steps=[["view", [1, 16, 4, 4]], ["permute", [0, 2, 1, 3]]],
            in_layout=Layout("shard", 2).to_json(),
            out_layout=SHARD1,
            tile_rows=8,
            topology=topology,
        )
    )
    check_graph(
        mg.ops.relayout(
            rows=64,
            cols=4,
            in_shape=[1, 16, 4, 4],
            steps=[["permute", [0, 2, 1, 3]]],
            in_layout=zigzag1,
            out_layout=Layout("shard", 2, True).to_json(),
            topology=topology,
        )
    )


def test_relayout_rejects_a_layout_a_rank_cannot_produce():
    with pytest.raises(mg.ShapeError, match="does not hold every element"):
        mg.ops.relayout(
            rows=16,
            cols=16,
            in_shape=[16, 16],
            steps=[["permute", [1, 0]]],
            in_layout=ROWS.to_json(),
            out_layout=ROWS.to_json(),
            topology="1x2",
        )


def test_layout_runs():
    # zigzag over 2 ranks: chunks 0 and 3 of 4 per head, merged where they continue
    assert layout_runs((1, 2, 8, 4), Layout("shard", 2, True), 0, 2) == (
        (0, 2, 0, 4),
        (6, 10, 0, 4),
        (14, 16, 0, 4),
    )
    assert layout_runs((2, 3, 6), Layout("shard", 2), 1, 2) == ((0, 6, 3, 6),)
    assert layout_runs((4, 6), ROWS, 1, 2) == ((2, 4, 0, 6),)
    assert layout_runs((4, 6), REPLICATE, 1, 2) == ((0, 4, 0, 6),)
    # a Binding with pieces concatenated along dim 1
    assert binding_runs((2, 4, 3), [((0, 2), (0, 1), (0, 3)), ((0, 2), (3, 4), (0, 3))], 1) == (
        (0, 1, 0, 3),
        (3, 5, 0, 3),
        (7, 8, 0, 3),
    )
    assert canonical((1, 8, 4), Layout("shard", 1), 2) == ROWS
    assert canonical((2, 8, 4), Layout("shard", 1), 2) == Layout("shard", 1)
    # head split keeps the column shard on the heads dim; transpose moves it
    assert view_layout((1, 8, 12), (1, 8, 3, 4), Layout("shard", 2), 3) == Layout("shard", 2)
    assert permute_layout((2, 8, 3, 4), (0, 2, 1, 3), Layout("shard", 2), 3) == Layout("shard", 1)
    assert view_layout((2, 6, 4), (12, 4), Layout("shard", 1), 4) is None


class Stacks(nn.Module):
    """torch.stack along every dim, and the interleaved rotate_half of Cohere, GLM and Helium
    (strided slices, stack on a new last dim, flatten)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, x, y):
        rot = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
        return torch.stack((x * 2.0, y, rot), dim=self.dim)


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_stack_is_a_cat_of_new_dims(dim):
    torch.manual_seed(dim % 4)
    x, y = torch.randn(2, 12, 32), torch.randn(2, 12, 32)
    model = Stacks(dim)
    prog = mg.compile(model, (x, y))
    assert "concat" in {n.op for n in prog.opgraph.nodes}
    assert rel_err(prog(x, y), model(x, y)) < 1e-6


class AddMM(nn.Module):
    """GPT-2's Conv1D: torch.addmm(bias, x, W) with W [in, out]."""

    def __init__(self, beta: float = 1.0) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 48) / 32**0.5)
        self.b = nn.Parameter(torch.randn(48))
        self.beta = beta

    def forward(self, x):
        return torch.addmm(self.b, x.view(-1, 32), self.w, beta=self.beta).view(2, 12, 48)


def test_addmm_is_a_matmul_and_a_bias():
    torch.manual_seed(3)
    x = torch.randn(2, 12, 32)
    model = AddMM()
    prog = mg.compile(model, (x,))
    assert {"matmul", "elementwise"} <= {n.op for n in prog.opgraph.nodes}
    assert rel_err(prog(x), model(x)) < 1e-5
    with pytest.raises(mg.UnsupportedOpError, match="beta or alpha"):
        mg.compile(AddMM(beta=0.5), (x,))
