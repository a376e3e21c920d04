"""Attention on token-major q, k, v and out (issue 16, item 4): option ``token_major`` of the
attention op holds the named tensors as ``[B, S, heads * D]`` (a head is a column range of every
token row), and mgraph.trace.attention_map.token_major_attention folds the head split before
the op and the output merge after it into it. Checked: the op against torch SDPA on random
inputs (GQA, causal and not, a mask, heads and batches sharded; fp32 and bf16 on the reference
runtime), the regions it reads and writes (a head's D columns), the named error for a bad
name, traced Llama-style attention (the relayouts gone, the result as eager's; what keeps its
relayout), and the Triton bodies under TRITON_INTERPRET=1 (the megakernel in fp32, both ranks
in one program; run_chains in bf16, the TMA fast path)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import mgraph as mg
import mgraph.program
from helpers import check_graph, rel_err, run_interpreted, written_once
from mgraph.errors import ShapeError
from mgraph.trace.attention_map import token_major_attention
from mgraph.trace.pointwise import fuse_pointwise

HERE = Path(__file__).parent
DIMS = dict(B=2, H=4, S=64, D=16, block=32, kv_heads=2)


def _heads_first(x: torch.Tensor, S: int, D: int) -> torch.Tensor:
    return x.reshape(x.shape[0], S, -1, D).transpose(1, 2).float()


def _sdpa(x: dict, g: mg.TaskGraph, causal: bool, mask: torch.Tensor | None = None):
    """float32 SDPA on the op's inputs (token-major ones split into heads), as [B, H, S, D]."""
    S, D = g.params["S"], g.params["D"]
    tm = g.params.get("token_major", [])
    q, k, v = (_heads_first(x[n], S, D) if n in tm else x[n].float() for n in "qkv")
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=True)  # fmt: skip


@pytest.mark.parametrize(
    "topology, layout, token_major, causal",
    [
        ("1x1", None, ["q", "k", "v", "out"], True),
        ("1x2", ["shard", 1, False], ["v", "out"], True),  # heads: column ranges per rank
        ("1x2", ["shard", 1, False], ["q", "k"], False),
        ("2x1", ["shard", 0, False], ["k", "v", "out"], False),  # batches: token rows
    ],
)
def test_token_major_attention_matches_sdpa(topology, layout, token_major, causal):
    g = mg.ops.attention(topology=topology, layout=layout, token_major=token_major,
                         causal=causal, **DIMS)  # fmt: skip
    B, H, S, D = (DIMS[d] for d in "BHSD")
    for name in "qkv":
        heads = H if name == "q" else DIMS["kv_heads"]
        tm = (B, S, heads * D) if name in token_major else (B, heads, S, D)
        assert g.inputs[name].shape == tm
    check_graph(g, seed=3, tol=1e-5)  # the reference op vs the tasks on the CPU runtime
    written_once(g, "out")
    for t in g.tasks:  # every operand region is one head: D columns of block / kv rows
        regions = t.reads[:3] if t.kind == "attn_block" else t.writes
        assert all(r.col1 - r.col0 == D for r in regions), t.name
    x = mg.ops.get_op("attention").random_inputs(g, seed=4)
    got = mg.run(mg.schedule(g), x).outputs["out"]
    want = _sdpa(x, g, causal)
    if "out" in token_major:
        want = want.transpose(1, 2).reshape(B, S, H * D)
    assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.5e-2)])
def test_token_major_with_a_mask_matches_sdpa(dtype, tol):
    B, H, S, D = (DIMS[d] for d in "BHSD")
    g = mg.ops.attention(topology="1x2", layout=["shard", 1, False], dtype=dtype,
                         token_major=["q", "v", "out"], mask_shape=[B, 1, 1, S], **DIMS)  # fmt: skip
    x = mg.ops.get_op("attention").random_inputs(g, seed=5)
    shown = torch.rand(B, 1, 1, S, generator=torch.Generator().manual_seed(6)) < 0.7
    shown[..., 0] = True
    x["mask"] = torch.zeros(B, 1, 1, S).masked_fill(~shown, float("-inf")).to(dtype)
    x["mask"] = x["mask"].reshape(g.inputs["mask"].shape)
    got = mg.run(mg.schedule(g), x).outputs["out"]
    assert got.dtype == dtype
    want = _sdpa(x, g, False, mask=shown).transpose(1, 2).reshape(B, S, H * D)
    assert rel_err(got, want) < tol


def test_token_major_names_only_q_k_v_out():
    with pytest.raises(ShapeError, match="token_major names"):
        mg.ops.attention(topology="1x1", token_major=["mask"], **DIMS)


class _Attention(torch.nn.Module):
    """Llama's attention without RoPE: q, k and v are each a head split of a projection."""

    def __init__(self, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                 share_v: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.heads, self.kv_heads, self.share_v = heads, kv_heads, share_v
        self.D = hidden // heads
        self.q_proj = torch.nn.Linear(hidden, hidden, bias=False)
        self.k_proj = torch.nn.Linear(hidden, kv_heads * self.D, bias=False)
        self.v_proj = torch.nn.Linear(hidden, kv_heads * self.D, bias=False)
        self.o_proj = torch.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, -1, self.D).transpose(1, 2)
        k = self.k_proj(x).view(B, S, -1, self.D).transpose(1, 2)
        v = self.v_proj(x).view(B, S, -1, self.D).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out = self.o_proj(o.transpose(1, 2).reshape(B, S, -1))
        return (out, v) if self.share_v else out  # v a program output too: its split stays


PLAN = {
    "q_proj": mg.ColwiseParallel(),
    "k_proj": mg.ColwiseParallel(),
    "v_proj": mg.ColwiseParallel(),
    "o_proj": mg.RowwiseParallel(),
}


