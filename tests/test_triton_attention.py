"""The attn_block / attn_finalize Triton bodies (mgraph/ops/attention_tiles.py) under
TRITON_INTERPRET=1 (a subprocess: the flag must be set before triton is imported), against the
reference runtime on the same graph and torch SDPA (tests/megakernel_attention_interp.py):

- the graphs take the ops' default ``inline_finalize=True`` (each chain's last attn_block writes
  the output; no attn_finalize task), but for the "finalize" cases, built with
  ``inline_finalize=False`` so that attn_finalize's body stays checked on both paths;
- run by the megakernel on float32 ring_attention and attention graphs, and on a bf16 ring
  (bf16 data, fp32 state: the attention kinds are ``own_dtypes``);
- run by attention_tiles.run_chains (the bodies in a standalone kernel) on bf16 graphs with fp32
  state: zigzag causal over two ranks, grouped-query attention, KV blocks larger than q blocks,
  additive and boolean masks, head sizes 40 and 160; and in two of the fast path's other shapes
  (attention_tiles.TILE_VARIANTS: the pipelined plain loop, 64-row sub-blocks, 64-key chunks);
- query rows whose every key is hidden (a masked row, left padding under a causal mask): exactly
  0, as SDPA returns them, on both paths; and on a GPU (``pytest -m gpu``), compiled, through
  run_chains.
"""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import pytest

from helpers import run_interpreted

pytest.importorskip("triton")

HERE = Path(__file__).parent
# float32: both sides compute in fp32; the body folds keys in 128-key chunks with exp2 where the
# CPU body takes one exp over the block: a few fp32 ulps (measured <= 5e-7). A wrong mask, scale
# or rescale is O(1e-2) off or more.
TOL = 3e-6
# bf16: inputs and output in bf16 (half an ulp: 2e-3 relative), p rounded to bf16 before p @ v:
# measured 4e-3..6e-3 against float32 SDPA on the same bf16 inputs, by norm and per tile. A
# wrong mask, scale or GQA head mapping is O(1e-1) off.
TOL_BF16 = 1.5e-2
# query rows with every key hidden, per case: SDPA returns 0 there, and so must the bodies
HIDDEN_ROWS = {
    "mask-hidden-row": 1,
    "chains-bf16-hidden-row": 1,
    "chains-bf16-left-padding": 5,
    "finalize-fp32-mask": 2,
    "finalize-chains-left-padding": 2 * 70,
}
# the default graphs' kinds (inline_finalize=True: no attn_finalize task)
ATTN = {"attn_block"}


