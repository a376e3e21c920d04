"""The attention tile's less common paths compiled and run on a GPU (``pytest -m gpu``; skipped
without CUDA), through run_chains, against float32 SDPA on the same inputs, causal with
grouped-query heads. test_triton_attention.py's GPU case takes the 128-column TMA fast path.
Here: the pointer path, a ``noinline`` function on mma.sync (mgraph/ops/attention_tiles.py) that
no other GPU test reaches, by a head past 256 in bf16 (320) and by float32 data (64); and the
256-column TMA fast path (``ATTN_D`` 256) by a bf16 head of 160."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

# bf16 data: half an ulp on inputs and output, p rounded to bf16 (as test_triton_attention.py);
# float32 data: the dots run in TF32 on the GPU (10-bit mantissas), about 1e-3 relative
TOL = {"bfloat16": 1.5e-2, "float32": 5e-3}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,D", [("bfloat16", 320), ("float32", 64), ("bfloat16", 160)])
def test_gpu_attention_paths_match_sdpa(dtype, D):
    import torch
    import torch.nn.functional as F

    import mgraph as mg
    from mgraph.ops.attention_tiles import run_chains
    from mgraph.runtime.memory import worst_tile_error

    B, H, S = 1, 4, 512
    dt = getattr(torch, dtype)
    g = mg.ops.attention(topology="1x1", B=B, H=H, S=S, D=D, block=128, kv_heads=2, causal=True,
                         dtype=dt)
    gen = torch.Generator().manual_seed(D)
    x = {n: torch.randn(s.shape, generator=gen).to(dt) for n, s in g.inputs.items()}
    got = run_chains(mg.schedule(g), x, device="cuda")["out"].float().cpu()
    q, k, v = (x[n].float() for n in "qkv")
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert bool(got.isfinite().all())
    assert ((got - want).norm() / want.norm()).item() < TOL[dtype]
    tile = worst_tile_error(got.reshape(-1, D), want.reshape(-1, D), rows=128, cols=D)
    assert tile < TOL[dtype], tile


@pytest.mark.gpu
@pytest.mark.parametrize("S,block", [(1000, 128), (300, 64)])
def test_gpu_short_last_blocks_match_sdpa(S, block):
    """A sequence the blocks do not divide (the last query and key blocks short), bf16 at
    D 128 (the TMA fast path), causal with grouped-query heads, through run_chains."""
    import torch
    import torch.nn.functional as F

    import mgraph as mg
    from mgraph.ops.attention_tiles import run_chains
    from mgraph.runtime.memory import worst_tile_error

    g = mg.ops.attention(topology="1x1", B=1, H=4, S=S, D=128, block=block, kv_heads=2,
                         causal=True, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(S)
    x = {n: torch.randn(s.shape, generator=gen).to(torch.bfloat16) for n, s in g.inputs.items()}
    got = run_chains(mg.schedule(g), x, device="cuda")["out"].float().cpu()
    q, k, v = (x[n].float() for n in "qkv")
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert bool(got.isfinite().all())
    assert ((got - want).norm() / want.norm()).item() < TOL["bfloat16"]
    rows = got.reshape(-1, 128)
    assert worst_tile_error(rows, want.reshape(-1, 128), rows=50, cols=128) < TOL["bfloat16"]


@pytest.mark.gpu
def test_gpu_soft_capped_scores_match_the_capped_reference():
    """attention's ``softcap`` (Gemma2) on a GPU: the pointer path, bf16, causal GQA."""
    import torch

    import mgraph as mg
    from mgraph.ops.attention_tiles import run_chains

    S, D, cap = 512, 128, 2.0
    g = mg.ops.attention(topology="1x1", B=1, H=4, S=S, D=D, block=128, kv_heads=2,
                         causal=True, softcap=cap, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    x = {n: torch.randn(s.shape, generator=gen).to(torch.bfloat16) for n, s in g.inputs.items()}
    got = run_chains(mg.schedule(g), x, device="cuda")["out"].float().cpu()
    want = mg.ops.attention.run_reference({n: t.float() for n, t in x.items()}, g.params)["out"]
    assert ((got - want).norm() / want.norm()).item() < TOL["bfloat16"]
