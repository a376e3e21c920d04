"""MoE dispatch + experts + combine (expert parallel) on 2 GPUs: the torch baseline, its grouped
GEMMs alone, and mgraph's moe_dispatch_combine on backend="triton", same inputs, same process.

Run (the issue's shape, about 1-2 minutes):
    PYTHONUNBUFFERED=1 torchrun --nproc_per_node=2 benchmarks/bench_moe.py --out $OUT
``--nvlink-workers 0 16 24`` runs each mgraph configuration once per value: that many NVLink
workers a GPU and the other SMs compute (0: the scheduler's own split, 32 NVLink workers at the
issue's shape on 2 GPUs; the row's ``workers`` says what ran).
On one GPU (all experts local: per GPU the same expert work as on two, where each rank runs
its 128 experts once per source rank), with the time per task kind and per expert part:
    PYTHONUNBUFFERED=1 torchrun --nproc_per_node=1 benchmarks/bench_moe.py --warmup 1 --reps 2 \
        --kinds --out $OUT
Smoke check of the baseline on the CPU (gloo, tiny sizes, checked against the op's reference;
no megakernel: it needs a GPU):
    torchrun --nproc_per_node=2 benchmarks/bench_moe.py --smoke

Per rank: T tokens (x [T, H], router logits [T, E]) and E/W experts (SwiGLU, weights [H, F],
[H, F], [F, H]). Baseline (``torch_a2a``): top-k of the logits and a softmax over the k, argsort
by expert, all_to_all_single of the counts (then the host reads them: the splits), of the rows,
a regroup by local expert, torch._grouped_mm for gate|up and for down (a loop of mm per expert
where torch has no _grouped_mm: the row says which), all_to_all_single back, index_add of
weight * y into the tokens (fp32, cast once). ``grouped_gemm``: the two grouped GEMMs alone on
the same routed rows, the GEMM-only bound. ``mgraph``: the op's graph in the megakernel,
checked against the baseline's output (NaN-poisoned outputs first; relative error and worst
128x128 tile), timed, and checked again after the timed relaunches; one mgraph row per
``--configs`` value (default ``default 64 512 128:128,512``: the op's default tile options
(the headline; at this size 512 rows, groups of 8 and the 128/512 split), then a sweep beside
it: 64 rows (the op's default before v13), 512 rows unsplit, 128 rows split; ``ROWS:F,H`` splits
each tile into pass-1 tasks of F hidden columns and pass-2 tasks of H output columns; the
explicit configurations take --expert-group, default 8). A configuration the
runtime refuses is reported as a row with its error. The mgraph row also says the segment
capacity (rows per source rank and expert, from --capacity-factor: the op's default when not
given), the buffers' GiB per rank, and how many of all ranks' picks the op's drop policy drops
for these logits (``dropped_picks``, from the logits by ``kept_picks``; 0 expected: the baseline
drops none, so a drop shows as an error) beside the count the kernel itself reported in the op's
``dropped`` output (``dropped_kernel``, after the first and the last launch); ``dropped_agree``
says whether the two agree per rank and expert, exactly (the row has an error when not). Medians of
CUDA-event times, max over ranks. Router logits are a random permutation of E distinct values per token (exact in bf16),
so no two experts tie at the k-th place and both sides pick the same experts.

``--kinds``: per mgraph row, one traced launch: a row per task kind (benchmarks/kind_breakdown.py:
busy and work time summed over programs, mean time per task, TF/s per program of body time on
the tasks' expected rows) and one per part of the expert tasks (``moe_expert part0`` both
passes, ``part1`` pass 1 on a slice, ``part2`` pass 2 on a slice; with ``span_ms``, first start
to last end of the part).

Writes ``bench_moe.json`` (rows {impl, T, H, E, top_k, F, world, ms, ...}) and ``bench_moe.md``
under --out (default $OUT, else benchmarks/results).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # GPU.md: lazy loading vs spinning kernels
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mgraph as mg  # noqa: E402

OP = "moe_dispatch_combine"


def op_defaults() -> dict:
    """The op's tile options at their defaults (its lowering's keyword defaults)."""
    import inspect

    from mgraph.ops.moe_dispatch_combine import _lower

    return {name: p.default for name, p in inspect.signature(_lower).parameters.items()
            if p.default is not inspect.Parameter.empty}  # fmt: skip


def op_default(options: dict) -> bool:
    """Whether ``options`` (the op's tile options a row ran with) are all the op's defaults."""
    return all(options.get(k, v) == v for k, v in op_defaults().items())
GROUPED = "torch._grouped_mm" if hasattr(torch, "_grouped_mm") else "mm loop"


def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows[ends[e-1]:ends[e]] @ weights[e] for every expert e (ends: int32 cumulative counts)."""
    if GROUPED == "torch._grouped_mm":
        return torch._grouped_mm(rows, weights, offs=ends)
    out = rows.new_empty(rows.shape[0], weights.shape[-1])
    start = 0
    for e, end in enumerate(ends.tolist()):  # a host read: only where _grouped_mm is missing
        if end > start:
            torch.mm(rows[start:end], weights[e], out=out[start:end])
        start = end
    return out


class Baseline:
    """argsort + all_to_all_single + grouped GEMMs + all_to_all_single + index_add."""

    def __init__(self, x, logits, w_gate, w_up, w_down, top_k: int) -> None:
        self.x, self.logits, self.w_down, self.top_k = x, logits, w_down, top_k
        self.w_gate_up = torch.cat([w_gate, w_up], dim=2).contiguous()  # one GEMM for both
        self.world = dist.get_world_size()
        self.E_loc, self.F = w_gate.shape[0], w_gate.shape[2]

    def dispatch(self):
        k, W, E_loc = self.top_k, self.world, self.E_loc
        values, experts = self.logits.float().topk(k, dim=-1)
        weights = torch.softmax(values, dim=-1).flatten()
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # grouped by expert, hence by destination
        send = self.x[order // k]
        counts = torch.bincount(flat, minlength=W * E_loc)
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts)  # [source, local expert]
        send_split = counts.view(W, E_loc).sum(1).tolist()  # host sync: the splits
        recv_split = got.view(W, E_loc).sum(1).tolist()
        recv = send.new_empty(sum(recv_split), send.shape[1])
        dist.all_to_all_single(recv, send, recv_split, send_split)
        expert_of_row = torch.arange(E_loc, device=recv.device).repeat(W)
        regroup = expert_of_row.repeat_interleave(got).argsort(stable=True)
        ends = got.view(W, E_loc).sum(0).cumsum(0).to(torch.int32)
        return recv[regroup], ends, regroup, order, weights, send_split, recv_split

    def experts(self, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        gate_up = grouped_mm(rows, self.w_gate_up, ends)
        hidden = F.silu(gate_up[:, : self.F]) * gate_up[:, self.F :]
        return grouped_mm(hidden, self.w_down, ends)

    def __call__(self) -> torch.Tensor:
        rows, ends, regroup, order, weights, send_split, recv_split = self.dispatch()
        y = self.experts(rows, ends)
        back = torch.empty_like(y)
        back[regroup] = y
        ret = back.new_empty(self.x.shape[0] * self.top_k, back.shape[1])
        dist.all_to_all_single(ret, back, send_split, recv_split)
        out = torch.zeros(self.x.shape, dtype=torch.float32, device=self.x.device)
        out.index_add_(0, order // self.top_k, ret.float() * weights[order, None])
        return out.to(self.x.dtype)


def local_inputs(args, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """This rank's shards, generated on the device (the issue's weights are 22 GB in all)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    T, H, E, Fd = args.tokens, args.hidden, args.experts, args.ffn
    gen = torch.Generator(device=device).manual_seed(1 + rank)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)

    # E distinct integers times a power of two: exact in bf16 for E <= 256 (no ties at top-k)
    perm = torch.rand(T, E, generator=gen, device=device).argsort(dim=1)
    logits = ((perm - E // 2).float() / 32).to(dtype)
    E_loc = E // world
    return {
        "x": randn(T, H),
        "router_logits": logits,
        "w_gate": randn(E_loc, H, Fd, scale=H**-0.5),
        "w_up": randn(E_loc, H, Fd, scale=H**-0.5),
        "w_down": randn(E_loc, Fd, H, scale=Fd**-0.5),
    }


def samples(fn, warmup: int, reps: int) -> list[float]:
    """This rank's CUDA-event times (ms) of ``reps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def slowest_median(times: list[float]) -> float:
    med = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return med.item()


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def drops_by_expert(logits: torch.Tensor, top_k: int, segment: int) -> torch.Tensor:
    """[E] float32: this rank's picks per expert that the op's drop policy drops (kept_picks on
    the rank's logits: its tokens are one source rank), what the op's ``dropped`` row holds."""
    from mgraph.ops.moe_dispatch_combine import kept_picks

    _, experts, kept = kept_picks(logits, top_k, logits.shape[0], segment)
    lost = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return lost.scatter_(1, experts, (~kept).float()).sum(0)


def summed(value: torch.Tensor, op=dist.ReduceOp.SUM) -> float:
    """``value`` (one element) reduced over the ranks."""
    value = value.reshape(1).float().to("cuda")  # NCCL reduces CUDA tensors only
    dist.all_reduce(value, op=op)
    return value.item()


class Bench:
    def __init__(self, args) -> None:
        self.args, self.rank, self.world = args, dist.get_rank(), dist.get_world_size()
        self.rows: list[dict] = []
        self.shape = {"T": args.tokens, "H": args.hidden, "E": args.experts,
                      "top_k": args.top_k, "F": args.ffn, "world": self.world}  # fmt: skip

    def add(self, impl: str, ms: float, **extra: object) -> None:
        row = {"impl": impl, **self.shape, "ms": round(ms, 4), **extra}
        self.rows.append(row)
        if self.rank == 0:
            print(json.dumps(row), flush=True)

    def baseline(self, local: dict[str, torch.Tensor]) -> torch.Tensor:
        a = self.args
        base = Baseline(*(local[n] for n in ("x", "router_logits", "w_gate", "w_up", "w_down")),
                        top_k=a.top_k)  # fmt: skip
        want = base()
        self.add("torch_a2a", slowest_median(samples(base, a.warmup, a.reps)), grouped=GROUPED)
        rows, ends = base.dispatch()[:2]
        routed = rows.shape[0]
        ms = slowest_median(samples(lambda: base.experts(rows, ends), a.warmup, a.reps))
        tflops = 6.0 * routed * a.hidden * a.ffn / ms / 1e9
        self.add("grouped_gemm", ms, grouped=GROUPED, routed_rows=routed, tflops=round(tflops, 1))
        return want

    def mgraph(
        self,
        local: dict[str, torch.Tensor],
        want: torch.Tensor,
        expert_rows: int | None,
        split: tuple[int, int] | None,
        nvlink_workers: int = 0,
    ) -> None:
        from mgraph.hardware import H200
        from mgraph.ops.moe_dispatch_combine import rank_bytes
        from mgraph.runtime.megakernel import TritonRuntime
        from mgraph.runtime.memory import worst_tile_error

        a = self.args
        options = {"expert_rows": expert_rows, "expert_group": a.expert_group,
                   "combine_rows": a.combine_rows, "combine_cols": a.combine_cols}  # fmt: skip
        if expert_rows is None:  # --configs default: the op's own defaults
            options = {}
        if split is not None:
            options["expert_cols_f"], options["expert_cols_h"] = split
        if a.capacity_factor is not None:
            options["capacity_factor"] = a.capacity_factor
        # the op's default configuration: every option at its lowering's default and the
        # scheduler's own worker split (the chart and the notes quote it first; the other rows
        # are a sweep beside it)
        options["default"] = op_default(options) and not nvlink_workers
        start = time.time()
        try:
            graph = mg.ops.get_op(OP)(
                topology=f"1x{self.world}", dtype=torch.bfloat16, T=a.tokens * self.world,
                H=a.hidden, E=a.experts, top_k=a.top_k, F=a.ffn,
                **{k: v for k, v in options.items() if k != "default"},
            )  # fmt: skip
            segment = graph.buffers["send@0"].rows // a.experts
            # what the op chose for options left at their defaults (the graph's params)
            resolved = {k: graph.params[k] for k in ("expert_rows", "expert_group",
                                                     "expert_cols_f", "expert_cols_h")}
            expert_rows = resolved["expert_rows"]
            if options["default"]:  # the row says what the defaults resolved to
                options.update({k: v for k, v in resolved.items() if v is not None})
            lost = drops_by_expert(local["router_logits"], a.top_k, segment)
            sizes = {"T": a.tokens * self.world, "H": a.hidden, "E": a.experts, "top_k": a.top_k,
                     "F": a.ffn, "itemsize": 2, "expert_rows": expert_rows}  # fmt: skip
            if a.capacity_factor is not None:
                sizes["capacity_factor"] = a.capacity_factor
            memory = {"segment_rows": segment, "dropped_picks": int(summed(lost.sum())),
                      "gib_per_rank": round(rank_bytes(1, self.world, **sizes) / 2**30, 2)}  # fmt: skip
            # --nvlink-workers: that many NVLink workers a GPU, the other SMs compute (0: the
            # scheduler's own split)
            workers = None
            if nvlink_workers:
                workers = {"compute": H200.sms - nvlink_workers, "nvlink": nvlink_workers,
                           "rdma": 0}  # fmt: skip
            sched = mg.schedule(graph, workers=workers)
            options["workers"] = dict(sched.ranks[0].workers)
            options["nvlink_workers"] = options["workers"].get("nvlink", 0)  # the chart's label
            built = time.time() - start
            rt = TritonRuntime(sched)
            first = rt.run(local).outputs  # outputs NaN-poisoned before the launch
            got = first["out"]
            # the kernel's own count (this rank's row of dropped), read before the relaunches
            counted = first["dropped"].reshape(-1).clone()
            err, tile = rel(got, want), worst_tile_error(got, want)
            ms = slowest_median(samples(rt.launch, a.warmup, a.reps))
            rt.check()
            last = rt.run(local).outputs  # after warmup + reps relaunches
            err_again = rel(last["out"], want)
            agree = torch.equal(counted, lost) and torch.equal(last["dropped"].reshape(-1), lost)
            drops = {"dropped_kernel": int(summed(counted.sum())),
                     "dropped_kernel_after": int(summed(last["dropped"].sum())),
                     "dropped_agree": summed(torch.tensor(float(agree)), dist.ReduceOp.MIN) == 1}  # fmt: skip
        except Exception as exc:  # a graph the runtime refuses (or fails on) is reported
            self.add("mgraph", float("nan"), **{"nvlink_workers": nvlink_workers, **options},
                     error=repr(exc)[:400])  # fmt: skip
            return
        self.add("mgraph", ms, **options, tasks=len(graph.tasks), rel_err=round(err, 5),
                 worst_tile_err=round(tile, 5), rel_err_after=round(err_again, 5),
                 launches=rt.epoch, build_s=round(built, 1), **memory, **drops,
                 **rt.kernel_info(), **({} if drops["dropped_agree"] else
                 {"error": "the kernel's dropped counts differ from kept_picks"}))  # fmt: skip
        if a.kinds:  # where the kernel's time goes, per task kind (one traced launch)
            sys.path.insert(0, str(Path(__file__).parent))
            import kind_breakdown

            traces = []
            kind_rows = kind_breakdown.kind_rows
            # the trace itself too, for the expert rows per part below
            kind_breakdown.kind_rows = lambda trace, tasks: (
                traces.append(trace) or kind_rows(trace, tasks)
            )
            try:
                rows = kind_breakdown.kind_breakdown(rt)
            finally:
                kind_breakdown.kind_rows = kind_rows
            config = {k: options[k] for k in ("expert_rows", "expert_cols_f", "expert_cols_h",
                                              "nvlink_workers") if k in options}  # fmt: skip
            for row in rows + expert_parts(traces[0], graph.tasks):
                self.add("mgraph_kind", row["busy_ms"], **config, **row)
        del rt
        gc.collect()
        torch.cuda.empty_cache()


def expert_parts(trace, tasks) -> list[dict]:
    """One row per part of the moe_expert tasks in a traced launch (moe_tiles.EXPERT_PARTS:
    "moe_expert part0" both passes, "part1" pass 1 on a slice of hidden columns, "part2" pass 2
    on a slice of output columns): tasks, programs, busy and work time (less the waits for
    inputs), mean time per task, TF/s per program of body time (the tasks' flops: the EXPECTED
    routed rows, not the padded ones), and the makespan of the part (first start to last end)."""
    by_part: dict[int, list] = {}
    for r in trace.records:
        if r.kind == "moe_expert":
            by_part.setdefault(tasks[r.task].params.get("part", 0), []).append(r)
    rows = []
    for part, records in sorted(by_part.items()):
        busy = sum(r.end - r.start for r in records)
        work = sum(r.end - (r.start if r.ready is None else r.ready) for r in records)
        flops = sum(float(tasks[r.task].flops or 0.0) for r in records)
        span = max(r.end for r in records) - min(r.start for r in records)
        rows.append({"kind": f"moe_expert part{part}", "tasks": len(records),
                     "programs": len({r.worker for r in records}),
                     "busy_ms": round(busy * 1e3, 3), "work_ms": round(work * 1e3, 3),
                     "mean_us": round(busy / len(records) * 1e6, 2),
                     "mean_work_us": round(work / len(records) * 1e6, 2),
                     "tflops_per_program": round(flops / work / 1e12, 3) if work else None,
                     "span_ms": round(span * 1e3, 3)})  # fmt: skip
    return rows


def configs(text: list[str]) -> list[tuple[int | None, tuple[int, int] | None]]:
    """``--configs`` values: ``default`` (every tile option at the op's default, whatever the
    other flags say: rows (None, None)), ``ROWS`` (one expert task per row tile) or
    ``ROWS:F,H`` (the column split: pass-1 tasks of F hidden columns, pass-2 tasks of H
    output columns)."""
    out: list[tuple[int | None, tuple[int, int] | None]] = []
    for item in text:
        if item == "default":
            out.append((None, None))
            continue
        rows, _, cols = item.partition(":")
        split = tuple(int(c) for c in cols.split(",")) if cols else None
        if split is not None and len(split) != 2:
            raise SystemExit(f"--configs {item!r}: ROWS or ROWS:F,H")
        out.append((int(rows), split))
    return out


def smoke() -> None:
    """The baseline on the CPU (gloo) at tiny sizes against the op's torch reference."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    T_loc, E_loc, k = 16, 3, 2
    graph = mg.ops.get_op(OP)(topology=f"1x{world}", T=T_loc * world, H=32, E=E_loc * world,
                              top_k=k, F=48, expert_rows=T_loc)  # fmt: skip
    inputs = mg.ops.get_op(OP).random_inputs(graph, seed=0)
    want = mg.ops.get_op(OP).run_reference(inputs, graph.params)["out"]
    tokens, experts = (
        slice(rank * T_loc, (rank + 1) * T_loc),
        slice(rank * E_loc, (rank + 1) * E_loc),
    )
    w = [inputs[n][experts] for n in ("w_gate", "w_up", "w_down")]
    got = Baseline(inputs["x"][tokens], inputs["router_logits"][tokens], *w, top_k=k)()
    err = rel(got, want[tokens])
    print(json.dumps({"smoke": "torch_a2a", "rank": rank, "grouped": GROUPED, "rel_err": err}))
    assert err < 1e-5, err
    # The drop count the mgraph row compares with the kernel's, against the op's reference, on
    # a router that sends every token to expert 1 (segments of 8 of 16 rows: 8 dropped).
    skewed = mg.ops.get_op(OP)(topology=f"1x{world}", T=T_loc * world, H=32, E=E_loc * world,
                               top_k=k, F=48, expert_rows=4, capacity_factor=1.0)  # fmt: skip
    inputs["router_logits"][:, 1] += 50.0
    segment = skewed.buffers["send@0"].rows // (E_loc * world)
    lost = drops_by_expert(inputs["router_logits"][tokens], k, segment)
    want_lost = mg.ops.get_op(OP).run_reference(inputs, skewed.params)["dropped"][rank]
    print(json.dumps({"smoke": "dropped", "rank": rank, "segment": segment,
                      "dropped": lost.tolist()}))  # fmt: skip
    assert torch.equal(lost, want_lost) and lost[1] == T_loc - segment > 0, (lost, want_lost)
    dist.destroy_process_group()


def table(rows: list[dict]) -> str:
    base = next((r["ms"] for r in rows if r["impl"] == "torch_a2a"), None)
    gemm = next((r["ms"] for r in rows if r["impl"] == "grouped_gemm"), None)
    lines = ["| impl | ms | baseline / impl | impl / GEMM-only | notes |", "|---|---|---|---|---|"]
    for r in rows:
        ms = r["ms"]
        whole = r["impl"] != "mgraph_kind"  # a kind's row is busy time, not an op's time
        vs_base = f"{base / ms:.2f}x" if base and ms == ms and whole else ""
        vs_gemm = f"{ms / gemm:.2f}x" if gemm and ms == ms and whole else ""
        notes = ", ".join(f"{k}={r[k]}" for k in ("grouped", "expert_rows", "expert_cols_f",
                                                  "expert_cols_h", "workers", "rel_err",
                                                  "worst_tile_err",
                                                  "rel_err_after", "segment_rows", "dropped_picks",
                                                  "dropped_kernel", "dropped_agree", "gib_per_rank",
                                                  "kind", "tasks", "programs", "mean_us",
                                                  "tflops_per_program", "span_ms", "error")
                          if k in r)  # fmt: skip
        lines.append(f"| {r['impl']} | {ms:.3f} | {vs_base} | {vs_gemm} | {notes} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per GPU")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--configs", nargs="+", default=["default", "64", "512", "128:128,512"],
                        help="one mgraph row (and breakdown) per value: default (the op's "
                        "default tile options), ROWS (rows per expert "
                        "tile, one task per tile) or ROWS:F,H (each tile split into pass-1 "
                        "tasks of F hidden columns and pass-2 tasks of H output columns); the "
                        "expert body streams a task's weights once per chunk of up to 192 "
                        "filled rows")  # fmt: skip
    parser.add_argument("--expert-rows", type=int, nargs="+", default=None,
                        help="rows per expert tile, one task per tile: the same as --configs "
                        "with these values")  # fmt: skip
    parser.add_argument("--expert-group", type=int, default=8)
    parser.add_argument("--nvlink-workers", type=int, nargs="+", default=[0],
                        help="per mgraph configuration, one row per value: NVLink workers a "
                        "GPU, the other SMs compute (0: the scheduler's own split)")  # fmt: skip
    parser.add_argument("--combine-rows", type=int, default=64)
    parser.add_argument("--combine-cols", type=int, default=256)
    parser.add_argument("--capacity-factor", type=float, default=None,
                        help="the op's capacity_factor (default: the op's own)")  # fmt: skip
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--no-mgraph", dest="mgraph", action="store_false")
    parser.add_argument(
        "--kinds",
        action="store_true",
        help="one traced launch: time per task kind (benchmarks/kind_breakdown.py)",
    )
    parser.add_argument("--smoke", action="store_true", help="CPU check of the baseline (gloo)")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args()
    if args.smoke:
        return smoke()
    if args.experts > 256:
        parser.error("--experts above 256: the logits' distinct values are not exact in bf16")
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    bench = Bench(args)
    start = time.time()
    local = local_inputs(args, torch.device("cuda", rank), torch.bfloat16)
    want = bench.baseline(local)
    if args.mgraph:
        runs = (
            configs(args.configs)
            if args.expert_rows is None
            else [(rows, None) for rows in args.expert_rows]
        )
        for expert_rows, split in runs:
            for nvlink in args.nvlink_workers:
                bench.mgraph(local, want, expert_rows, split, nvlink)
    if rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_moe.json").write_text(json.dumps(bench.rows, indent=1))
        (out / "bench_moe.md").write_text(table(bench.rows))
        print(table(bench.rows), flush=True)
        print(f"total {time.time() - start:.0f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
