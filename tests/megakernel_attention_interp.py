"""Runs under TRITON_INTERPRET=1 in a subprocess (see test_triton_attention.py): the attn_block /
attn_finalize Triton bodies (mgraph/ops/attention_tiles.py) run by the megakernel on graphs built
by ring_attention and attention (float32: the megakernel runs one dtype per graph and the state
is fp32), compared with the reference runtime on the same graph and with torch SDPA, on random
inputs. Prints one JSON line per case:
{"case", "kinds", "dtypes", "error_ref", "error_sdpa", "nan_match", "nans"}."""

from __future__ import annotations

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mgraph as mg  # noqa: E402
from mgraph.runtime.megakernel import TritonRuntime, run_in_process  # noqa: E402


def _err(got: torch.Tensor, want: torch.Tensor, ok: torch.Tensor) -> float:
    """Relative error over the elements ``ok`` (where the reference runtime is finite)."""
    return ((got[ok] - want[ok]).norm() / want[ok].norm()).item()


def compare(case: str, graph, inputs: dict, sdpa: torch.Tensor) -> None:
    """The megakernel (one rank, or every rank in one interpreter program) against the
    reference runtime and SDPA (``sdpa`` in [B, H, S, D])."""
    sched = mg.schedule(graph)
    want = mg.run(sched, inputs).outputs["out"]
    if graph.topology.world_size == 1:
        got = TritonRuntime(sched, interpret=True).run(inputs).outputs["out"]
    else:
        got = run_in_process(sched, inputs)["out"]
    got = got.reshape(sdpa.shape)
    want = want.reshape(sdpa.shape)
    # A query row with every key hidden is 0 / 0 = NaN in the CPU body (the kind's meaning),
    # where SDPA returns zeros: such rows are compared by their NaN pattern only.
    ok = torch.isfinite(want)
    dtypes = {str(b.dtype) for b in graph.buffers.values()}
    print(json.dumps({
        "case": case,
        "kinds": sorted({t.kind for t in graph.tasks}),
        "dtypes": sorted(dtypes),
        "error_ref": _err(got, want, ok),
        "error_sdpa": _err(got, sdpa, ok),
        "nan_match": bool(torch.equal(got.isnan(), want.isnan())),
        "nans": int(got.isnan().sum()),
    }), flush=True)


def _inputs(graph, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s.shape, generator=gen) for n, s in graph.inputs.items()}


def ring_cases() -> None:
    """ring_attention: block 32 with D 40 (keys and head columns masked inside the 64 x 64 x 128
    sub-blocks); block 128 with D 160 (two q sub-blocks, two key chunks, two D chunks, acc
    rescaled through the state buffer); causal uses the zigzag layout and the diagonal mask."""
    shapes = {"small": dict(B=2, H=2, S=128, D=40, block=32),
              "big": dict(B=1, H=1, S=512, D=160, block=128)}
    for name, dims in shapes.items():
        for causal in (False, True):
            g = mg.ops.ring_attention(topology="1x1", causal=causal, dtype=torch.float32, **dims)
            x = _inputs(g, seed=len(name) + causal)
            want = F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=causal)
            compare(f"ring-1x1-{name}-causal{int(causal)}", g, x, want)


def ring_multi_rank_cases() -> None:
    """Two ranks in one interpreter program: the KV slices move by NVLink copy tasks into the
    gather buffers and every attn_block waits for its rows' arrival."""
    for causal in (False, True):
        g = mg.ops.ring_attention(topology="1x2", B=1, H=2, S=128, D=32, causal=causal, block=16,
                                  dtype=torch.float32)
        x = _inputs(g, seed=7 + causal)
        want = F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=causal)
        compare(f"ring-1x2-causal{int(causal)}", g, x, want)


def mask_cases() -> None:
    """attention with an additive mask (-inf where a random boolean mask hides a key, the
    diagonal always shown) broadcast over batch/heads/queries as SDPA broadcasts it; causal
    and not."""
    B, H, S, D = 2, 2, 64, 32
    for shape in ([1, 1, S, S], [B, 1, 1, S], [B, H, S, S]):
        for causal in (False, True):
            g = mg.ops.attention(topology="1x1", B=B, H=H, S=S, D=D, block=32, mask_shape=shape,
                                 causal=causal, dtype=torch.float32)
            x = _inputs(g, seed=11 + causal)
            gen = torch.Generator().manual_seed(12)
            shown = torch.rand(shape, generator=gen) < 0.7
            if shape[2] == S:
                shown |= torch.eye(S, dtype=torch.bool)  # every query keeps its own key
            else:
                shown[..., 0] = True  # one row for every query: key 0 (all causal row 0 has)
            bias = torch.zeros(shape).masked_fill(~shown, float("-inf"))
            x["mask"] = bias.reshape(g.inputs["mask"].shape)
            full = bias
            if causal:
                full = bias.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
            want = F.scaled_dot_product_attention(x["q"], x["k"], x["v"], attn_mask=full)
            tag = "x".join(map(str, shape))
            compare(f"mask-{tag}-causal{int(causal)}", g, x, want)
    # a query row with every key hidden: 0 / 0 in the CPU body and the megakernel alike (the
    # body must neither make it finite nor spread NaN to other rows)
    g = mg.ops.attention(topology="1x1", B=1, H=1, S=S, D=D, block=32, mask_shape=[1, 1, S, S],
                         dtype=torch.float32)
    x = _inputs(g, seed=13)
    bias = torch.randn(1, 1, S, S)
    bias[..., 5, :] = float("-inf")
    x["mask"] = bias.reshape(S, S)
    want = F.scaled_dot_product_attention(x["q"], x["k"], x["v"], attn_mask=bias)
    compare("mask-hidden-row", g, x, want)


CASES = {"ring": ring_cases, "ring2": ring_multi_rank_cases, "mask": mask_cases}

if __name__ == "__main__":
    torch.set_num_threads(1)
    for name in sys.argv[1:] or list(CASES):
        CASES[name]()
