"""How often the MoE expert tasks stream their expert's weights (moe_tiles.weight_streams), on the
host: a lowered moe_dispatch_combine graph and a routing's counts, the expert body's row-block
rule (moe_tiles.expert_row_blocks, which tests/test_moe_fast_paths.py checks against the paths
the Triton body takes under the interpreter).

Why: at bf16 a 128-row block does 128 flop per weight byte, below an H200's ~200, so each row
block of an expert task costs a full read of its expert's gate, up and down weights (88 MB at
H = 7168, F = 2048) and the weights' reads bound the expert time.

Run as a script for issue 17's bench shape (benchmarks/bench_moe.py: T = 4096 tokens per rank,
H = 7168, 256 experts, top-8, F = 2048, 2 ranks, a uniformly random routing as bench_moe draws
it): streams per expert, bytes and the predicted expert time, before (v11's rule) and after,
per expert_rows, then for the op's defaults with each task alone and with the schedule's queue
(tasks on one weight slice side by side share its reads):
    python tests/test_moe_weight_streams.py
"""

from __future__ import annotations

import torch

import mgraph as mg
from mgraph.ops.moe_tiles import expert_row_blocks, weight_streams

OP = "moe_dispatch_combine"


def v11_row_blocks(rows: int, itemsize: int) -> list[int]:
    """The expert body's rule in v11's run (and until the remainder block): one block size a
    task, 128 rows when they pad no more than 64-row blocks would, else 64."""
    if itemsize == 2 and -(-rows // 128) * 128 == -(-rows // 64) * 64:
        return [128] * -(-rows // 128)
    return [64] * -(-rows // 64)


def bench_picks(T_loc: int, E: int, top_k: int, world: int, seed: int = 0) -> torch.Tensor:
    """[world, E]: how many of each rank's tokens pick each expert under bench_moe's routing (a
    random permutation of E distinct logits per token: top_k experts uniformly at random)."""
    gen = torch.Generator().manual_seed(seed)
    picks = torch.zeros(world, E, dtype=torch.int64)
    for s in range(world):
        experts = torch.rand(T_loc, E, generator=gen).argsort(dim=1)[:, :top_k]
        picks[s] = torch.bincount(experts.flatten(), minlength=E)
    return picks


def test_streams_count_each_tasks_row_blocks():
    # 1x2, 4 experts per rank, segments of 64 rows (capacity_factor 8 at 32 expected rows per
    # source and expert), expert tasks of 32 rows: expert e of source s gets picks[s, e] rows,
    # cut at the capacity (64) and split 32 per task
    g = mg.ops.get_op(OP)(topology="1x2", dtype=torch.bfloat16, T=128, H=16, E=8, top_k=4, F=24,
                          expert_rows=32, capacity_factor=8.0)  # fmt: skip
    assert g.buffers["send@0"].rows // g.params["E"] == 64
    picks = torch.tensor([[0, 1, 32, 33, 64, 70, 5, 0], [31, 0, 0, 63, 2, 3, 4, 5]])
    got = weight_streams(g, picks)
    # filled rows per (source, expert), cut at 64; tasks [0:32] and [32:64], one block each when
    # filled (bf16 tasks of at most 32 rows: one 64-row block)
    filled = picks.clamp(max=64)
    tasks = (filled > 0).sum() + (filled > 32).sum()
    assert got["streams"] == float(tasks) == 16.0, got
    assert got["filled_rows"] == float(filled.sum()), got
    assert got["block_rows"] == 64.0 * tasks, got
    assert got["stream_bytes"] == tasks * 3 * 16 * 24 * 2, got
    # one task of the whole segment: a 64-row segment is one block, whatever its fill
    whole = mg.ops.get_op(OP)(topology="1x2", dtype=torch.bfloat16, T=128, H=16, E=8, top_k=4,
                              F=24, expert_rows=64, capacity_factor=8.0)  # fmt: skip
    assert weight_streams(whole, picks)["streams"] == float((filled > 0).sum()) == 12.0


def test_block_rule_streams_the_weights_once_per_192_rows():
    rule = {n: expert_row_blocks(n, 2) for n in (1, 64, 65, 128, 129, 160, 192, 193, 256, 300)}
    assert rule == {1: [64], 64: [64], 65: [128], 128: [128], 129: [192], 160: [192],
                    192: [192], 193: [192, 64], 256: [192, 64], 300: [192, 128]}  # fmt: skip
    assert expert_row_blocks(130, 4) == [64, 64, 64]  # float32: 64-row tiles
    # v11's rule took three 64-row blocks at 160 rows; now one 192-row block (the pair tile:
    # 128 + 64 rows in one K loop, one weight stream)
    g = mg.ops.get_op(OP)(topology="1x1", dtype=torch.bfloat16, T=256, H=16, E=2, top_k=1, F=24,
                          expert_rows=256, capacity_factor=2.0)  # fmt: skip
    picks = torch.tensor([[160, 96]])
    before, after = weight_streams(g, picks, v11_row_blocks), weight_streams(g, picks)
    assert (before["streams"], after["streams"]) == (3.0 + 1.0, 1.0 + 1.0)
    assert (before["block_rows"], after["block_rows"]) == (192.0 + 128.0, 192.0 + 128.0)


def test_bench_shape_streams_per_expert():
    """Issue 17's shape and bench_moe's routing: a (source, expert) segment holds 128 +- 11 rows,
    one chunk of at most 192 rows at 256 rows per task: one stream per segment, 2 per expert
    (two sources); v11's rule took 4 (three 64-row blocks for 129-192 rows)."""
    picks = bench_picks(4096, 256, 8, 2)
    g = mg.ops.get_op(OP)(topology="1x2", dtype=torch.bfloat16, T=8192, H=7168, E=256, top_k=8,
                          F=2048, expert_rows=256)  # fmt: skip
    before, after = weight_streams(g, picks, v11_row_blocks), weight_streams(g, picks)
    assert after["streams"] == 2.0 * 256, after
    assert before["streams"] - after["streams"] > 0.8 * 256, (before, after)
    assert after["filled_rows"] == before["filled_rows"] == 2 * 4096 * 8


def test_queue_order_streams_each_slice_once_for_all_sources():
    """With the queues, expert tasks on the same weights that follow each other among a rank's
    expert tasks count one stream: moe_dispatch_combine queues every source's tiles of a
    slice side by side, so at issue 17's size on 2 GPUs each expert's weights stream once
    (twice without the queue: once per source rank). Small case first: the rule on orders
    made by hand."""
    g = mg.ops.get_op(OP)(topology="1x2", dtype=torch.bfloat16, T=128, H=16, E=8, top_k=4, F=24,
                          expert_rows=32, capacity_factor=8.0)  # fmt: skip
    picks = torch.tensor([[0, 1, 32, 33, 64, 70, 5, 0], [31, 0, 0, 63, 2, 3, 4, 5]])
    alone = weight_streams(g, picks)
    assert alone["streams"] == 16.0  # one per filled 32-row tile (the first test)
    # the lowering's order: per expert, per row tile, per source (the whole expert's weights
    # in each task here: no column split), so every expert's tasks follow each other and each
    # expert with a filled row (all 8) streams once
    emitted = [[t.id for t in g.tasks if t.rank == r and t.role == "compute"] for r in (0, 1)]
    by_source = [sorted(q, key=lambda t: (g.tasks[t].params.get("source", -1), t))
                 for q in emitted]  # fmt: skip
    got = {name: weight_streams(g, picks, queues=q)
           for name, q in (("emitted", emitted), ("by_source", by_source))}  # fmt: skip
    assert got["emitted"]["streams"] == 8.0, got
    # one source's tasks, then the other's: an expert's two row tiles of one source still
    # follow each other (experts 3, 4, 5 of source 0, 3 of source 1: 16 - 4)
    assert got["by_source"]["streams"] == 12.0, got
    for key in ("filled_rows", "block_rows", "reread_bytes"):  # the work is the same
        assert got["emitted"][key] == got["by_source"][key] == alone[key], key
    # issue 17's size, bench_moe's routing, the op's defaults on 2 GPUs
    big = mg.ops.get_op(OP)(topology="1x2", dtype=torch.bfloat16, T=8192, H=7168, E=256,
                            top_k=8, F=2048)  # fmt: skip
    picks = bench_picks(4096, 256, 8, 2)
    queues = [rs.queues["compute"] for rs in mg.schedule(big).ranks]
    assert weight_streams(big, picks)["streams"] == 2.0 * 256
    assert weight_streams(big, picks, queues=queues)["streams"] == 1.0 * 256


def combined(picks: torch.Tensor, H: int, F: int) -> dict[str, float]:
    """weight_streams' sums if ONE task per expert took its rows from all sources (not built:
    the lowering gives each (source, expert) segment its own tasks), in the body's blocks."""
    streams = padded = 0
    for n in picks.sum(0).tolist():
        blocks = expert_row_blocks(int(n), 2)
        streams, padded = streams + len(blocks), padded + sum(blocks)
    per_row = (-(-F // 128) * H + -(-H // 256) * F) * 2
    return {"experts": float(picks.shape[1]), "streams": float(streams),
            "stream_bytes": float(streams * 3 * H * F * 2), "reread_bytes": float(padded * per_row),
            "block_rows": float(padded), "filled_rows": float(picks.sum())}  # fmt: skip


def predict(r: dict[str, float], H: int = 7168, F: int = 2048, world: int = 2,
            programs: int = 100, tflops_per_program: float = 5.0, hbm_tbs: float = 5.0) -> dict:  # fmt: skip
    """Per rank: weight streams per expert and the expert time's bounds: the weights' bytes at
    ``hbm_tbs``; with the x and hidden re-reads too (none in L2); the blocks' MMA work
    (padding rows included) at the GEMM segment's ``tflops_per_program`` (v11) over
    ``programs`` (v11: 1532 ms of expert busy time summed over programs, 15.3 ms a program)."""
    ms = 1e3 / world
    return {
        "streams_per_expert": round(r["streams"] / r["experts"], 2),
        "mma_rows_per_expert": round(r["block_rows"] / r["experts"], 1),
        "weights_gb": round(r["stream_bytes"] / world / 1e9, 1),
        "ms_weights": round(r["stream_bytes"] / (hbm_tbs * 1e12) * ms, 2),
        "ms_all_reads": round((r["stream_bytes"] + r["reread_bytes"]) / (hbm_tbs * 1e12) * ms, 2),
        "ms_mma": round(
            6.0 * r["block_rows"] * H * F / (programs * tflops_per_program * 1e12) * ms, 2
        ),  # fmt: skip
    }


if __name__ == "__main__":
    picks = bench_picks(4096, 256, 8, 2)
    for rows in (64, 128, 256):
        g = mg.ops.get_op(OP)(topology="1x2", dtype=torch.bfloat16, T=8192, H=7168, E=256,
                              top_k=8, F=2048, expert_rows=rows)  # fmt: skip
        for name, rule in (("v11", v11_row_blocks), ("now", expert_row_blocks)):
            print(f"expert_rows={rows} {name}:", predict(weight_streams(g, picks, rule)))
    print("one task per expert, all sources (not built):", predict(combined(picks, 7168, 2048)))
    # the op's defaults (512 rows, groups of 8, the 128/512 split), each task alone and in
    # the schedule's queue (every source's tiles of one weight slice side by side)
    g = mg.ops.get_op(OP)(topology="1x2", dtype=torch.bfloat16, T=8192, H=7168, E=256, top_k=8,
                          F=2048)  # fmt: skip
    queues = [rs.queues["compute"] for rs in mg.schedule(g).ranks]
    print("defaults, each task alone:", predict(weight_streams(g, picks)))
    print("defaults, the queue's neighbours share:", predict(weight_streams(g, picks, queues=queues)))
