"""The attn_block / attn_finalize Triton bodies (mgraph/ops/attention_tiles.py), run by the
megakernel under TRITON_INTERPRET=1 (a subprocess: the flag must be set before triton is
imported) on ring_attention and attention graphs, against the reference runtime on the same graph
and torch SDPA (tests/megakernel_attention_interp.py). float32 graphs: the megakernel runs one
dtype per graph and the attention state is fp32."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from helpers import interpreter_rows

pytest.importorskip("triton")

HERE = Path(__file__).parent
# Both sides compute in fp32; the body folds keys in 64-key chunks with exp2 where the CPU body
# takes one exp over the block: a few fp32 ulps (measured <= 5e-7). A wrong mask, scale or
# rescale is O(1e-2) off or more.
TOL = 3e-6


@cache
def rows() -> dict[str, dict]:
    return interpreter_rows("megakernel_attention_interp.py")


def _check(prefix: str, expect: int, kinds: set[str]) -> None:
    got = {k: r for k, r in rows().items() if k.startswith(prefix)}
    assert len(got) == expect, sorted(got)
    for case, r in got.items():
        assert set(r["kinds"]) == kinds and r["dtypes"] == ["float32"], (case, r)
        assert r["error_ref"] < TOL and r["error_sdpa"] < TOL, (case, r)
        assert r["nan_match"] and r["nans"] == 0, (case, r)


def test_ring_attention_one_rank_causal_and_not():
    # masked edges (block 32 < 64 keys, D 40 < 128 columns) and several sub-blocks (block 128,
    # D 160), each causal (zigzag, diagonal mask) and not
    _check("ring-1x1-", 4, {"attn_block", "attn_finalize"})


def test_ring_attention_two_ranks_in_one_program():
    # the KV slices cross by NVLink copy tasks; attn_block waits on their arrival
    _check("ring-1x2-", 2, {"attn_block", "attn_finalize", "copy"})


def test_attention_additive_masks_broadcast():
    # [1,1,S,S], [B,1,1,S], [B,H,S,S] masks, each causal and not
    _check("mask-2x", 4, {"attn_block", "attn_finalize"})
    _check("mask-1x1x", 2, {"attn_block", "attn_finalize"})


def test_fully_hidden_row_is_nan_as_in_the_cpu_body():
    """One query row with every key hidden: 0 / 0 = NaN in the CPU body and in the megakernel
    (all D columns of that row, no other element), the other rows as accurate as elsewhere."""
    r = rows()["mask-hidden-row"]
    assert r["nan_match"] and r["nans"] == 32, r
    assert r["error_ref"] < TOL and r["error_sdpa"] < TOL, r
