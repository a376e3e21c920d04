"""The MoE Triton tile bodies (moe_route, moe_move, moe_expert, moe_combine) run by the
megakernel under TRITON_INTERPRET=1 (a subprocess: the flag must be set before triton is
imported; tests/megakernel_moe_interp.py) on float32 moe_dispatch_combine graphs, against the
sequential CPU runtime on the same graph and inputs, body by body, and against the op's torch
reference; the op's ``dropped`` output (written by the route body) equals the CPU runtime's and
the reference's exactly. The interpreter runs float32 only here: the megakernel takes one dtype
per graph today, and the MoE graph keeps its routing buffers in float32."""

from __future__ import annotations

from functools import cache

import pytest

from helpers import interpreter_rows

pytest.importorskip("triton")

# fp32 on both sides; the tile bodies sum in another order than torch's matmul (1e-7 seen).
TOL = 2e-6
BODIES = ["route-send", "route-meta", "route-pick_rows", "route-pick_weights", "expert-hidden",
          "expert-back", "combine-out", "op-reference"]  # fmt: skip


@cache
def rows() -> dict[str, dict]:
    return interpreter_rows("megakernel_moe_interp.py")


@pytest.mark.parametrize("routing", ["random-0", "empty-1", "full-2", "full-drop-6",
                                     "random-drop-8"])  # fmt: skip
def test_every_body_on_one_rank(routing):
    got = {k: r for k, r in rows().items() if k.startswith(f"1x1-{routing}-")}
    assert sorted(got) == sorted(f"1x1-{routing}-{b}" for b in BODIES)
    for case, r in got.items():
        assert r["error"] < TOL and not r["nan"], (case, r)
    first = next(iter(got.values()))
    counts, dropped = first["counts"], first["dropped"]
    # the route body's drop counts, exact: as the CPU body's and the reference's (kept_picks)
    assert dropped == first["dropped_cpu"] == first["dropped_reference"], first
    if routing.startswith("full-drop"):  # segments of 16 rows: tokens 16..31 lose experts 0, 3
        assert first["segment"] == 16
        assert counts == [16, 0, 0, 16, 0, 0] and dropped == [16, 0, 0, 16, 0, 0]
        return
    if routing.startswith("random-drop"):  # 64 tokens, segments of 16: every pick is kept or
        # counted, some segments overflow by a few
        assert first["segment"] == 16 and sum(counts) + sum(dropped) == 64 * 2
        assert 0 < sum(dropped) and min(dropped) >= 0 and max(counts) == 16
        return
    assert dropped == [0] * 6  # segments of T_loc rows never drop
    assert sum(counts) == 32 * 2  # every token routed to top_k = 2 experts
    if routing.startswith("empty"):  # empty segments: their expert tiles exited at once
        assert counts[1] == counts[5] == 0
    if routing.startswith("full"):  # capacity reached: nothing dropped
        assert counts == [32, 0, 0, 32, 0, 0]


@pytest.mark.parametrize("case", ["random-3-x2", "empty-4-x1", "full-5-x1", "full-drop-7-x1"])
def test_whole_graph_on_two_ranks(case):
    """1x2 in one interpreter program: moves into the peer's buffers, the return path, combine;
    random-3 launches twice (epochs, counts rewritten); full-drop-7 has segments of 8 rows of
    16 tokens, so both ranks drop half their picks of experts 0 and 3 (the reference too)."""
    for what in ("runtime", "reference"):
        r = rows()[f"1x2-{case}-{what}"]
        assert r["error"] < TOL and not r["nan"], r
        assert {"moe_route", "moe_move", "moe_expert", "moe_combine"} <= set(r["kinds"])
        assert r["segment"] == (8 if "drop" in case else 16)
        # [source rank, expert]: the megakernel's drop counts as the CPU runtime's / reference's
        assert r["dropped"] == r["dropped_other"], r
        lost = [8, 0, 0, 8, 0, 0] if "drop" in case else [0] * 6
        assert r["dropped"] == [lost, lost], r
