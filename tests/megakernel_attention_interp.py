"""Runs under TRITON_INTERPRET=1 in a subprocess (see test_triton_attention.py): the attn_block /
attn_finalize Triton bodies (mgraph/ops/attention_tiles.py) on graphs built by ring_attention and
attention, compared with the reference runtime on the same graph and with torch SDPA, on random
inputs. Cases "ring", "ring2", "mask": run by the megakernel (float32 graphs, and one bf16 graph with
fp32 state). Case "chains": bf16 graphs and one fp32 graph, run by attention_tiles.run_chains
(the bodies in a standalone kernel, one program per q-block chain). These graphs take the ops'
default, ``inline_finalize=True``: each chain's last attn_block writes the output (no
attn_finalize task). Case "finalize": graphs built with ``inline_finalize=False`` (an
attn_finalize task ends each chain), by the megakernel and by run_chains.
Prints one JSON line per case:
{"case", "kinds", "dtypes", "error_ref", "error_sdpa", "tile_error", "nan_match", "nans",
"zero_rows"} (tile_error: the worst block x D tile's relative error against SDPA; zero_rows: the
output rows that are exactly 0, as SDPA returns a query row whose every key is hidden)."""

from __future__ import annotations

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mgraph as mg  # noqa: E402
from mgraph.ops.attention_tiles import run_chains  # noqa: E402
from mgraph.runtime.megakernel import TritonRuntime, run_in_process  # noqa: E402
from mgraph.runtime.memory import worst_tile_error  # noqa: E402


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error (NaN if either side has a NaN)."""
    return ((got - want).norm() / want.norm()).item()


def compare(case: str, graph, inputs: dict, sdpa: torch.Tensor, chains: bool = False,
            variant: str = "plain") -> None:
    """The megakernel (one rank, or every rank in one interpreter program), or with ``chains``
    run_chains (its fast path in shape ``variant``), against the reference runtime and SDPA
    (``sdpa`` in [B, H, S, D], float32)."""
    sched = mg.schedule(graph)
    want = mg.run(sched, inputs).outputs["out"]
    if chains:
        got = run_chains(sched, inputs, variant=variant)["out"]
    elif graph.topology.world_size == 1:
        got = TritonRuntime(sched, interpret=True).run(inputs).outputs["out"]
    else:
        got = run_in_process(sched, inputs)["out"]
    got = got.reshape(sdpa.shape).float()
    want = want.reshape(sdpa.shape).float()
    D = sdpa.shape[-1]
    block = graph.params.get("block", 128)
    dtypes = {str(b.dtype) for b in graph.buffers.values()}
    print(json.dumps({
        "case": case,
        "kinds": sorted({t.kind for t in graph.tasks}),
        "dtypes": sorted(dtypes),
        "error_ref": _err(got, want),
        "error_sdpa": _err(got, sdpa),
        "tile_error": worst_tile_error(got.nan_to_num().reshape(-1, D),
                                       sdpa.nan_to_num().reshape(-1, D), rows=block, cols=D),
        "nan_match": bool(torch.equal(got.isnan(), want.isnan())),
        "nans": int(got.isnan().sum()),
        "zero_rows": int((got.reshape(-1, D) == 0).all(dim=1).sum()),
    }), flush=True)


def _inputs(graph, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s.shape, generator=gen).to(dtype) for n, s in graph.inputs.items()}


def _sdpa(x: dict, causal: bool = False, mask: torch.Tensor | None = None) -> torch.Tensor:
    """float32 SDPA on the inputs as given (bf16 values widened), KV heads grouped as
    ``enable_gqa`` groups them."""
    q, k, v = (x[n].float() for n in "qkv")
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                          enable_gqa=k.shape[1] != q.shape[1])


def ring_cases() -> None:
    """ring_attention: block 32 with D 40 (keys and head columns masked inside the 128 x 128 x 128
    sub-blocks); causal uses the zigzag layout and the diagonal mask. (Head sizes past 128, the
    256-column fast path (ATTN_D 256), are checked by the "chains" cases.)"""
    shapes = {"small": dict(B=2, H=2, S=128, D=40, block=32)}
    for name, dims in shapes.items():
        for causal in (False, True):
            g = mg.ops.ring_attention(topology="1x1", causal=causal, dtype=torch.float32, **dims)
            x = _inputs(g, seed=len(name) + causal)
            want = F.scaled_dot_product_attention(x["q"], x["k"], x["v"], is_causal=causal)
            compare(f"ring-1x1-{name}-causal{int(causal)}", g, x, want)


def ring_multi_rank_cases() -> None:
    """Two ranks in one interpreter program: the KV slices move by NVLink copy tasks into the
    gather buffers and every attn_block waits for its rows' arrival. float32 non-causal; bf16
    data with fp32 state (per-buffer dtypes), causal zigzag, 2 q heads per KV head."""
    g = mg.ops.ring_attention(topology="1x2", B=1, H=2, S=128, D=32, block=16,
                              dtype=torch.float32)
    x = _inputs(g, seed=7)
    compare("ring-1x2-causal0", g, x, _sdpa(x))
    g = mg.ops.ring_attention(topology="1x2", B=1, H=2, S=128, D=32, block=32, kv_heads=1,
                              causal=True, dtype=torch.bfloat16)
    x = _inputs(g, seed=8, dtype=torch.bfloat16)
    compare("ring-1x2-bf16-gqa-causal1", g, x, _sdpa(x, causal=True))


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
    # a query row with every key hidden: exactly 0 there, as SDPA returns it (l = 0: the
    # finalize body must not divide 0 / 0), the other rows untouched
    g = mg.ops.attention(topology="1x1", B=1, H=1, S=S, D=D, block=32, mask_shape=[1, 1, S, S],
                         dtype=torch.float32)
    x = _inputs(g, seed=13)
    bias = torch.randn(1, 1, S, S)
    bias[..., 5, :] = float("-inf")
    x["mask"] = bias.reshape(S, S)
    want = F.scaled_dot_product_attention(x["q"], x["k"], x["v"], attn_mask=bias)
    compare("mask-hidden-row", g, x, want)


def chain_cases() -> None:
    """bf16 data with fp32 state through run_chains (its default fast path, and two others on
    two graphs): head sizes 40 (masked columns) and 160
    (the 256-column fast path, ATTN_D 256); causal zigzag over two ranks with grouped-query attention (2 q heads
    per KV head, the KV slices moved by copy tasks); KV blocks twice the q block (chunks below,
    across and above the diagonal inside one task); additive and boolean masks; a fully hidden
    row. One fp32 graph checks the algorithm to fp32 rounding."""
    bf16 = torch.bfloat16
    ring = {
        "d40-causal0": dict(topology="1x1", B=1, H=2, S=128, D=40, block=64),
        "d160-causal1": dict(topology="1x1", B=1, H=1, S=256, D=160, block=128, causal=True),
        "1x2-gqa-causal1": dict(topology="1x2", B=1, H=2, S=256, D=64, block=64, kv_heads=1,
                                causal=True),
        "kvblock-causal1": dict(topology="1x1", B=1, H=1, S=512, D=128, block=128, kv_block=256,
                                causal=True),
    }
    for name, dims in ring.items():
        g = mg.ops.ring_attention(dtype=bf16, **dims)
        x = _inputs(g, seed=len(name), dtype=bf16)
        compare(f"chains-bf16-{name}", g, x, _sdpa(x, dims.get("causal", False)), chains=True)
    # the fast path's other shapes (attention_tiles.TILE_VARIANTS): the pipelined plain loop
    # and 64-row sub-blocks, with 64-key chunks, on 256-key blocks across the diagonal (plain
    # chunks, then masked ones) and on 128 keys of head size 40 (two plain chunks, masked
    # columns); plain-state, the default shape finalising through the stored state (the
    # default writes a final task's out rows from registers); the wide path at D 160 has one
    # shape
    for variant in ("pipe-kb64", "q64-kb64-w4-pipe", "plain-state"):
        for name in ("kvblock-causal1", "d40-causal0"):
            g = mg.ops.ring_attention(dtype=bf16, **ring[name])
            x = _inputs(g, seed=len(name), dtype=bf16)
            compare(f"chains-bf16-variant-{variant}-{name}", g, x,
                    _sdpa(x, ring[name].get("causal", False)), chains=True, variant=variant)
    g = mg.ops.ring_attention(dtype=torch.float32, **ring["d160-causal1"])
    x = _inputs(g, seed=3)
    compare("chains-fp32-d160-causal1", g, x, _sdpa(x, True), chains=True)
    B, H, S, D = 2, 2, 128, 32
    tril = torch.ones(S, S, dtype=torch.bool).tril()
    for kind, shape, causal, kv_heads in (("additive", [B, 1, 1, S], True, 2),
                                          ("boolean", [1, 1, S, S], False, 1)):
        g = mg.ops.attention(topology="1x1", B=B, H=H, S=S, D=D, block=64, kv_block=128,
                             mask_shape=shape, mask_kind=kind, kv_heads=kv_heads, causal=causal,
                             dtype=bf16)
        x = _inputs(g, seed=21, dtype=bf16)
        shown = torch.rand(shape, generator=torch.Generator().manual_seed(22)) < 0.7
        shown[..., 0] = True  # every query keeps key 0 (all causal row 0 has)
        if kind == "boolean":
            x["mask"] = shown.to(bf16).reshape(g.inputs["mask"].shape)
        else:
            bias = torch.randn(shape).masked_fill(~shown, float("-inf")).to(bf16)
            x["mask"] = bias.reshape(g.inputs["mask"].shape)
            shown = bias.float()
        if causal:
            shown = shown.masked_fill(~tril, float("-inf"))
        compare(f"chains-bf16-mask-{kind}", g, x, _sdpa(x, mask=shown), chains=True)
    # a query row with every key hidden by a boolean mask: 0 there, as SDPA returns it
    g = mg.ops.attention(topology="1x1", B=1, H=1, S=64, D=D, block=64, mask_shape=[1, 1, 64, 64],
                         mask_kind="boolean", dtype=bf16)
    x = _inputs(g, seed=23, dtype=bf16)
    shown = torch.rand(64, 64, generator=torch.Generator().manual_seed(24)) < 0.5
    shown[:, 0] = True
    shown[9] = False
    x["mask"] = shown.to(bf16)
    compare("chains-bf16-hidden-row", g, x, _sdpa(x, mask=shown), chains=True)
    # S = 100 keys: the mask's rows are not whole 16-byte pieces, so the tile takes the pointer
    # path (the TMA path needs a key count that is a multiple of 8)
    g = mg.ops.attention(topology="1x1", B=1, H=2, S=100, D=32, block=50,
                         mask_shape=[1, 1, 100, 100], mask_kind="boolean", dtype=bf16)
    x = _inputs(g, seed=26, dtype=bf16)
    shown = torch.rand(100, 100, generator=torch.Generator().manual_seed(27)) < 0.6
    shown[:, 0] = True
    x["mask"] = shown.to(bf16).reshape(g.inputs["mask"].shape)
    compare("chains-bf16-mask-pointer-path", g, x, _sdpa(x, mask=shown), chains=True)
    # left padding with a causal mask (transformers' SDPA mask for a left-padded batch): the pad
    # queries of sequence 1 see no key at all; head size 160, the 256-column fast path
    B, S, D, pad = 2, 128, 160, 5
    g = mg.ops.attention(topology="1x1", B=B, H=1, S=S, D=D, block=64, mask_shape=[B, 1, 1, S],
                         mask_kind="boolean", causal=True, dtype=bf16)
    x = _inputs(g, seed=25, dtype=bf16)
    real = torch.ones(B, 1, 1, S, dtype=torch.bool)
    real[1, ..., :pad] = False
    x["mask"] = real.to(bf16).reshape(g.inputs["mask"].shape)
    compare("chains-bf16-left-padding", g, x, _sdpa(x, mask=real & tril), chains=True)


def finalize_cases() -> None:
    """``inline_finalize=False``: an attn_finalize task after each chain's last attn_block
    writes the output (the ops' default folds that into the last attn_block instead).
    The megakernel on a float32 attention graph with an additive mask and a fully hidden row
    (the pointer path) and on a bf16 causal ring over two ranks with grouped-query heads (the
    fast path); run_chains on bf16 graphs: KV blocks twice the q block (a chain of two tasks,
    then its attn_finalize), head size 160 (the 256-column fast path), a left-padded causal boolean
    mask."""
    bf16 = torch.bfloat16
    B, H, S, D = 1, 2, 64, 32
    g = mg.ops.attention(topology="1x1", B=B, H=H, S=S, D=D, block=32, kv_block=32,
                         mask_shape=[1, 1, S, S], causal=True, inline_finalize=False,
                         dtype=torch.float32)
    x = _inputs(g, seed=41)
    bias = torch.randn(1, 1, S, S, generator=torch.Generator().manual_seed(42))
    bias[..., 40, :] = float("-inf")  # a row with every key hidden: 0, as SDPA returns it
    x["mask"] = bias.reshape(S, S)
    tril = torch.ones(S, S, dtype=torch.bool).tril()
    compare("finalize-fp32-mask", g, x, _sdpa(x, mask=bias.masked_fill(~tril, float("-inf"))))
    # S 128: zigzag chunks of one 32-row block; each rank's chains still start (first), fold
    # masked and unmasked blocks, wait for 0, 1 and 2 copies, and end in attn_finalize
    g = mg.ops.ring_attention(topology="1x2", B=1, H=2, S=128, D=64, block=32, kv_heads=1,
                              causal=True, inline_finalize=False, dtype=bf16)
    x = _inputs(g, seed=43, dtype=bf16)
    compare("finalize-ring-1x2-bf16", g, x, _sdpa(x, causal=True))
    ring = {
        "kvblock": dict(topology="1x1", B=1, H=1, S=512, D=128, block=128, kv_block=256),
        "d160-causal1": dict(topology="1x1", B=1, H=1, S=256, D=160, block=128, causal=True),
    }
    for name, dims in ring.items():
        g = mg.ops.ring_attention(inline_finalize=False, dtype=bf16, **dims)
        x = _inputs(g, seed=44 + len(name), dtype=bf16)
        compare(f"finalize-chains-{name}", g, x, _sdpa(x, dims.get("causal", False)), chains=True)
    B, S, pad = 2, 256, 70
    g = mg.ops.attention(topology="1x1", B=B, H=2, S=S, D=32, block=64, kv_block=128,
                         kv_heads=1, causal=True, mask_shape=[B, 1, 1, S], mask_kind="boolean",
                         inline_finalize=False, dtype=bf16)
    x = _inputs(g, seed=46, dtype=bf16)
    real = torch.ones(B, 1, 1, S, dtype=torch.bool)
    real[1, ..., :pad] = False
    x["mask"] = real.to(bf16).reshape(g.inputs["mask"].shape)
    shown = real & torch.ones(S, S, dtype=torch.bool).tril()
    compare("finalize-chains-left-padding", g, x, _sdpa(x, mask=shown), chains=True)


def short_cases() -> None:
    """Sequences that the blocks do not divide: the last query block and the last key block of
    a chain are short (attention's lowering; the bodies count rows and keys from the regions).
    bf16 with fp32 state through run_chains (and the causal case by the megakernel too): S 200
    in 64-row blocks (8 rows last; the default keys: one 200-key block), causal with
    grouped-query heads at D 64; S 300 in 128-row and 128-key blocks (44 last) at D 128, not
    causal, and causal with an additive mask; float32 S 130 (the pointer path), causal, by the
    megakernel."""
    bf16 = torch.bfloat16
    cases = {
        "s200-gqa-causal1": dict(B=1, H=4, S=200, D=64, block=64, kv_heads=2, causal=True),
        "s300-d128-causal0": dict(B=2, H=2, S=300, D=128, block=128, kv_block=128),
    }
    for name, dims in cases.items():
        g = mg.ops.attention(topology="1x1", dtype=bf16, **dims)
        x = _inputs(g, seed=len(name), dtype=bf16)
        want = _sdpa(x, dims.get("causal", False))
        compare(f"short-bf16-chains-{name}", g, x, want, chains=True)
        if dims.get("causal"):  # the same body; once through the megakernel too
            compare(f"short-bf16-mega-{name}", g, x, want)
    S = 300
    g = mg.ops.attention(topology="1x1", B=1, H=2, S=S, D=128, block=128, kv_block=128,
                         mask_shape=[1, 1, S, S], causal=True, dtype=bf16)
    x = _inputs(g, seed=31, dtype=bf16)
    bias = torch.randn(1, 1, S, S, generator=torch.Generator().manual_seed(32)).to(bf16)
    x["mask"] = bias.reshape(g.inputs["mask"].shape)
    tril = torch.ones(S, S, dtype=torch.bool).tril()
    compare("short-bf16-chains-s300-mask-causal1", g, x,
            _sdpa(x, mask=bias.float().masked_fill(~tril, float("-inf"))), chains=True)
    g = mg.ops.attention(topology="1x1", B=1, H=2, S=130, D=32, block=64, causal=True,
                         dtype=torch.float32)
    x = _inputs(g, seed=33)
    compare("short-fp32-mega-s130-causal1", g, x, _sdpa(x, True))


def softcap_cases() -> None:
    """Soft-capped scores (attention's ``softcap``, Gemma2): the bodies' pointer path, which
    the tasks take whatever their shape. bf16 with fp32 state at D 128 (a fast-path shape
    otherwise), causal with grouped-query heads, through run_chains, at a cap that bends most
    scores (2.0); with an additive mask; float32 by the megakernel."""
    from test_attention_softcap import capped  # Gemma2's attention written out in float32

    bf16 = torch.bfloat16
    # S 128: each 64-row q block's task folds 128 keys, chunks below, on and past the diagonal
    dims = dict(topology="1x1", B=1, H=4, S=128, D=128, block=64, kv_heads=2, causal=True)
    g = mg.ops.attention(dtype=bf16, softcap=2.0, **dims)
    x = _inputs(g, seed=41, dtype=bf16)
    want = capped(x, 2.0, True, None)
    compare("softcap-bf16-chains-gqa-causal1", g, x, want, chains=True)
    S = 128
    g = mg.ops.attention(topology="1x1", B=1, H=2, S=S, D=64, block=64, mask_shape=[1, 1, S, S],
                         softcap=5.0, dtype=bf16)
    x = _inputs(g, seed=42, dtype=bf16)
    bias = torch.randn(1, 1, S, S, generator=torch.Generator().manual_seed(43)).to(bf16)
    x["mask"] = bias.reshape(g.inputs["mask"].shape)
    compare("softcap-bf16-chains-mask", g, x, capped(x, 5.0, False, bias.float()), chains=True)
    g = mg.ops.attention(topology="1x1", B=1, H=2, S=128, D=32, block=64, causal=True,
                         softcap=3.0, dtype=torch.float32)
    x = _inputs(g, seed=44)
    compare("softcap-fp32-mega-causal1", g, x, capped(x, 3.0, True, None))


CASES = {"ring": ring_cases, "ring2": ring_multi_rank_cases, "mask": mask_cases,
         "chains": chain_cases, "finalize": finalize_cases, "short": short_cases,
         "softcap": softcap_cases}

if __name__ == "__main__":
    torch.set_num_threads(1)
    for name in sys.argv[1:] or list(CASES):
        CASES[name]()
