"""Runs under TRITON_INTERPRET=1 in a subprocess (see test_triton_moe.py): the MoE tile bodies
(moe_route, moe_move, moe_expert, moe_combine) run by the megakernel on float32
moe_dispatch_combine graphs, compared with the sequential CPU runtime on the same graph and
inputs (random, never zeros): each body's outputs (only the rows the counts say are filled:
the rest is never written) and the op's output against its torch reference. Routings: random,
experts left empty, experts filled to capacity, and (capacity_factor 1) experts sent more
tokens than their segments hold, which drop the later ones. Every case also reports the op's
``dropped`` output (the picks the route bodies dropped, per source rank and expert) beside the
CPU runtime's and the torch reference's (from kept_picks). Prints one JSON line per case."""

from __future__ import annotations

import json
import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"

import torch  # noqa: E402

import mgraph as mg  # noqa: E402
from mgraph.ops.moe_tiles import filled_rows  # noqa: E402
from mgraph.runtime.megakernel import TritonRuntime  # noqa: E402
from mgraph.runtime.megakernel.runtime import run_in_process  # noqa: E402
from mgraph.runtime.sequential import execute_sequential  # noqa: E402

OP = "moe_dispatch_combine"
# Sizes off every block of the bodies (H=40, F=72, E=6, 32 tokens per rank) so that the masked
# edges run; expert tiles of 16 rows (two per segment), combine tiles of 16 tokens x 20 columns.
SIZES = dict(H=40, F=72, top_k=2, expert_rows=16, combine_rows=16, combine_cols=20)
# The "drop" cases: capacity_factor 1 gives segments shorter than T_loc, and the full routing
# sends more tokens to experts 0 and 3 than they hold: the route body drops the later ones.
DROP = dict(capacity_factor=1.0)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def build(
    topology: str, T_loc: int = 32, E_loc: int = 6, group: int = 2, **options: object
) -> mg.TaskGraph:
    W = mg.Topology.parse(topology).world_size
    return mg.ops.moe_dispatch_combine(T=T_loc * W, E=E_loc * W, topology=topology,
                                       expert_group=group, **{**SIZES, **options})  # fmt: skip


def inputs_for(graph: mg.TaskGraph, routing: str, seed: int) -> dict[str, torch.Tensor]:
    inputs = mg.ops.get_op(OP).random_inputs(graph, seed=seed)
    logits, E = inputs["router_logits"], graph.params["E"]
    if routing == "empty":  # experts 1 and E-1 get no token: their tiles and moves do nothing
        logits[:, [1, E - 1]] -= 50.0
    elif routing == "full":  # experts 0 and 3 get every token: segments filled to capacity
        logits[:, [0, 3]] += 50.0
    return inputs


def emit(case: str, **row: object) -> None:
    print(json.dumps({"case": case, **row}), flush=True)


def one_rank(routing: str, seed: int, drop: bool = False, T_loc: int = 32,
             **options: object) -> None:  # fmt: skip
    """1x1: every body's output region against the CPU runtime's, filled rows only."""
    g = build("1x1", T_loc=T_loc, **{**(DROP if drop else {}), **options})
    inputs = inputs_for(g, routing, seed)
    want = execute_sequential(g, inputs)
    rt = TritonRuntime(mg.schedule(g), interpret=True)
    outputs = rt.run(inputs).outputs  # poisoned with NaN first: unwritten rows would show
    out = outputs["out"]
    got = {b: v.clone() for b, v in rt.views.items()}
    segment = g.buffers["send@0"].rows // g.params["E"]  # the capacity of a segment
    counts = want["counts@0"]
    assert torch.equal(got["counts@0"], counts), (got["counts@0"], counts)
    rows = filled_rows(counts, segment)
    errors = {
        "route-send": rel(got["send@0"][rows], want["send@0"][rows]),
        "route-meta": rel(got["send_meta@0"][rows], want["send_meta@0"][rows]),
        "route-pick_rows": rel(got["pick_rows@0"], want["pick_rows@0"]),
        "route-pick_weights": rel(got["pick_weights@0"], want["pick_weights@0"]),
        "expert-hidden": rel(got["hidden@0"][rows], want["hidden@0"][rows]),
        "expert-back": rel(got["back@0"][rows], want["back@0"][rows]),
        "combine-out": rel(out, want["out@0"]),
    }
    reference = mg.ops.get_op(OP).run_reference(inputs, g.params)
    errors["op-reference"] = rel(out, reference["out"])
    dropped = {
        "dropped": outputs["dropped"].flatten().tolist(),
        "dropped_cpu": want["dropped@0"].flatten().tolist(),
        "dropped_reference": reference["dropped"].flatten().tolist(),
    }
    for body, err in errors.items():
        emit(f"1x1-{routing}{'-drop' if drop else ''}-{seed}-{body}", error=err, segment=segment,
             counts=counts.flatten().tolist(), nan=bool(out.isnan().any()), **dropped)  # fmt: skip


def two_ranks(routing: str, seed: int, launches: int = 1, drop: bool = False) -> None:
    """1x2 in one interpreter program: dispatch and return through moe_move into the peer's
    buffers; the output against the CPU runtime and the op's torch reference."""
    options = {**DROP, "expert_rows": 8} if drop else {}  # drop: segments of 8 of 16 rows
    g = build("1x2", T_loc=16, E_loc=3, group=1, **options)
    inputs = inputs_for(g, routing, seed)
    want = mg.run(mg.schedule(g), inputs).outputs
    reference = mg.ops.get_op(OP).run_reference(inputs, g.params)
    got = run_in_process(mg.schedule(g), inputs, launches=launches)
    out = got["out"]
    kinds = sorted({t.kind for t in g.tasks})
    for what, other in (("runtime", want), ("reference", reference)):
        emit(f"1x2-{routing}{'-drop' if drop else ''}-{seed}-x{launches}-{what}",
             error=rel(out, other["out"]), kinds=kinds,
             segment=g.buffers["send@0"].rows // g.params["E"], nan=bool(out.isnan().any()),
             dropped=got["dropped"].tolist(), dropped_other=other["dropped"].tolist())  # fmt: skip


if __name__ == "__main__":
    torch.set_num_threads(1)
    which = sys.argv[1:] or ["one", "two"]
    if "one" in which:
        for routing, seed in (("random", 0), ("empty", 1), ("full", 2)):
            one_rank(routing, seed)
        one_rank("full", 6, drop=True)
        # 64 tokens (two of the route body's token blocks, its drop counts carried from the
        # first to the second) and segments of 16 rows for a mean load of 21: a random
        # routing that overflows some segments by a few picks
        one_rank("random", 8, drop=True, T_loc=64, capacity_factor=0.5)
    if "two" in which:
        two_ranks("random", 3, launches=2)
        two_ranks("empty", 4)
        two_ranks("full", 5)
        two_ranks("full", 7, drop=True)
