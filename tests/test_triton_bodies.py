"""The Triton tile bodies of the kinds the tracer emits, run by the megakernel under
TRITON_INTERPRET=1 (a subprocess: the flag must be set before triton is imported) and compared
with the reference runtime on the same graphs (tests/megakernel_bodies_interp.py)."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

from helpers import interpreter_rows

pytest.importorskip("triton")

HERE = Path(__file__).parent
# fp32: both sides compute in fp32; bf16: Triton's interpreter rounds fp32 -> bf16 toward zero
# where torch rounds to nearest, one bf16 ulp (2^-8) on some elements; a wrong body is O(1) off.
TOL = {"float32": 2e-6, "bfloat16": 1e-2}


@cache
def rows() -> dict[str, dict]:
    return interpreter_rows("megakernel_bodies_interp.py")


def _check(prefix: str, expect: int) -> None:
    got = {k: r for k, r in rows().items() if k.startswith(prefix)}
    assert len(got) == expect, sorted(got)
    for case, r in got.items():
        assert r["error"] < TOL[r["dtype"]], (case, r)


@pytest.mark.slow
def test_ewise_every_fn_and_operand_form():
    from mgraph.ops.elementwise import BINARY, UNARY

    # unary fns; binary fns x (tensor, row vector, scalar, swapped scalar, alpha); a column
    # operand; each in fp32 and bf16
    _check("ewise-", 2 * (len(UNARY) + 5 * len(BINARY) + 1))


def test_rms_norm():
    _check("rms_norm-", 4)


def test_layer_norm():
    _check("layer_norm-", 8)


def test_softmax():
    _check("softmax-", 2)


def test_row_reduce():
    _check("row_reduce-", 8)


def test_concat():
    _check("concat-", 4)


def test_custom_op_triton_body_runs():
    # register_op(..., triton=body): through the op's builder (fp32, bf16) and a traced module
    _check("custom-", 3)


def test_traced_mlp_runs_entirely_in_the_megakernel():
    """examples/tp_mlp.py's MLP traced on 1x1: every task (GEMMs, silu, the product) runs in the
    megakernel, which agrees with the reference runtime and with eager torch (fp32 GEMMs in a
    different accumulation order: 1e-5)."""
    got = {k: r for k, r in rows().items() if k.startswith("mlp-")}
    assert set(got) == {"mlp-traced-float32", "mlp-eager-float32"}, sorted(got)
    for case, r in got.items():
        assert "ewise" in r["kinds"] and "gemm" in r["kinds"], r
        assert r["error"] < 1e-5, (case, r)


def test_relayout_chains():
    _check("relayout-", 8)


def test_relayout_map_without_the_gather_form_is_refused_before_launch():
    """[2, 2, 6] permuted to [6, 2, 2] and viewed as [4, 6]: the result's rows cut across the
    permuted digits, so no tile of any size has a mixed-radix form (tiles that merely cross a
    head are re-cut to line up, tests/test_relayout_maps.py): the tiles get no GPU params, the
    reference backend still runs it, and the megakernel refuses the graph with the missing
    param named, before anything launches."""
    import torch

    import mgraph as mg
    from mgraph.runtime.megakernel import TritonRuntime

    shape, steps = [2, 2, 6], [["permute", [2, 0, 1]], ["view", [4, 6]]]
    g = mg.ops.relayout(topology="1x1", rows=4, cols=6, in_shape=shape, steps=steps, tile_rows=2)
    fits = ["base" in t.params for t in g.tasks]
    assert fits == [False, False], fits
    x = torch.randn(4, 6)
    out = mg.run(mg.schedule(g), {"x": x}).outputs["out"]
    assert torch.equal(out, x.view(shape).permute(2, 0, 1).reshape(4, 6))
    with pytest.raises(mg.ScheduleError, match="no param 'base'"):
        TritonRuntime(mg.schedule(g), interpret=True)