@pytest.mark.parametrize("topology", ["1x1", "1x2"])
@pytest.mark.parametrize("share_v", [False, True])
def test_traced_head_splits_and_merge_fold_into_the_attention(monkeypatch, topology, share_v):
    torch.manual_seed(0)
    model = _Attention(share_v=share_v).eval()
    x = torch.randn(2, 64, 128)
    # mg.compile runs fuse_pointwise only: run the fold after it, as the program would
    monkeypatch.setattr(mgraph.program, "fuse_pointwise",
                        lambda og: token_major_attention(fuse_pointwise(og)))  # fmt: skip
    prog = mg.compile(model, (x,), plan=PLAN, topology=topology)
    (att,) = [n for n in prog.lowered.nodes if n.op == "attention"]
    want_tm = ["k", "out", "q"] if share_v else ["k", "out", "q", "v"]
    assert att.params["token_major"] == want_tm
    relayouts = [n for n in prog.lowered.nodes if n.op == "relayout"]
    assert [n.inputs["x"].shape for n in relayouts] == ([(2, 64, 64)] if share_v else [])
    assert [n.op for n in prog.opgraph.nodes].count("relayout") >= 4  # the traced graph as was
    got, want = prog(x), model(x)
    for g, w in zip(*((got, want) if share_v else ((got,), (want,))), strict=True):
        assert rel_err(g, w) < 1e-5


def test_a_merge_read_by_two_ops_keeps_its_relayout():
    class Two(_Attention):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            B, S, _ = x.shape
            q = self.q_proj(x).view(B, S, -1, self.D).transpose(1, 2)
            k = self.k_proj(x).view(B, S, -1, self.D).transpose(1, 2)
            v = self.v_proj(x).view(B, S, -1, self.D).transpose(1, 2)
            o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            return self.o_proj(o.transpose(1, 2).reshape(B, S, -1)), o

    torch.manual_seed(1)
    model = Two().eval()
    x = torch.randn(1, 32, 128)
    og = token_major_attention(fuse_pointwise(mg.trace.trace(model, (x,))))
    (att,) = [n for n in og.nodes if n.op == "attention"]
    assert att.params["token_major"] == ["k", "q", "v"]  # o an output too: head-major
    assert [n.op for n in og.nodes].count("relayout") == 1


_INTERP = """
import json, sys, torch
sys.path.insert(0, {here!r})
import mgraph as mg
from megakernel_attention_interp import compare, _inputs
from mgraph.runtime.megakernel import run_in_process
F = torch.nn.functional

def sdpa(g, x, causal):
    S, D, tm = g.params["S"], g.params["D"], g.params.get("token_major", [])
    q, k, v = (x[n].float().reshape(x[n].shape[0], S, -1, D).transpose(1, 2) if n in tm
               else x[n].float() for n in "qkv")
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

def run(case, g, x, causal, chains=False):
    # compare() reshapes outputs to SDPA's [B, H, S, D]: give it the token-major order
    want = sdpa(g, x, causal)
    B, H, S, D = want.shape
    if "out" in g.params.get("token_major", []):
        want = want.transpose(1, 2).reshape(B, S, H, D).reshape(B, H, S, D)
    compare(case, g, x, want, chains=chains)

dims = dict(B=2, H=4, S=64, D=32, block=32, kv_heads=2)
g = mg.ops.attention(topology="1x1", causal=True, token_major=["q", "k", "v", "out"],
                     dtype=torch.float32, **dims)
run("mk-1x1-causal", g, _inputs(g, seed=41), True)
g = mg.ops.attention(topology="1x2", layout=["shard", 1, False], token_major=["v", "out"],
                     dtype=torch.float32, **dims)
run("mk-1x2-heads", g, _inputs(g, seed=42), False)
g = mg.ops.attention(topology="1x1", causal=True, token_major=["q", "k", "v", "out"],
                     dtype=torch.bfloat16, **dims)
run("chains-bf16-causal", g, _inputs(g, seed=43, dtype=torch.bfloat16), True, chains=True)

# traced: the megakernel runs the projections' GEMMs on the token-major tensors it shares with
# the attention (mg.compile with the fold, as test_traced_head_splits_... runs it)
import mgraph.program
from mgraph.trace.attention_map import token_major_attention
from mgraph.trace.pointwise import fuse_pointwise
from test_attention_token_major import PLAN, _Attention
mgraph.program.fuse_pointwise = lambda og: token_major_attention(fuse_pointwise(og))
torch.manual_seed(44)
model, x = _Attention().eval(), torch.randn(1, 64, 128)
prog = mg.compile(model, (x,), plan=PLAN, backend="triton", backend_options={{"interpret": True}})
(att,) = [n for n in prog.lowered.nodes if n.op == "attention"]
got, want = prog(x), model(x)
print(json.dumps({{"case": "traced-1x1", "token_major": att.params["token_major"],
                  "error_ref": ((got - want).norm() / want.norm()).item(), "error_sdpa": 0.0,
                  "nans": int(got.isnan().sum()), "zero_rows": 0}}))
"""


def test_triton_bodies_on_token_major_tensors_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(HERE))
    proc = run_interpreted(["-c", _INTERP.format(here=str(HERE))], env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            rows[r["case"]] = r
    assert set(rows) == {"mk-1x1-causal", "mk-1x2-heads", "chains-bf16-causal", "traced-1x1"}
    assert rows["traced-1x1"]["token_major"] == ["k", "out", "q", "v"]
    for case, r in rows.items():
        tol = 1.5e-2 if "bf16" in case else 1e-5
        assert r["error_ref"] < tol and r["error_sdpa"] < tol, (case, r)
        assert r["nans"] == 0 and r["zero_rows"] == 0, (case, r)