@cache
def all_rows() -> dict[str, dict]:
    """The JSON rows of every case group of the script, by case: one interpreter process for
    all of them (its start-up, ~3 s on CI's cores, paid once)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(HERE))
    proc = run_interpreted([str(HERE / "megakernel_attention_interp.py")], env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["case"]: r for r in out}


def rows(*groups: str) -> dict[str, dict]:
    """The rows of the script's case ``groups``: every case name starts with its group's prefix."""
    return {k: r for k, r in all_rows().items() if k.startswith(groups)}


def megakernel_rows() -> dict[str, dict]:
    return rows("ring-", "mask-")


def _check(got: dict, expect: int, kinds: set[str], dtypes: list[str], tol: float) -> None:
    assert len(got) == expect, sorted(got)
    for case, r in got.items():
        assert set(r["kinds"]) == kinds and r["dtypes"] == dtypes, (case, r)
        assert r["error_ref"] < tol and r["error_sdpa"] < tol, (case, r)
        assert r["tile_error"] < tol, (case, r)
        assert r["nan_match"] and r["nans"] == 0, (case, r)
        # no row is exactly 0 unless every key of it is hidden (random inputs)
        assert r["zero_rows"] == HIDDEN_ROWS.get(case, 0), (case, r)


def _select(table: dict[str, dict], prefix: str) -> dict[str, dict]:
    return {k: r for k, r in table.items() if k.startswith(prefix)}


@pytest.mark.slow  # the first test here: it runs the script's every case (all_rows)
def test_megakernel_ring_attention_one_rank_causal_and_not():
    # masked edges (block 32 < 128 keys, D 40 < 128 columns), causal (zigzag, diagonal mask) and not
    _check(_select(megakernel_rows(), "ring-1x1-"), 2, ATTN,
           ["float32"], TOL)


def test_megakernel_ring_attention_two_ranks_in_one_program():
    # the KV slices cross by NVLink copy tasks; attn_block waits on their arrival
    _check(_select(megakernel_rows(), "ring-1x2-causal0"), 1,
           ATTN | {"copy"}, ["float32"], TOL)


def test_megakernel_bf16_ring_with_fp32_state_gqa_zigzag():
    # per-buffer dtypes: bf16 q/k/v/out and gathers, fp32 acc/ml in the same arena
    _check(_select(megakernel_rows(), "ring-1x2-bf16-"), 1,
           ATTN | {"copy"}, ["bfloat16", "float32"], TOL_BF16)


def test_megakernel_attention_additive_masks_broadcast():
    # [1,1,S,S], [B,1,1,S], [B,H,S,S] masks, each causal and not
    table = megakernel_rows()
    _check(_select(table, "mask-2x"), 4, ATTN, ["float32"], TOL)
    _check(_select(table, "mask-1x1x"), 2, ATTN, ["float32"], TOL)


def test_megakernel_fully_hidden_row_is_zero_as_sdpa_returns_it():
    """One query row with every key hidden: 0 in the CPU body and in the megakernel, as in
    SDPA (l = 0, not 0 / 0 = NaN), the other rows as accurate as elsewhere."""
    _check(_select(megakernel_rows(), "mask-hidden-row"), 1, ATTN,
           ["float32"], TOL)


def test_bf16_ring_attention_variants():
    # D 40 and D 160 (the D-chunked path), zigzag causal over two ranks with 2 q heads per KV
    # head, 256-key blocks folded into 128-row q blocks across the diagonal
    got = _select(rows("chains-"), "chains-bf16-")
    ring = {k: r for k, r in got.items()
            if not any(w in k for w in ("mask", "hidden", "left", "variant"))}
    two_ranks = {k: ring.pop(k) for k in list(ring) if "1x2" in k}
    _check(ring, 3, ATTN, ["bfloat16", "float32"], TOL_BF16)
    _check(two_ranks, 1, ATTN | {"copy"}, ["bfloat16", "float32"],
           TOL_BF16)


def test_bf16_fast_path_variants():
    # attention_tiles.TILE_VARIANTS other than the default, through run_chains: the pipelined
    # plain loop with 64-key chunks (128- and 64-row sub-blocks), and the default shape
    # finalising through the stored state (plain-state), on a causal 256-key block (plain,
    # then masked chunks) and on head size 40 over two plain chunks
    got = _select(rows("chains-"), "chains-bf16-variant-")
    _check(got, 6, ATTN, ["bfloat16", "float32"], TOL_BF16)


def test_run_chains_rejects_an_unknown_variant():
    import torch

    import mgraph as mg
    from mgraph.errors import OptionError
    from mgraph.ops.attention_tiles import TILE_VARIANTS, run_chains

    g = mg.ops.ring_attention(topology="1x1", B=1, H=1, S=64, D=32, block=64,
                              dtype=torch.bfloat16)
    with pytest.raises(OptionError, match="unknown variant 'fast'") as err:
        run_chains(mg.schedule(g), {}, variant="fast")
    assert all(name in str(err.value) for name in TILE_VARIANTS)


def test_bf16_attention_additive_and_boolean_masks():
    # additive [B,1,1,S] causal with one KV head per q head; boolean [1,1,S,S] with GQA; a
    # boolean mask over S = 100 keys (not whole 16-byte rows: the pointer path)
    got = _select(rows("chains-"), "chains-bf16-mask-")
    _check(got, 3, ATTN, ["bfloat16", "float32"], TOL_BF16)


def test_bf16_fully_hidden_rows_are_zero_only_there():
    # one row hidden by a boolean mask (D 32); left padding under a causal mask (D 160: the
    # D-chunked path), 5 rows with no key
    got = {k: r for k, r in rows("chains-").items() if k.endswith(("hidden-row", "left-padding"))}
    _check(got, 2, ATTN, ["bfloat16", "float32"], TOL_BF16)


def test_fp32_through_run_chains_matches_to_rounding():
    # the same algorithm at float32: any bf16 tolerance would hide a small rescale error
    _check(_select(rows("chains-"), "chains-fp32-"), 1, ATTN,
           ["float32"], TOL)


def test_attn_finalize_body_with_inline_finalize_off():
    """``inline_finalize=False``: attn_finalize tasks write the output, by the megakernel (a
    float32 attention with an additive mask and a fully hidden row: the pointer path; a bf16
    causal GQA ring over two ranks: the fast path) and by run_chains (chains of two tasks, head
    size 160, left padding)."""
    got = rows("finalize-")
    assert len(got) == 5, sorted(got)
    finalize = ATTN | {"attn_finalize"}
    _check(_select(got, "finalize-fp32-"), 1, finalize, ["float32"], TOL)
    _check(_select(got, "finalize-ring-"), 1, finalize | {"copy"}, ["bfloat16", "float32"],
           TOL_BF16)
    _check(_select(got, "finalize-chains-"), 3, finalize, ["bfloat16", "float32"], TOL_BF16)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_kind", ["boolean", "additive"])
def test_gpu_left_padding_rows_are_zero(mask_kind):
    """On a GPU (compiled, not interpreted): bf16 attention with a left-padded batch under a
    causal mask, run by run_chains. The pad queries' rows are exactly 0, as SDPA returns them;
    every other row and tile within the bf16 tolerance of float32 SDPA."""
    import torch
    import torch.nn.functional as F

    import mgraph as mg
    from mgraph.ops.attention_tiles import run_chains
    from mgraph.runtime.memory import worst_tile_error

    B, H, S, D, pad = 2, 4, 1024, 128, 37
    g = mg.ops.attention(topology="1x1", B=B, H=H, S=S, D=D, block=128, kv_heads=2,
                         mask_shape=[B, 1, 1, S], mask_kind=mask_kind, causal=True,
                         dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(31)
    x = {n: torch.randn(s.shape, generator=gen).to(torch.bfloat16) for n, s in g.inputs.items()}
    real = torch.ones(B, 1, 1, S, dtype=torch.bool)
    real[1, ..., :pad] = False
    hidden = torch.zeros(B, 1, 1, S).masked_fill(~real, float("-inf"))
    mask = real.float() if mask_kind == "boolean" else hidden
    x["mask"] = mask.to(torch.bfloat16).reshape(g.inputs["mask"].shape)
    got = run_chains(mg.schedule(g), x, device="cuda")["out"].float().cpu()
    q, k, v = (x[n].float() for n in "qkv")
    shown = real & torch.ones(S, S, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=shown, enable_gqa=True)
    assert bool(got[1, :, :pad].eq(0).all()) and bool(got.isfinite().all())
    assert ((got - want).norm() / want.norm()).item() < TOL_BF16
    tile = worst_tile_error(got.reshape(-1, D), want.reshape(-1, D), rows=128, cols=D)
    assert tile < TOL_BF16, tile


def test_short_last_blocks_where_the_blocks_do_not_divide_the_sequence():
    """S 200, 300 and 130 in 64- or 128-row blocks: the last query and key blocks are short
    (the attention lowering clips them to S; before, such an S was a ShapeError). bf16 through
    run_chains (causal GQA, not causal at D 128, an additive mask) and the megakernel (causal
    GQA), float32 by the megakernel (the pointer path)."""
    got = rows("short-", "softcap-")
    _check(_select(got, "short-bf16-"), 4, ATTN, ["bfloat16", "float32"], TOL_BF16)
    _check(_select(got, "short-fp32-"), 1, ATTN, ["float32"], TOL)


def test_soft_capped_scores_take_the_pointer_path():
    """attention's ``softcap`` (Gemma2: softcap * tanh(scores / softcap) before the mask):
    bf16 causal GQA at D 128 and bf16 with an additive mask through run_chains, float32 by
    the megakernel, against the capped scores in float32 (uncapped SDPA is 15-30% away from
    it on these inputs)."""
    got = rows("short-", "softcap-")
    _check(_select(got, "softcap-bf16-"), 2, ATTN, ["bfloat16", "float32"], TOL_BF16)
    _check(_select(got, "softcap-fp32-"), 1, ATTN, ["float32"], TOL)
