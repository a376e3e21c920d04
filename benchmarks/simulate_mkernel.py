"""Simulated predictions for mKernel's published configurations, written to benchmarks/simulated.md.

Cluster (mKernel's setup): 2 nodes x 8 H200, 50 GB/s per GPU between nodes (one 400 Gb/s NIC per
GPU, rail-optimised), 450 GB/s NVLink per GPU per direction. Every other constant is the
calibrated H200 profile (mgraph/profiles/h200.json, a source per value). For each configuration: build the
op's task graph, schedule it (the default policy's queues, work-balance SM split; and again with
the network_first policy), simulate it, and model the baselines (cuBLAS/FA2/grouped GEMM + NCCL-like collectives) on the same hardware.

Large shapes use coarser tiles and larger network chunks than the op defaults (listed per row),
so the graphs stay at most ~90k tasks; where a few lowering options are listed the fastest
predicted one is reported (as a tuned kernel would choose). Also written: the calibration of
the model against GPU.md, and the summary of benchmarks/results/predictions.json (every
committed GPU measurement against its prediction, written by benchmarks/predict.py).

Run: python benchmarks/simulate_mkernel.py [--quick] [--ops OP ... [--merge]] [--out benchmarks]
(about 20 minutes on 2 cores for every op; --ops writes a report of those ops only; with
--merge, the other ops' rows are kept from the results JSON already in --out and the header
names every run the rows come from)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# The simulator allocates nothing, but the builder's size guard counts the buffers a graph
# declares: MoE's capacity-sized exchange buffers on 16 ranks pass 64 GiB from T=8K.
os.environ.setdefault("MGRAPH_MAX_BYTES", str(1 << 50))

import mgraph as mg  # noqa: E402
from mgraph.runtime.sim import collective_times, simulate, sweep_comm_sms
from mgraph.runtime.sim.model import expected_fill

TOPOLOGY = "2x8"
PROFILE = mg.H200.model_copy(
    update={
        "name": "H200 mKernel cluster", "nvlink_gbps": 450.0, "rdma_gbps": 50.0,
        "sources": {**mg.H200.sources, "nvlink_gbps": "mKernel's cluster: 450 GB/s NVLink",
                    "rdma_gbps": "mKernel's cluster: one 400 Gb/s NIC per GPU"},
    }
)  # fmt: skip
# GPU.md's push probe (probes/nvlink_bw.py): 4 programs pushing 64x256 bf16 tiles reach 77 GB/s,
# 19 GB/s each; the megakernel's NVLink tasks were measured at nvlink_worker_gbps.
PROBE_PUSH_GBPS = 19.0
# The proxy with 4 copy streams (Settings.proxy_streams=4), measured: bench_proxy on 2x H200
# (benchmarks/results/v8/bench_proxy.log, --streams 4): 359,715 256 KiB WRITEs/s uncapped from 8
# producers, 2.8 us per command (1 stream: 25,876/s, 38.6 us; the profile's 17 us is v6.2's).
PROXY_4_STREAMS_US = 2.8
NETWORK_FIRST = "network_first"  # the policy column: mgraph/scheduler/policies.py
SWEEP = (4, 8, 12, 16, 24, 32)
KIB, MIB = 1024, 1024 * 1024
GEMM_AR_PUBLISHED = {2048: 1.50, 4096: 1.72, 8192: 1.38, 16384: 1.22, 32768: 1.36}
RING_PUBLISHED = {12288: 1.03, 24576: 1.43, 49152: 1.69, 98304: 1.88, 196608: 1.80}
TITLES = {
    "gemm_allreduce": "GEMM + AllReduce (M x K x N per GPU, K = N/16; global K = 16 K)",
    "ring_attention": "Ring attention (B=4, H=16, D=128, non-causal; S = total sequence)",
    "allgather_gemm": "AllGather + GEMM (M = K, N = M/16 per GPU; global N = M)",
    "gemm_reduce_scatter": "GEMM + ReduceScatter (M x 512 x 8192 per GPU; global K = 8192)",
    "moe_dispatch_combine": "MoE dispatch + experts + combine (H=7168, F=2048, top-8, 256 experts)",
}


@dataclass
class Case:
    op: str
    label: str
    params: dict[str, Any]
    options: list[dict[str, Any]]
    published: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def cases(quick: bool) -> list[Case]:
    out = []
    for m, pub in GEMM_AR_PUBLISHED.items():
        # broadcast_bytes: the node broadcast's NVLink copies in 256 KiB pieces (the size the
        # NVLink worker rate was calibrated on) while the network moves 1 MiB chunks
        if m <= 8192:
            tile, chunks = [128, 256], (64 * KIB, 256 * KIB, MIB)
        elif m == 16384:
            tile, chunks = [256, 256], (256 * KIB, MIB)
        else:
            tile, chunks = [512, 512], (MIB,)
        opts = [{"tile": tile, "chunk_bytes": c} for c in chunks]
        if m <= 16384:
            opts.append({"tile": tile, "chunk_bytes": MIB, "broadcast_bytes": 256 * KIB})
        out.append(Case("gemm_allreduce", f"{m}x{m // 16}x{m}", dict(M=m, N=m, K=m), opts, pub))
    for s, pub in RING_PUBLISHED.items():
        slice_bytes = 4 * 16 * (s // 16) * 128 * 2  # one rank's k (or v)
        opts = [{"block": s // 32, "chunk_bytes": max(256 * KIB, slice_bytes // 16)}]
        out.append(Case("ring_attention", f"S={s}", dict(B=4, H=16, S=s, D=128), opts, pub))
    for m in (4096, 8192, 16384, 32768):
        chunks = (256 * KIB, MIB, 4 * MIB) if m <= 16384 else (4 * MIB,)
        opts = [{"tile": [128, 256], "chunk_bytes": c} for c in chunks]
        out.append(Case("allgather_gemm", f"M=K={m}, N={m // 16}", dict(M=m, N=m, K=m), opts))
    for m in (2048, 4096, 8192, 16384, 32768, 65536):
        tile = [128, 256] if m <= 16384 else [512, 256]
        opts = [{"tile": tile, "chunk_bytes": c} for c in (256 * KIB, MIB)]
        out.append(Case("gemm_reduce_scatter", f"M={m}", dict(M=m, N=8192, K=8192), opts))
    for t in (8192, 16384, 32768, 65536, 131072):
        params = dict(T=t, H=7168, E=256, top_k=8, F=2048)
        opts = [{"expert_rows": t // 16, "combine_cols": 256}]
        out.append(Case("moe_dispatch_combine", f"T={t // 1024}K", params, opts))
    if quick:  # the smallest of each op: a smoke run of the whole script
        seen: set[str] = set()
        out = [c for c in out if not (c.op in seen or seen.add(c.op))]
    return out


def run_case(case: Case, quick: bool) -> dict[str, Any]:
    op = mg.ops.get_op(case.op)
    best = None
    first: tuple[float, Any, dict[str, Any]] | None = None  # network_first's best option
    start = time.perf_counter()
    for opts in case.options:
        graph = op(topology=TOPOLOGY, dtype=torch.bfloat16, **case.params, **opts)
        sched = mg.schedule(graph, PROFILE)
        res = simulate(sched)
        if best is None or res.predicted_s < best[0].predicted_s:
            best = (res, sched, graph, opts)
        alt = mg.schedule(graph, PROFILE, policy=NETWORK_FIRST)
        t = simulate(alt, baselines=False).predicted_s
        if first is None or t < first[0]:
            first = (t, graph, opts)
    res, sched, graph, opts = best
    row: dict[str, Any] = {
        "op": case.op, "label": case.label, "params": case.params, "options": opts,
        "tasks": len(graph.tasks), **res.summary(),
    }  # fmt: skip
    row["network_first"] = {"predicted_ms": first[0] * 1e3, "options": first[2]}
    row["order"] = default_order(sched)
    row["adaptive_ms"] = simulate(sched, adaptive=True, baselines=False).predicted_s * 1e3
    rdma_tasks = sum(1 for t in graph.tasks if t.role == "rdma")
    row["commands_per_rdma_task"] = res.stats["commands"] / rdma_tasks if rdma_tasks else 0.0
    row["first_push_target"] = first_targets(sched, "compute")
    row["first_nvlink_target"] = first_targets(sched, "nvlink")
    if not quick:
        points = sweep_comm_sms(sched, SWEEP)
        top = min(points, key=lambda p: (p.predicted_s, p.comm_sms))
        row["sweep"] = {str(p.comm_sms): p.predicted_s * 1e3 for p in points}
        row["best_split"] = {"comm_sms": top.comm_sms, "predicted_ms": top.predicted_s * 1e3}
    row["what_if"] = what_if(case, sched, graph, res, first[1])
    # mKernel compares with cuBLAS+NCCL (sequential) and FA2+NCCL; for ring attention take the
    # stronger of the all-gather+FA2 and the ring (overlapped P2P) baselines.
    name = "sequential"
    if case.op == "ring_attention":
        name = min(res.baselines, key=lambda k: res.baselines[k].time_s)
    row["compare_to"] = name
    row["predicted_speedup"] = res.speedup(name)
    row["published_speedup"] = case.published
    if case.published:
        row["diff"] = row["predicted_speedup"] / case.published - 1
    row["seconds"] = time.perf_counter() - start
    return row


def default_order(sched) -> str:
    """Which order the default policy (critical_path) took: "staged" where its queues are
    policies.staged_order's (placement.network_makespan predicted it faster), else
    "longest_path" (its queues equal that policy's)."""
    plain = mg.schedule(sched.graph, sched.hardware, policy="longest_path")
    same = all(a.queues == b.queues for a, b in zip(sched.ranks, plain.ranks, strict=True))
    return "longest_path" if same else "staged"


def first_targets(sched, role: str = "nvlink") -> list[int | None]:
    """For each rank of node 0, the GPU that at least half of the first wave of its ``role``
    tasks writing into node peers go to (None: no such GPU; a task writing into k peers counts
    1/k for each). The first wave: as many of those tasks as the role has workers (compute: the
    epilogue pushes of the first tiles; nvlink: the first copies)."""
    graph, out = sched.graph, []
    node = graph.topology.node_ranks(0)
    for rank in node:
        share: dict[int, float] = {}
        wave = max(1, sched.ranks[rank].workers.get(role, 0))
        seen = 0
        for tid in sched.ranks[rank].queues[role]:
            dsts = {graph.buffers[w.buffer].rank for w in graph.tasks[tid].writes}
            dsts = (dsts - {rank}) & set(node)
            if not dsts:
                continue
            for d in dsts:
                share[d] = share.get(d, 0.0) + 1 / len(dsts)
            seen += 1
            if seen == wave:
                break
        top = max(share, key=share.get, default=None)
        out.append(top if top is not None and share[top] >= seen / 2 else None)
    return out


def incast(row: dict[str, Any]) -> tuple[int, int] | None:
    """(target, senders) when 3+ GPUs of a node start by writing into the same GPU (from their
    compute epilogues or their NVLink tasks)."""
    for key in ("first_push_target", "first_nvlink_target"):
        targets = [t for t in row.get(key, []) if t is not None]
        if not targets:
            continue
        top = max(set(targets), key=targets.count)
        if targets.count(top) >= 3:
            return top, targets.count(top)
    return None


def what_if(case: Case, sched, graph, res, first_graph) -> dict[str, Any]:
    """One change of the model per op family that the explanations lean on."""
    if case.op == "ring_attention":
        hw = PROFILE.model_copy(update={"attention_tflops": 617.0})
        what = "fused attention tiles at cuDNN's 617 TF/s (GPU.md), baselines still FA2"
        return {"what": what, "predicted_ms": simulate(sched, hardware=hw).predicted_s * 1e3}
    if case.op == "moe_dispatch_combine":
        p = graph.params
        fill = p["top_k"] / p["E"]  # expected routed rows / capacity rows of a segment

        def rdma_routed(task) -> float:
            # RDMA legs of capacity blocks (not the one-row counts) as if the proxy's WRITE
            # length came from the count, as the NVLink legs' moe_move does already.
            w = task.writes[0]
            if task.role == "rdma" and w.row1 - w.row0 > 1:
                return fill
            return expected_fill(task)

        # Before: every byte of every capacity-sized region moves (the lowering before counts).
        before = simulate(sched, fill=lambda t: 1.0, baselines=False)
        after = simulate(sched, fill=rdma_routed, baselines=False)
        what = (f"RDMA legs also move only routed rows (bytes x {fill:.4f}; today the proxy's "
                "WRITEs are encoded at launch from the static, capacity-sized regions)")  # fmt: skip
        return {
            "what": what, "predicted_ms": after.predicted_s * 1e3,
            "capacity_ms": before.predicted_s * 1e3,
            "bytes": {"capacity": dict(before.bytes_by_link), "routed": dict(res.bytes_by_link),
                      "routed_rdma_too": dict(after.bytes_by_link)},
        }  # fmt: skip
    proxy = PROFILE.model_copy(update={"proxy_command_us": PROXY_4_STREAMS_US})
    if case.op == "gemm_allreduce":
        scheds = {
            "critical_path": sched,
            NETWORK_FIRST: mg.schedule(first_graph, PROFILE, policy=NETWORK_FIRST),
        }
        both = {
            policy: simulate(s, hardware=proxy, baselines=False).predicted_s * 1e3
            for policy, s in scheds.items()
        }
        policy = min(both, key=both.get)
        return {
            "what": f"the proxy on 4 copy streams ({PROXY_4_STREAMS_US:g} us per command, "
            f"measured; the profile: {PROFILE.proxy_command_us:g}; Settings.proxy_streams is 1 "
            "by default), on the faster of the two policies (named per row)",
            "predicted_ms": both[policy],
            "policy": policy,
            "by_policy": both,
        }
    push = PROFILE.model_copy(
        update={"nvlink_worker_gbps": PROBE_PUSH_GBPS, "nvlink_worker_push_gbps": PROBE_PUSH_GBPS}
    )
    both = push.model_copy(update={"proxy_command_us": PROXY_4_STREAMS_US})
    return {
        "what": f"NVLink workers at the push probe's {PROBE_PUSH_GBPS:g} GB/s (measured "
        f"{PROFILE.nvlink_worker_gbps:g} pulling, {PROFILE.nvlink_worker_push_gbps:g} pushing) "
        f"and the proxy on 4 copy streams ({PROXY_4_STREAMS_US:g} us per command, measured; the "
        f"profile: {PROFILE.proxy_command_us:g})",
        "predicted_ms": simulate(sched, hardware=both, baselines=False).predicted_s * 1e3,
    }


# -- calibration against GPU.md -----------------------------------------------------------------
def calibration() -> list[dict[str, Any]]:
    """The model on 1x2 H200 (the machine GPU.md measured) beside the measurements."""
    bf16 = torch.bfloat16
    rows = []

    def add(what: str, measured: str, lo: float, hi: float, sim_s: float) -> None:
        ms = sim_s * 1e3
        mid = lo if ms < lo else hi if ms > hi else ms
        rows.append({"what": what, "measured": measured, "simulated_ms": ms,
                     "error": ms / mid - 1})  # fmt: skip

    g = mg.ops.gemm_allreduce(M=8192, N=8192, K=8192, topology="1x2", dtype=bf16)
    ar = simulate(mg.schedule(g))
    seq = ar.baseline("sequential")
    add("cuBLAS 8192x8192x4096", "0.74-0.77 ms", 0.74, 0.77, seq.parts["compute_s"])
    add("NCCL all_reduce 128 MB", "0.52 ms", 0.52, 0.52, seq.parts["comm_s"])
    topo = mg.Topology.parse("1x2")
    ar64 = min(collective_times("all_reduce", 64 * MIB, topo, mg.H200).values())
    add("NCCL all_reduce 64 MB", "0.30 ms", 0.30, 0.30, ar64)
    add("cuBLAS then NCCL all_reduce", "1.23 ms", 1.23, 1.23, seq.time_s)
    g = mg.ops.gemm_reduce_scatter(M=8192, N=8192, K=8192, topology="1x2", dtype=bf16)
    rs = simulate(mg.schedule(g))
    add("matmul + NCCL reduce_scatter", "1.09 ms", 1.09, 1.09, rs.baseline("sequential").time_s)
    add("torch fused_matmul_reduce_scatter (vs our overlap)", "1.12 ms", 1.12, 1.12,
        rs.baseline("overlap").time_s)  # fmt: skip
    g = mg.ops.allgather_gemm(M=8192, N=16384, K=4096, topology="1x2", dtype=bf16)
    ag = simulate(mg.schedule(g))
    add("NCCL all_gather + matmul", "0.89 ms", 0.89, 0.89, ag.baseline("sequential").time_s)
    add("torch fused_all_gather_matmul (vs our overlap)", "0.96 ms", 0.96, 0.96,
        ag.baseline("overlap").time_s)  # fmt: skip
    g = mg.ops.ring_attention(B=4, H=16, S=32768, D=128, block=4096, topology="1x2", dtype=bf16)
    ra = simulate(mg.schedule(g))
    add("ring attention S=32768, FA2 + NCCL P2P overlapped", "54.3 ms", 54.3, 54.3,
        ra.baseline("overlap").time_s)  # fmt: skip
    g = mg.ops.moe_dispatch_combine(T=8192, H=7168, E=256, top_k=8, F=2048, expert_rows=4096,
                                    topology="1x2", dtype=bf16)  # fmt: skip
    moe = simulate(mg.schedule(g))
    add("MoE grouped GEMMs alone (T=4096/GPU)", "4.8 ms", 4.8, 4.8,
        moe.baseline("sequential").parts["compute_s"])  # fmt: skip
    add("MoE all_to_all + grouped_mm + all_to_all", "12.8 ms", 12.8, 12.8,
        moe.baseline("sequential").time_s)  # fmt: skip
    rows.append({"fused_1x2": {"gemm_allreduce": ar.predicted_s * 1e3,
                               "gemm_reduce_scatter": rs.predicted_s * 1e3,
                               "allgather_gemm": ag.predicted_s * 1e3}})  # fmt: skip
    return rows


def gpu_comparison(results: Path) -> dict[str, Any]:
    """The committed predictions of every GPU measurement (benchmarks/predict.py), per op."""
    path = results / "predictions.json"
    if not path.exists():
        return {}
    doc = json.loads(path.read_text())
    by_op: dict[str, list[dict[str, Any]]] = {}
    for r in doc["rows"]:
        if r["predicted_ms"] is not None:
            by_op.setdefault(r["op"], []).append(r)
    ops = {
        op: {"rows": len(rs), "within_goal": sum(r["within_goal"] for r in rs),
             "mean_abs_error": sum(abs(r["error"]) for r in rs) / len(rs)}
        for op, rs in sorted(by_op.items())
    }  # fmt: skip
    return {"profile": doc["profile"], "goal": doc["goal"], "summary": doc["summary"], "ops": ops}


# -- the report ---------------------------------------------------------------------------------
CALIBRATION_NOTES = [
    f"Notes: the GEMM is list-scheduled 128x256 tiles on 132 SMs at {PROFILE.tile_gemm_tflops:.0f} "
    "TF/s (16 waves; calibrate.py's megakernel GEMM alone, faster than the cuBLAS range GPU.md "
    "measured: the first row's error). NCCL all-reduce is 8.4 + 2 x 3.4 us (NCCL's tuning model) plus 128 MiB "
    "at the measured 259 GB/s bus bandwidth; the 64 MB point shows that this single bandwidth "
    "misses NCCL's extra fixed cost (about 40 us) by 9%. The overlap rows are NOT torch's fused "
    "ops: our kernel-level overlap picks the best of 1-16 chunks, while torch decomposes into "
    "one step per rank (2 here), which is why torch is slower than sequential and we are not. "
    "MoE: the grouped GEMMs match (the rate is fitted to them), but torch's all_to_all path "
    "costs 8 ms where two bandwidth-bound all-to-alls of the routed rows take 1.8 ms; the gap "
    "is token permutation, routing and the count exchange (a host sync), which the model does "
    "not have: the MoE baselines here are optimistic by up to ~2x.",
]


def op_notes(op: str, rows: list[dict[str, Any]]) -> list[str]:
    """What holds for every row of ``op`` (numbers from the rows themselves)."""
    worse = [r["label"] for r in rows if r["adaptive_ms"] > r["predicted_ms"] * 1.05]
    out = []
    staged = [r["label"] for r in rows if r.get("order") == "staged"]
    plain = [r["label"] for r in rows if r.get("order") == "longest_path"]
    if staged or plain:
        out.append(
            "The default policy (critical_path) took the staged order (rail sums and "
            "broadcasts as soon as their data can be there, tiles by network slot with the "
            "waves interleaved one send apart; policies.staged_order) at "
            f"{', '.join(staged) or 'no row'}, longest_path's at {', '.join(plain) or 'no row'}: "
            "whichever the queue model with each rank's proxy and NIC "
            "(placement.network_makespan) predicts faster, a prediction, no timing run."
        )
    if op == "gemm_allreduce":
        big = 32768**2 * 2  # output bytes D at 32768
        floor = 7 / 4 * big / (PROFILE.nvlink_push_gbps * 1e9) * 1e3
        cmds = max(r["commands_per_rdma_task"] for r in rows)
        out.append(
            "RDMA bytes per node are D (the output bytes: hierarchical). The floor of the fused "
            "kernel is its NVLink SM work: the node reduce-scatter and broadcast send 7/4 D per "
            f"GPU through at most {PROFILE.nvlink_push_gbps:g} GB/s of SM stores (GPU.md), "
            f"{floor:.1f} ms at 32768. The host proxy costs {PROFILE.proxy_command_us:g} us per "
            "command in the profile (bench_proxy v6.2, one copy stream) and the megakernel's "
            f"network plan needs {cmds:.2f} commands per RDMA write (netplan: one WRITE whose "
            "arrival flag serves every destination event, a SIGNAL only per extra source event; "
            "the issue's 2.5 predates it). The node broadcast after the rail all-reduce is one "
            "NVLink copy per (piece, peer), each raising its peer's event "
            "(gemm_allreduce.node_broadcast; a piece is the network chunk, or broadcast_bytes "
            "where the options say so), so a piece's 7 copies run on up to 7 workers, each at "
            f"the measured {PROFILE.nvlink_worker_push_gbps:g} GB/s per worker. All "
            "copies are sinks with paths of equal length; push_rotation ranks a rank's NVLink "
            "copies into one peer by their count first, so each rank queues them piece by piece, "
            "each piece's from its next GPU on, not every piece's copy to its next GPU before "
            "any to the GPU after it. The what-if column runs the proxy on 4 copy streams."
        )
    elif op == "ring_attention":
        out.append(
            "The fused attention tiles run at the same FA2 rate as the baseline (354 TF/s, "
            "GPU.md), so the fused kernel gains only what it hides of the KV movement. The "
            "baseline is the faster of NCCL all-gather + FA2 (sequential) and the FA2 + NCCL P2P "
            "ring (overlap), whose every step waits for a cross-node hop through one 46 GB/s NIC. "
            + _split_note("ring_attention._Movement._move")
        )
    elif op == "moe_dispatch_combine":
        r = rows[-1]
        w = r["what_if"]
        gb = {k: {link: v / 1e9 for link, v in b.items()} for k, b in w["bytes"].items()}
        out.append(
            "No published numbers. Buffers are sized for the worst case (each (source, "
            "destination) block holds T/16 rows per expert, E/top_k = 32x the routed rows), but "
            "counts travel as data: the route tile writes them, NVLink legs (moe_move) copy only "
            "the filled rows, expert tiles past a count exit, combine reads only filled rows. The "
            "sim costs each task's expected_fill (top_k/E of a capacity block: an expectation for "
            f"a uniform router). At {r['label']}: NVLink {gb['capacity']['nvlink']:.1f} GB "
            f"before (every capacity byte, {_ms(w['capacity_ms'])}) -> "
            f"{gb['routed']['nvlink']:.1f} GB now ({_ms(r['predicted_ms'])}); RDMA stays "
            f"{gb['routed']['rdma']:.1f} GB because the proxy encodes whole-region WRITEs at "
            f"launch. If the RDMA legs followed the counts too ({gb['routed_rdma_too']['rdma']:.1f}"
            f" GB): {_ms(w['predicted_ms'])} (baseline "
            f"{_ms(r['baselines']['sequential']['time_ms'])}). The single route task per rank "
            "stays a serial step."
        )
    else:
        gain = [r["label"] for r in rows if r["what_if"]["predicted_ms"] < 0.9 * r["predicted_ms"]]
        out.append("No published numbers." + (
            f" At {', '.join(gain)} the proxy and NVLink worker rates cost more than 10% (see "
            "the what-if column)." if gain else ""))  # fmt: skip
        if op == "allgather_gemm":
            out[-1] += (
                " " + _split_note("allgather_gemm._Gather.node_push and _forward") + " All those "
                "copies of a size have paths of equal length (the copy, then GEMM tiles); "
                "push_rotation ranks a rank's NVLink copies into one peer by their count first, so "
                "each rank queues them chunk by chunk, not peer by peer."
            )
    hit = [r["label"] for r in rows if incast(r)]
    if hit:
        target, senders = incast(next(r for r in rows if incast(r)))
        out.append(
            f"Incast ({', '.join(hit)}): most of the first wave of pushes of {senders} of the 8 "
            f"GPUs of a node write into GPU {target}: those pushes share one GPU's ingress "
            "(450 GB/s) instead of each having its own, which 2-GPU measurements cannot show."
        )
    else:
        pushes = [r["label"] for r in rows if any(t is not None for t in r["first_push_target"])]
        if pushes:
            first = next(r for r in rows if r["label"] == pushes[0])["first_push_target"]
            out.append(
                "No incast: the first wave of epilogue pushes of GPU r of node 0 goes to GPU "
                f"{', '.join(map(str, first))} for r = 0..7 (at {', '.join(pushes)}): the "
                "critical-path policy's push rotation staggers the peers by rank."
            )
        elif op in ("gemm_allreduce", "gemm_reduce_scatter"):
            out.append(
                "No incast: at no row does a GPU of node 0 send half of its first wave of "
                "epilogue pushes (one per compute worker) into one peer: the first tiles in "
                "its queue push into several peers."
            )
    if worse:
        out.append(
            f"The adaptive controller is slower than the static split at {', '.join(worse)}: "
            "the work-balance rule splits SMs by remaining work, so while compute has most of "
            "the work it takes SMs from the communication that later tiles wait on."
        )
    return [f"- {line}" for line in out] + ([""] if out else [])


def _split_note(where: str) -> str:
    return (
        "Each NVLink push (owner to node peers) and forward (rail peer to its node peers) is one "
        f"copy per (chunk, peer), the GPU at local index l starting with peer l+1 ({where}), "
        "so a chunk's 7 copies can run on up to 7 NVLink workers, each at the measured "
        f"{PROFILE.nvlink_worker_push_gbps:g} GB/s per worker, and a tile waits only for the "
        "copies that land its rows on its GPU."
    )


def explain_row(r: dict[str, Any]) -> list[str]:
    """Why the predicted speedup differs from mKernel's by more than 20%."""
    seq = r["baselines"][r["compare_to"]]
    busy = r["busy_by_role"]
    top = max(("compute", "nvlink", "proxy", "nic"), key=lambda k: busy.get(k, 0.0))
    base = r["baselines"][r["compare_to"]]["time_ms"]
    text = (
        f"**{r['label']}: {r['predicted_speedup']:.2f}x predicted vs {r['published_speedup']:.2f}x "
        f"published ({r['diff']:+.0%}).** Baseline {_ms(base)}"
    )
    if "compute_ms" in seq:
        text += (f" ({seq['compute_ms'] / seq['time_ms']:.0%} math, NCCL "
                 f"{seq.get('algorithms', 'p2p')})")  # fmt: skip
    text += (f"; fused {_ms(r['predicted_ms'])}, busiest: {top} "
             f"({busy.get(top, 0):.0%}).")  # fmt: skip
    wi = r["what_if"]
    text += f" With {wi['what']}: {_ms(wi['predicted_ms'])} ({base / wi['predicted_ms']:.2f}x"
    text += f", {wi['policy']})." if "policy" in wi else ")."
    nf = r["network_first"]["predicted_ms"]
    if nf < r["predicted_ms"] * 0.97:
        text += (f" The {NETWORK_FIRST} policy (sends leave while later tiles compute): "
                 f"{_ms(nf)} ({base / nf:.2f}x).")  # fmt: skip
    ad = r["adaptive_ms"]
    if ad < r["predicted_ms"] * 0.95:
        text += (f" The adaptive controller (Settings.adaptive, off by default): {_ms(ad)} "
                 f"({base / ad:.2f}x).")  # fmt: skip
    split = r.get("best_split")
    if split and split["predicted_ms"] < r["predicted_ms"] * 0.95:
        text += (f" The best static split ({split['comm_sms']} nvlink SMs vs the rule's "
                 f"{r['workers_rank0'].get('nvlink')}) gives {_ms(split['predicted_ms'])} "
                 f"({base / split['predicted_ms']:.2f}x).")  # fmt: skip
    if incast(r):
        text += (" The schedule starts with an NVLink incast (see above): the first pushes "
                 "run at a fraction of the SM push rate.")  # fmt: skip
    if r["op"] == "gemm_allreduce" and busy.get("nvlink", 0) > 0.85:
        text += (" The nvlink SMs are busy almost throughout: the fused time sits near the "
                 "NVLink floor above, while the baseline's NCCL ring spreads the same bytes "
                 "over 8 NICs and NVLink at the measured bus bandwidth.")  # fmt: skip
    if r["op"] == "gemm_allreduce":
        alone = wi["by_policy"]["critical_path"]
        text += (f" The faster proxy on the critical_path queues alone: {_ms(alone)} "
                 f"({base / alone:.2f}x). Each chunk crosses epilogue push -> node sum -> RDMA "
                 "-> rail sum -> RDMA -> 7 NVLink copies per piece, one per peer.")  # fmt: skip
        if ad < r["predicted_ms"] * 0.95:
            text += (" The adaptive controller gains where the NVLink work outlasts the GEMM: once "
                     "no compute task is left to take, its rule gives every SM of the pool to "
                     "the NVLink role (controller.decide, \"a role finished\"), past the static "
                     f"cap of {PROFILE.nvlink_max_sms} NVLink workers.")  # fmt: skip
        if r["diff"] > 0:
            text += (" Predicted above mKernel's published speedup, on what no 2x8 run has "
                     "measured: GEMM tiles at the 1-GPU rate "
                     f"({PROFILE.tile_gemm_tflops:.0f} TF/s; calibrate.py's 2-GPU GEMM ran at "
                     "733, benchmarks/NOTES.md), NVLink worker rates measured on 2 GPUs (one "
                     "peer per GPU; 7 here)")  # fmt: skip
            if r.get("order") == "staged":
                text += (", and no cost for the megakernel's static GEMM prefix, which the "
                         "staged order ends at the first node or rail sum of the compute queue "
                         "(runtime/megakernel/encode.py; the rest of the tiles take the "
                         "dynamic path)")  # fmt: skip
            text += "."
        elif base / ad >= r["published_speedup"]:
            text += (" What separates the default from the published speedup is the static "
                     f"split: the adaptive controller reaches {base / ad:.2f}x.")  # fmt: skip
        elif alone >= r["predicted_ms"] * 0.97:
            text += (" The faster proxy does not help these queues: the GEMM with its epilogue "
                     "pushes (the node reduce-scatter through the push port) and the NVLink "
                     "workers beside it set the time; what mKernel gains over this needs faster "
                     "SM pushes (the floor above), not a cheaper proxy.")  # fmt: skip
        else:
            text += (" What is left after it is the NVLink SM work (floor above), the "
                     "per-worker NVLink rate (one worker moves each copy), the NVLink worker cap "
                     "and the fixed costs.")  # fmt: skip
    if r["op"] == "ring_attention" and r["diff"] < 0:
        text += (" mKernel's gain grows with S, i.e. with the share of attention math: its "
                 "attention tiles are faster than FA2 (GPU.md's cuDNN reaches 617 TF/s), while "
                 "the model gives fused tiles the FA2 rate; the chained online-softmax tiles "
                 "also stall on KV arrivals when the split leaves few nvlink SMs.")  # fmt: skip
    elif r["op"] == "ring_attention":
        text += (" At small S the model's baseline is NCCL all-gather + FA2, mostly "
                 "communication, which the fused kernel hides; mKernel reports almost no gain "
                 "here, so its small-S kernel pays overheads (per-tile, per-step "
                 "synchronisation) the model does not have.")  # fmt: skip
    return [f"- {text}"]


def markdown(rows, calib, gpu, runs: list[dict[str, Any]]) -> str:
    """The report; ``runs``: the runs the rows come from, oldest first (command, seconds,
    commit, ops: None for every op)."""
    hw = PROFILE
    first, *later = runs
    made = (f"Generated by `{first['command']}` in {first['seconds']:.0f} s (runtime/sim, the "
            f"cluster simulator) on commit {first['commit']}. ")  # fmt: skip
    for i, run in enumerate(later):
        # only the ops whose rows no later run replaced
        kept = [op for op in run["ops"] if not any(op in r["ops"] for r in later[i + 1 :])]
        ops = ", ".join(TITLES[op].split(" (")[0] for op in kept)
        made += (f"{ops} re-run by `{run['command']}` in {run['seconds']:.0f} s on commit "
                 f"{run['commit']}. ")  # fmt: skip
    made += (
        f"Cluster: {TOPOLOGY} H200, {hw.rdma_gbps:g} GB/s per GPU between nodes (rail NICs), "
        f"{hw.nvlink_gbps:g} GB/s NVLink per GPU per direction; all other constants are the "
        "calibrated H200 profile, mgraph/profiles/h200.json (each value says where it comes from). Times are predictions, "
        "not measurements. Raw numbers: benchmarks/results/simulated_mkernel.json."
    )
    lines = [
        "# Simulated mKernel configurations",
        "",
        made,
        "",
        "Columns: *fused* = the megakernel on the default policy's queues (critical_path; which "
        "order it took on the multi-node graphs is named under each table) and work-balance SM "
        "split; "
        "*adaptive* = the same with the controller re-splitting compute/nvlink SMs every 20 us; "
        "*best split* = the best static split of a sweep over nvlink SMs "
        f"({', '.join(map(str, SWEEP))}); *{NETWORK_FIRST}* = the fused kernel on the "
        f"{NETWORK_FIRST} policy's queues (best option; the default is critical_path) and its "
        "speedup; *sequential* = math on all SMs then (or before) the "
        "best NCCL-like collective (ring, tree, hierarchical); *overlap* = kernel-level overlap "
        "(chunked, two streams, NCCL holding SMs); speedups are over the baseline named in "
        "*vs*; *diff* compares the predicted speedup with mKernel's published one.",
        "",
    ]
    for op, title in TITLES.items():
        mine = [r for r in rows if r["op"] == op]
        if not mine:
            continue
        lines += [f"## {title}", ""]
        head = ["config", "tasks", "options", "fused", "adaptive", "best split", NETWORK_FIRST,
                "sequential", "overlap", "vs", "speedup", "published", "diff", "what-if"]  # fmt: skip
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in mine:
            b = r["baselines"]
            split = r.get("best_split")
            nf = r["network_first"]["predicted_ms"]
            lines.append("| " + " | ".join([
                r["label"], str(r["tasks"]), _opts(r["options"]), _ms(r["predicted_ms"]),
                _ms(r["adaptive_ms"]),
                f"{split['comm_sms']}: {_ms(split['predicted_ms'])}" if split else "-",
                f"{_ms(nf)} ({b[r['compare_to']]['time_ms'] / nf:.2f}x)",
                _ms(b["sequential"]["time_ms"]), _ms(b["overlap"]["time_ms"]), r["compare_to"],
                f"{r['predicted_speedup']:.2f}x",
                f"{r['published_speedup']:.2f}x" if r["published_speedup"] else "-",
                f"{r['diff']:+.0%}" if "diff" in r else "-",
                _ms(r["what_if"]["predicted_ms"]),
            ]) + " |")  # fmt: skip
        lines += ["", f"What-if: {mine[0]['what_if']['what']}.", ""]
        lines += op_notes(op, mine)
        for r in mine:
            if abs(r.get("diff", 0.0)) > 0.20 or (op == "gemm_allreduce" and "diff" in r):
                lines += explain_row(r)
        lines.append("")
    lines += ["## Calibration against GPU.md (the team's H200 notes) (1 node x 2 H200, bf16)", "",
              "| what | measured | simulated | error |", "|---|---|---|---|"]  # fmt: skip
    for c in calib:
        if "what" in c:
            lines.append(f"| {c['what']} | {c['measured']} | {_ms(c['simulated_ms'])} | "
                         f"{c['error']:+.0%} |")  # fmt: skip
    fused = next(c["fused_1x2"] for c in calib if "fused_1x2" in c)
    lines += ["", "Predicted fused times on the same 1x2 machine (no GPU measurement yet): "
              + ", ".join(f"{k} {_ms(v)}" for k, v in fused.items()) + ".", ""]  # fmt: skip
    lines += CALIBRATION_NOTES
    lines += ["", "## Predictions of the GPU measurements (benchmarks/predict.py)", ""]
    if not gpu:
        lines.append("No benchmarks/results/predictions.json yet: run "
                     "`python benchmarks/predict.py`, then this script.")  # fmt: skip
    else:
        s = gpu["summary"]
        lines += [
            "Every row of the committed bench_tp (v7 and v8) and bench_emulated runs, simulated "
            "with the "
            f"same calibrated profile ({gpu['profile']}): {s['within_goal']} of {s['modelled']} "
            f"modelled rows within {gpu['goal']:.0%} (mean |error| {s['mean_abs_error']:.0%}; "
            f"{s['rows'] - s['modelled']} rows are configurations the model does not represent, "
            "each with its reason). Per row: benchmarks/results/predictions.json.",
            "",
            "| op | modelled rows | within 15% | mean abs error |",
            "|---|---|---|---|",
        ]
        for op, o in gpu["ops"].items():
            lines.append(f"| {op} | {o['rows']} | {o['within_goal']} | "
                         f"{o['mean_abs_error']:.0%} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def _commit() -> str:
    """The commit the predictions were made on (the ops' lowerings change what is predicted)."""
    import subprocess

    def git(*args: str) -> str:
        run = subprocess.run(["git", *args], capture_output=True, text=True,
                             cwd=Path(__file__).parent)  # fmt: skip
        return run.stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + (" + uncommitted changes" if git("status", "--porcelain") else "")


def _ms(ms: float) -> str:
    return f"{ms:.3f} ms" if ms < 10 else f"{ms:.1f} ms"


def _opts(opts: dict[str, Any]) -> str:
    parts = []
    for k, v in opts.items():
        if k.endswith("_bytes"):
            v = f"{v // MIB} MiB" if v >= MIB else f"{v // KIB} KiB"
        parts.append(f"{k}={v}".replace(" ", ""))
    return " ".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one config per op, no sweeps")
    parser.add_argument("--out", default=str(Path(__file__).parent), help="folder for the .md")
    parser.add_argument("--ops", nargs="+", choices=sorted(TITLES), help="only these ops")
    parser.add_argument("--merge", action="store_true",
                        help="with --ops: keep the other ops' rows of the results JSON in --out")  # fmt: skip
    args = parser.parse_args()
    if args.merge and not args.ops:
        parser.error("--merge needs --ops (the ops to re-run)")
    out = Path(args.out)
    results = out / "results"
    results.mkdir(parents=True, exist_ok=True)
    old = json.loads((results / "simulated_mkernel.json").read_text()) if args.merge else None
    torch.set_num_threads(1)
    start = time.perf_counter()
    rows = []
    for case in cases(args.quick):
        if args.ops and case.op not in args.ops:
            continue
        row = run_case(case, args.quick)
        rows.append(row)
        print(f"{case.op:22s} {case.label:22s} fused {row['predicted_ms']:9.3f} ms  "
              f"x{row['predicted_speedup']:.2f} vs {row['compare_to']}  ({row['seconds']:.0f} s)",
              flush=True)  # fmt: skip
    calib = calibration()
    gpu = gpu_comparison(Path(__file__).parent / "results")  # GPU runs live in the repo
    elapsed = time.perf_counter() - start
    command = (
        "python benchmarks/simulate_mkernel.py"
        + (" --quick" if args.quick else "")
        + (f" --ops {' '.join(args.ops)}" if args.ops else "")
        + (" --merge" if args.merge else "")
    )
    runs = [{"command": command, "seconds": elapsed, "commit": _commit(), "ops": args.ops}]
    if old is not None:  # earlier runs whose every row this one replaces drop out
        kept = [r for r in old["runs"] if r["ops"] is None or set(r["ops"]) - set(args.ops)]
        runs = kept + runs
        order = list(TITLES)
        rows = sorted([r for r in old["rows"] if r["op"] not in args.ops] + rows,
                      key=lambda r: order.index(r["op"]))  # fmt: skip
    (results / "simulated_mkernel.json").write_text(json.dumps(
        {"command": command, "runs": runs, "profile": PROFILE.model_dump(),
         "topology": TOPOLOGY, "rows": rows, "calibration": calib, "gpu_comparison": gpu},
        indent=1))  # fmt: skip
    (out / "simulated.md").write_text(markdown(rows, calib, gpu, runs))
    print(f"wrote {out / 'simulated.md'} and {results / 'simulated_mkernel.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
