"""Runs under TRITON_INTERPRET=1 in a subprocess (see test_moe_fast_paths.py): the paths of the
MoE tile bodies that tests/megakernel_moe_interp.py (float32, 16-row tiles) does not reach, on
1x1 graphs, each body's output against the sequential CPU runtime's (filled rows only) and the
op's output against its torch reference:

- bf16, 128-row expert tiles with segments filled past 64 rows: the expert body's 128-row TMA
  tiles (and its 64-row ones on the other segments), the route and combine bodies' 16-byte
  vector paths (H and E multiples of 8);
- bf16, 64-row expert tiles, a random routing: the 64-row TMA tiles;
- bf16, segments of 256 and 160 filled rows in one tile: the pair tile (128 + 64 rows in one
  K loop) on 192 rows then a 64-row block, and the pair tile alone (moe_bodies.expert_tile:
  chunks of up to 192 rows);
- the column split (expert_cols_f, expert_cols_h: pass-1 and pass-2 tasks on slices of
  columns), bf16 with 160 filled rows (TMA), float32 with H = 32 (TMA) and with H = 38
  (pointers);
- bf16 with 8 experts (logit rows of 16 bytes) and distinct logits per token: the route
  body's ranking by packed int32 keys (_thresholds16; the other cases' rows of 6 logits take
  the float ranking, _thresholds);
- float32 with H = 38 (rows of 152 bytes: not whole 16-byte units): the expert body's pointer
  path and the route and combine bodies' element-wise paths.

Prints one JSON line per (case, body), the case prefixed to megakernel_moe_interp's names, and
one per case naming the paths that ran (the expert body's "tma64", "tma128", "pair192", "pointer"; the
route body's "keys16", "float"): the interpreter looks the helpers up in moe_bodies' globals,
where a spy records each call."""

from __future__ import annotations

import os

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"

import megakernel_moe_interp as base  # noqa: E402
import torch  # noqa: E402

from mgraph.ops import moe_bodies  # noqa: E402

CASES = {
    # experts 0 and 3 get all 128 tokens: 128 filled rows, the 128-row tiles
    "bf16-rows128": (("full", 11), dict(T_loc=128, H=64, F=96, expert_rows=128,
                                        combine_rows=32, combine_cols=64, dtype=torch.bfloat16)),
    "bf16-rows64": (("random", 12), dict(T_loc=64, H=64, F=96, expert_rows=64,
                                         combine_rows=32, combine_cols=64, dtype=torch.bfloat16)),
    "fp32-h38": (("random", 13), dict(H=38, F=72, combine_cols=19)),
    # 256 filled rows in a 256-row tile: a 192-row chunk (the pair tile), then 64 rows
    "bf16-rows256": (("full", 14), dict(T_loc=256, H=64, F=96, expert_rows=256,
                                        combine_rows=32, combine_cols=64, dtype=torch.bfloat16)),
    # 8 experts (rows of 16 bytes), logits distinct per token: the route body's packed keys
    "bf16-keys": (("distinct", 16), dict(E_loc=8, T_loc=64, H=64, F=96, expert_rows=64,
                                         combine_rows=32, combine_cols=64, dtype=torch.bfloat16)),
    # 160 filled rows: one chunk in the pair tile (128 + 64 rows, 32 of them filled)
    "bf16-rows160": (("full", 15), dict(T_loc=160, H=64, F=96, expert_rows=160,
                                        combine_rows=32, combine_cols=64, dtype=torch.bfloat16)),
    # the column split: pass-1 tasks on 32 hidden columns, pass-2 tasks on 32 output columns,
    # 160 filled rows (both passes' pair tiles on slices)
    "bf16-split": (("full", 17), dict(T_loc=160, H=64, F=96, expert_rows=160, expert_cols_f=32,
                                      expert_cols_h=32, combine_rows=32, combine_cols=64,
                                      dtype=torch.bfloat16)),
    # the column split on float32's TMA path (64-row tiles; slices of 64-byte rows)
    "fp32-split-tma": (("random", 19), dict(H=32, F=48, combine_cols=16, expert_cols_f=16,
                                            expert_cols_h=16)),
    # the column split on the pointer path (slices of 76-byte rows)
    "fp32-split": (("random", 18), dict(H=38, F=72, combine_cols=19, expert_cols_f=24,
                                        expert_cols_h=19)),
}  # fmt: skip


PATHS: set[str] = set()


def spy(fn, path):
    def call(*args, **kwargs):
        PATHS.add(path(args))
        return fn(*args, **kwargs)

    return call


_inputs_for = base.inputs_for


def inputs_for(graph, routing: str, seed: int) -> dict[str, torch.Tensor]:
    """megakernel_moe_interp's routings and "distinct": a permutation of E distinct values per
    token, exact in bf16, some negative (no tie: the CPU's topk and the route body agree)."""
    if routing != "distinct":
        return _inputs_for(graph, routing, seed)
    inputs = _inputs_for(graph, "random", seed)
    logits = inputs["router_logits"]
    T, E = logits.shape
    perm = torch.rand(T, E, generator=torch.Generator().manual_seed(seed)).argsort(dim=1)
    inputs["router_logits"] = ((perm - E // 2).float() / 32).to(logits.dtype)
    return inputs


def run(tag: str, routing: str, seed: int, **options: object) -> None:
    emit = base.emit
    base.emit = lambda case, **row: emit(f"{tag}:{case}", **row)
    PATHS.clear()
    try:
        base.one_rank(routing, seed, **options)
    finally:
        base.emit = emit
    emit(f"{tag}:paths", paths=sorted(PATHS))


if __name__ == "__main__":
    torch.set_num_threads(1)
    # the row tile (EM): _pass1_tma's 13th argument, _pass2_tma's 11th
    for name, em in (("_pass1_tma", 12), ("_pass2_tma", 10)):
        setattr(moe_bodies, name, spy(getattr(moe_bodies, name),
                                      lambda a, i=em: f"tma{getattr(a[i], 'value', a[i])}"))  # fmt: skip
    # the pair tile: 128 + EB rows (_pass1_pair's 13th argument, _pass2_pair's 11th)
    for name, eb in (("_pass1_pair", 12), ("_pass2_pair", 10)):
        setattr(moe_bodies, name, spy(getattr(moe_bodies, name),
                                      lambda a, i=eb: f"pair{128 + getattr(a[i], 'value', a[i])}"))  # fmt: skip
    for name in ("_pass1_pointer", "_pass2_pointer"):
        setattr(moe_bodies, name, spy(getattr(moe_bodies, name), lambda a: "pointer"))
    moe_bodies._thresholds16 = spy(moe_bodies._thresholds16, lambda a: "keys16")
    moe_bodies._thresholds = spy(moe_bodies._thresholds, lambda a: "float")
    base.inputs_for = inputs_for
    for tag, ((routing, seed), options) in CASES.items():
        run(tag, routing, seed, **options)
