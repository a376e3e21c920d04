"""Runs under TRITON_INTERPRET=1 in a subprocess (see test_qwen2_moe.py): the moe_route body's
routing without renormalisation (moe_dispatch_combine's ``normalize=False``: a pick's weight is
its softmax probability over all E logits, as Qwen2-MoE's ``norm_topk_prob=False``), each
body's output against the sequential CPU runtime's (filled rows only) and the op's output
against its torch reference, on 1x1 graphs through megakernel_moe_interp's ``one_rank`` and on
a 1x2 graph in one interpreter program:

- float32, rows of 6 logits (not whole 16-byte units): the element-wise path, float ranking;
- bf16, rows of 8 distinct logits: the packed-key ranking (_thresholds16);
- float32, capacity_factor 1 with experts sent every token: drops under the flag.

Prints one JSON line per (case, body) as megakernel_moe_fast_interp does, one per case naming
the ranking paths that ran and whether the denominator over all experts did ("all"), and the
largest sum of one token's pick weights (below 1: not renormalised)."""

from __future__ import annotations

import os

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"

import megakernel_moe_fast_interp as fast  # noqa: E402
import megakernel_moe_interp as base  # noqa: E402
import torch  # noqa: E402

import mgraph as mg  # noqa: E402
from mgraph.ops import moe_bodies  # noqa: E402
from mgraph.runtime.megakernel.runtime import run_in_process  # noqa: E402

OFF = dict(normalize=False)
BF16 = dict(T_loc=64, H=64, F=96, expert_rows=64, combine_rows=32, combine_cols=64,
            dtype=torch.bfloat16)  # fmt: skip
CASES = {
    "fp32-pointer": (("random", 21), OFF),
    "bf16-keys": (("distinct", 23), dict(OFF, E_loc=8, **BF16)),
    "fp32-drop": (("full", 24), dict(OFF, drop=True)),
}


def weight_sums(case: str, routing: str, seed: int, **options: object) -> None:
    """The CPU runtime's picks map: each token's pick weights sum to less than 1."""
    drop = options.pop("drop", False)
    g = base.build("1x1", **{**(base.DROP if drop else {}), **options})
    inputs = base.inputs_for(g, routing, seed)
    from mgraph.runtime.sequential import execute_sequential

    sums = execute_sequential(g, inputs)["pick_weights@0"].sum(1)
    base.emit(f"{case}:weights", max_sum=sums.max().item(), min_sum=sums.min().item())


def two_ranks(seed: int) -> None:
    g = base.build("1x2", T_loc=16, E_loc=3, group=1, normalize=False)
    inputs = base.inputs_for(g, "random", seed)
    want = mg.run(mg.schedule(g), inputs).outputs
    reference = mg.ops.get_op(base.OP).run_reference(inputs, g.params)
    got = run_in_process(mg.schedule(g), inputs)["out"]
    for what, other in (("runtime", want), ("reference", reference)):
        base.emit(f"1x2-{seed}-{what}", error=base.rel(got, other["out"]),
                  nan=bool(got.isnan().any()))  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    moe_bodies._thresholds16 = fast.spy(moe_bodies._thresholds16, lambda a: "keys16")
    moe_bodies._thresholds = fast.spy(moe_bodies._thresholds, lambda a: "float")
    moe_bodies._denominator = fast.spy(moe_bodies._denominator, lambda a: "all")
    base.inputs_for = fast.inputs_for
    for tag, ((routing, seed), options) in CASES.items():
        fast.run(tag, routing, seed, **options)
        weight_sums(tag, routing, seed, **options)
    two_ranks(25)
