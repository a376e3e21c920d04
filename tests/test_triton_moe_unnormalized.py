"""The moe_route Triton body's routing without renormalisation (moe_dispatch_combine's
``normalize=False``, Qwen2-MoE's ``norm_topk_prob=False``) under TRITON_INTERPRET=1
(tests/moe_unnormalized_interp.py): each body against the sequential CPU runtime on the same
graph and inputs, the op against its torch reference, on the float and packed-key rankings,
with drops, and on two ranks. The default (renormalising) branch: tests/test_triton_moe.py and
tests/test_moe_fast_paths.py."""

from __future__ import annotations

from functools import cache

import pytest

from helpers import interpreter_rows

pytest.importorskip("triton")

BODIES = ["route-send", "route-meta", "route-pick_rows", "route-pick_weights", "expert-hidden",
          "expert-back", "combine-out", "op-reference"]  # fmt: skip
# bf16: the interpreter rounds float32 to bf16 toward zero (test_moe_fast_paths.py's TOL)
TOL = {"bf16": 2e-2, "fp32": 2e-6}
PATHS = {"fp32-pointer": ["all", "float"], "bf16-keys": ["all", "keys16"],
         "fp32-drop": ["all", "float"]}  # fmt: skip


@cache
def rows() -> dict[str, dict]:
    return interpreter_rows("moe_unnormalized_interp.py")


@pytest.mark.parametrize("case", list(PATHS))
def test_route_body_without_renormalisation_on_one_rank(case):
    got = {k: r for k, r in rows().items() if k.startswith(f"{case}:1x1-")}
    assert sorted(k.rsplit("-", 2)[-2] + "-" + k.rsplit("-", 1)[-1] for k in got) == sorted(
        BODIES
    ), sorted(got)
    tol = TOL[case.split("-")[0]]
    for name, r in got.items():
        # the route body's weights are float32 whatever the dtype: within float32's tolerance
        limit = TOL["fp32"] if name.endswith(("route-meta", "route-pick_weights")) else tol
        assert r["error"] < limit and not r["nan"], (name, r)
        assert r["dropped"] == r["dropped_cpu"] == r["dropped_reference"], r
    # the denominator over all experts ran ("all"), beside the ranking of the case
    assert rows()[f"{case}:paths"]["paths"] == PATHS[case]
    sums = rows()[f"{case}:weights"]
    if case == "fp32-drop":  # experts 0 and 3 get every token, half of them dropped
        assert next(iter(got.values()))["dropped"] == [16, 0, 0, 16, 0, 0]
        assert sums["min_sum"] == 0.0
    else:  # a token's k weights are part of its softmax over E experts: they sum below 1
        assert 0.0 < sums["min_sum"] <= sums["max_sum"] < 0.99, sums


def test_route_body_without_renormalisation_on_two_ranks():
    for what in ("runtime", "reference"):
        r = rows()[f"1x2-25-{what}"]
        assert r["error"] < TOL["fp32"] and not r["nan"], r
