"""Compile-speed rewrites of the tracer that must not change what it decides: the causal-mask
test (attention_map._is_causal) compares without boolean indexing, and still tells the causal
mask from near misses, boolean and additive, -inf or the dtype's lowest value."""

from __future__ import annotations

import pytest
import torch

from mgraph.trace.attention_map import _is_causal

S = 64
CAUSAL = torch.ones(S, S, dtype=torch.bool).tril()
LOWEST = torch.finfo(torch.float32).min


def _additive(visible: torch.Tensor, hide: float = float("-inf"), dtype=torch.float32):
    return torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, hide)


def _poked(mask: torch.Tensor, i: int, j: int, value) -> torch.Tensor:
    mask = mask.clone()
    mask[..., i, j] = value
    return mask


CASES = {
    "bool": (CAUSAL, True),
    "bool with batch dims": (CAUSAL[None, None].expand(2, 1, S, S).clone(), True),
    "bool, one extra key": (_poked(CAUSAL, 3, 40, True), False),
    "bool, diagonal hidden": (_poked(CAUSAL, 7, 7, False), False),
    "bool, upper triangle": (~CAUSAL, False),
    "-inf": (_additive(CAUSAL), True),
    "lowest, batch dims": (_additive(CAUSAL[None, None], LOWEST), True),
    "bf16 lowest": (
        _additive(CAUSAL, torch.finfo(torch.bfloat16).min, torch.bfloat16),
        True,
    ),
    "-1e4 is no hiding": (_additive(CAUSAL, -1e4), False),
    "a visible bias": (_poked(_additive(CAUSAL), 5, 1, 0.5), False),
    "nan above": (_additive(CAUSAL, float("nan")), False),
    "+inf above": (_additive(CAUSAL, float("inf")), False),
    "sliding window": (_additive(CAUSAL & ~torch.ones(S, S, dtype=torch.bool).tril(-8)), False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_is_causal_tells_the_causal_mask_from_near_misses(name):
    mask, causal = CASES[name]
    assert _is_causal(mask, S) is causal
