"""attention's ``softcap`` (Gemma2's attention logit soft-capping, softcap * tanh(scores /
softcap) on the scaled scores, before the mask) on the CPU: the op's reference against the
graph run by the reference runtime, and against a float32 computation written out; bad values
are named errors. The Triton bodies: tests/test_triton_attention.py (interpreter) and
tests/test_attention_gpu.py (GPU)."""

from __future__ import annotations

import pytest
import torch

import mgraph as mg


def capped(x: dict, cap: float, causal: bool, mask: torch.Tensor | None) -> torch.Tensor:
    q, k, v = (x[n].float() for n in "qkv")
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    s = cap * torch.tanh((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5 / cap)
    if mask is not None:
        s = s + mask
    if causal:
        S = s.shape[-1]
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("causal,masked", [(True, False), (False, True), (True, True)])
def test_soft_capped_attention_matches_the_written_out_form(causal, masked):
    S, cap = 96, 1.5
    kw = dict(mask_shape=[1, 1, S, S]) if masked else {}
    g = mg.ops.attention(topology="1x1", B=2, H=4, S=S, D=16, block=32, kv_heads=2,
                         causal=causal, softcap=cap, dtype=torch.float32, **kw)
    gen = torch.Generator().manual_seed(S + causal)
    x = {n: torch.randn(s.shape, generator=gen) * 2.0 for n, s in g.inputs.items()}
    mask = x["mask"].reshape(1, 1, S, S) if masked else None
    want = capped(x, cap, causal, mask)
    ref = mg.ops.attention.run_reference(x, g.params)["out"]
    got = mg.run(mg.schedule(g), x).outputs["out"]
    assert ((ref - want).norm() / want.norm()).item() < 1e-5
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    plain = mg.ops.attention(topology="1x1", B=2, H=4, S=S, D=16, block=32, kv_heads=2,
                             causal=causal, dtype=torch.float32, **kw)
    uncapped = mg.run(mg.schedule(plain), x).outputs["out"]
    assert ((uncapped - want).norm() / want.norm()).item() > 0.05  # the cap matters here


@pytest.mark.parametrize("bad,error", [(-1.0, mg.ShapeError), (float("inf"), mg.OptionError),
                                       (True, mg.OptionError), ("50", mg.OptionError)])
def test_bad_softcap_is_a_named_error(bad, error):
    with pytest.raises(error, match="softcap"):
        mg.ops.attention(topology="1x1", B=1, H=2, S=64, D=16, softcap=bad)
