"""One Llama-style decoder layer under tensor + sequence parallelism on 2 GPUs: mgraph's Program
against torch's own TP (``parallelize_module``, eager, NCCL) and ``torch.compile`` of that, on
the same weights and inputs, in one run (issue 16, item 4).

Run (expected under ~6 minutes on 2 H200 at the default sizes; see "Time" below):
    PYTHONUNBUFFERED=1 torchrun --nproc_per_node=2 benchmarks/bench_layer.py --out $OUT
CPU smoke check (2 gloo processes, tiny sizes; tests/test_bench_layer.py runs it):
    torchrun --nproc_per_node=2 benchmarks/bench_layer.py --smoke --out /tmp/bench_layer

The layer (hidden 4096, 32 heads, 8 KV heads, FFN 14336, seq 4096, batch 1, bf16 by default;
every size is a flag): RMSNorm, q/k/v projections, rotary embeddings (tables from an
``inv_freq`` buffer at ``arange(S)``), causal SDPA with ``enable_gqa=True``, o projection,
residual add, RMSNorm, SwiGLU MLP, residual add. The same weights (seed 0) and the same input
on every rank; each rank passes its sequence chunk ``x.chunk(world, 1)[rank]`` and gets its
chunk of the output back, as under ``parallelize_module``.

Rows (``bench_layer.json``, and ``bench_layer.md`` as a table, under --out):

- ``eager_tp``: the layer under ``parallelize_module`` as torch's TP tutorial writes the plan:
  ``SequenceParallel`` norms, ``PrepareModuleInput`` gathering the token shards once per
  attention/MLP, ``ColwiseParallel`` q/k/v/gate/up, ``RowwiseParallel(output_layouts=Shard(1))``
  o/down (their reduce-scatter back to token shards).
- ``torch_compile_tp``: ``torch.compile`` of that parallelized module (``compile_s``: its first
  call, compile included).
- ``mgraph``: ``mg.compile(layer, plan, backend="triton")`` with the same sharding written in
  mgraph's vocabulary (no ``PrepareModuleInput`` and no ``output_layouts``: mgraph infers the
  gathers and the reduce-scatters from the SequenceParallel norms); timed around ``prog(x)``,
  which copies x into the kernel's buffers, re-copies only parameters torch saw change,
  replays the kernel, copies the output out and reads the watchdog record. Its compile time:
  ``trace_s``, ``lower_s`` (pointwise fusion, lowering, validation, the body check),
  ``schedule_s``, from the per-stage timer ``mgraph compile --profile`` uses
  (mgraph.cli.StageTimes), and ``first_call_s`` (runtime build, megakernel JIT and one run:
  the kernel build) beside ``second_call_s``.
- ``mgraph_kernel``: the same Program's megakernel relaunched alone (its inputs already loaded;
  launches after the first replay a CUDA graph), its output read back after the timed launches.
- ``mgraph_warm``: a second ``mg.compile`` in this process of a freshly built layer (the same
  weights), its stages and first call: the warm compile.

``ms`` is the median of CUDA-event times per rank, max over ranks, pooled over two rounds that
time every implementation in turn (the first implementation timed in a run measured slower
than later ones: bench_tp.py). ``vs_eager_tp`` is eager_tp's ms over the row's ms (above 1:
faster). ``error`` is the relative error (max over ranks and calls) against the layer in fp32
(eager torch, unsharded, on the same bf16 weights and input); a row above 2e-2 is a failure. A
failure of one implementation is a row with its status and message; the others still run.

Time: mg.compile of the default layer (1x2, 13088 tasks: no relayout left since the RoPE and
head-split fusions, NOTES v10; trace + fuse + lower + validate + schedule) took 1.9 s cold (the
first in a process) and 0.5 s warm on the project's 2-core CPU machine (2026-11-30, reference
backend, timed around mg.compile). The v9 run on 2 H200 (`--no-warm --rounds 1 --reps 10`, at
39744 tasks) took 85 s in all; the warm compile and more rounds add to that. ``--no-warm`` and
``--no-torch-compile`` drop those steps. MGRAPH_WATCHDOG_S defaults to 60 here (mgraph's default is 5 s): a rank whose first call
builds the megakernel later than its peer's waits at the kernel's entry barrier meanwhile.

--smoke: tiny sizes on the CPU, gloo; mgraph on backend="reference" (a single-controller
Program: every rank runs the whole program with the global input and keeps its chunk; no
megakernel, so no ``mgraph_kernel`` row); eager TP on gloo; torch.compile with the
``aot_eager`` backend (no C++ compile) unless --compile-backend says otherwise, and a row with
status "skipped" where torch.compile is unavailable. Times there mean nothing. ``--smoke
--interpret`` (TRITON_INTERPRET=1 set, fp32: the interpreter's bf16 ``tl.dot`` is wrong, NOTES.md)
runs mgraph on backend="triton" in Triton's interpreter instead; on one rank
(``--nproc_per_node=1``) that includes the ``mgraph_kernel`` row (about a minute: ~10 s per
interpreted launch).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

import mgraph as mg
from mgraph.cli import StageTimes
from mgraph.trace import pointwise

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_timing import sync, timeline_row, window  # noqa: E402 - benchmarks/ on the path first
from llama_layer import build_layer  # noqa: E402

TOL = 2e-2  # bf16: relative error against the fp32 layer (tests/gpu_programs.py's bound)
SMOKE = dict(hidden=128, heads=8, kv_heads=2, ffn=256, seq=64, batch=1)


def mgraph_plan(options: dict | None = None) -> dict[str, mg.plans.ParallelStyle]:
    """The layer's plan; ``options`` (e.g. a GEMM ``tile``) go to every linear's fused op."""
    kw = {"options": options} if options else {}
    plan: dict[str, mg.plans.ParallelStyle] = {
        f"self_attn.{p}_proj": mg.ColwiseParallel(**kw) for p in ("q", "k", "v")
    }
    plan["self_attn.o_proj"] = mg.RowwiseParallel(**kw)
    plan["mlp.gate_proj"] = mg.ColwiseParallel(**kw)
    plan["mlp.up_proj"] = mg.ColwiseParallel(**kw)
    plan["mlp.down_proj"] = mg.RowwiseParallel(**kw)
    plan["input_layernorm"] = mg.SequenceParallel()
    plan["post_attention_layernorm"] = mg.SequenceParallel()
    return plan


def torch_plan() -> dict:
    """torch's TP tutorial plan for a Llama layer, with this layer's module names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    def gather_once() -> PrepareModuleInput:  # one all-gather per module, not one per linear
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

    return {
        "input_layernorm": SequenceParallel(),
        "self_attn": gather_once(),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": gather_once(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


# -- measuring --------------------------------------------------------------------------------
def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def samples(fn: Callable[[], object], warmup: int, reps: int, device: torch.device) -> list[float]:
    """This rank's times (ms) of ``reps`` calls after ``warmup`` untimed ones: CUDA events on a
    GPU, the wall clock on the CPU; every call starts after a barrier on idle devices."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        dist.barrier()
        times.append(window(fn, 1, device))
    return times


def back_to_back(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """ms per call of ``calls`` calls issued back to back (gpu_timing.window), after one untimed
    call and a barrier; ``samples`` starts every call on an idle device instead."""
    fn()
    dist.barrier()
    return window(fn, calls, device)


def stage_times(times: StageTimes, wall: float) -> dict:
    """mg.compile's stages as the row reports them (seconds, wall)."""
    w = times.wall
    return {
        "trace_s": w.get("trace", 0.0),
        "lower_s": sum(
            w.get(s, 0.0) for s in ("fuse_pointwise", "lower", "validate", "check_triton_bodies")
        ),
        "schedule_s": w.get("schedule", 0.0),
        "compile_s": wall,
        "stages": {k: round(v, 3) for k, v in w.items()},
        "compile_cpu_s": round(sum(times.cpu.values()), 3),
    }


class Bench:
    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.rows: list[dict] = []
        self.timed: dict[str, Callable[[], object]] = {}  # impl -> call, timed in rounds
        self.after: dict[str, Callable[[], float]] = {}  # impl -> error read after timing
        self.program: mg.Program | None = None  # the timed (cold) Program
        self.variants: dict[str, tuple] = {}  # sweep impl -> (Program, layer), kept alive

        torch.manual_seed(1)
        shape = (args.batch, args.seq, args.hidden)
        self.x = torch.randn(shape, dtype=args.dtype).to(device)
        self.x_local = self.x.chunk(self.world, 1)[self.rank].contiguous()
        exact = build_layer(args, device).float()
        with torch.no_grad():
            self.want = exact(self.x.float()).chunk(self.world, 1)[self.rank].contiguous()
        del exact
        gc.collect()

    # -- rows ---------------------------------------------------------------------------------
    def step(self, impl: str, fn: Callable[[], dict]) -> dict:
        """Run ``fn`` on every rank (its dict: error, times, ...), merge the ranks' results into
        one row (numbers: max over ranks; a failure on any rank fails the row)."""
        try:
            mine = {"status": "ok", **fn()}
        except Exception as exc:  # noqa: BLE001 - one broken implementation must not hide others
            mine = {
                "status": f"FAIL {type(exc).__name__}: {str(exc)[:400]}",
                "trace": traceback.format_exc()[-1500:],
            }
        everyone: list = [None] * self.world
        dist.all_gather_object(everyone, mine)
        row: dict = {"impl": impl, "ms": None, "vs_eager_tp": None, "error": None}
        bad = [(rank, r) for rank, r in enumerate(everyone) if r["status"] != "ok"]
        row["status"] = f"{bad[0][1]['status']} (rank {bad[0][0]})" if bad else "ok"
        for key in sorted({k for r in everyone for k in r} - {"status"}):
            values = [r[key] for r in everyone if r.get(key) is not None]
            if not values:
                continue
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                # NaN anywhere (a poisoned output read back) must survive the max
                row[key] = math.nan if any(math.isnan(v) for v in values) else max(values)
            else:
                row[key] = values[0]
        if row["status"] == "ok" and row["error"] is not None and not row["error"] < TOL:
            row["status"] = "FAIL (error)"
        if row["status"] != "ok":
            for name in (impl, f"{impl}_kernel"):
                self.timed.pop(name, None)
                self.after.pop(name, None)
        self.rows.append(row)
        if self.rank == 0:
            print(
                json.dumps({k: v for k, v in row.items() if k not in ("trace", "stages")}),
                flush=True,
            )
        self.save()
        return row

    def check(self, call: Callable[[], torch.Tensor], calls: int = 2) -> float:
        errs = []
        for _ in range(calls):
            with torch.no_grad():
                got = call()
            sync(self.device)
            errs.append(rel(got, self.want))
        return max(errs)

    # -- implementations ----------------------------------------------------------------------
    def mgraph(self, impl: str, tile: list[int] | None = None, glu: bool = False,
               norm_rows: int | None = None) -> dict:
        """mg.compile of a freshly built layer: its stages, first and second call, error.
        ``tile``: the linears' GEMM task tile (a sweep point beside the default; its kernel
        relaunches are timed as ``impl``, per-kind breakdown kept for ``kinds``)."""
        args = self.args
        layer = build_layer(args, self.device)
        gc.collect()
        # The norms' row tile is the tracer's rule (no plan option reaches a norm): a sweep
        # point swaps the rule for this compile only.
        rule = pointwise.traced_norm_rows
        if norm_rows is not None:
            pointwise.traced_norm_rows = lambda cols: norm_rows
        try:
            with StageTimes() as times:
                t0 = time.perf_counter()
                prog = mg.compile(
                    layer,
                    (self.x,),
                    plan=mgraph_plan({"tile": tile} if tile else None),
                    glu=glu,
                    policy=args.policy,
                    topology=f"1x{self.world}",
                    backend=args.backend,
                    backend_options={"interpret": True} if args.interpret else None,
                )
                wall = time.perf_counter() - t0
        finally:
            pointwise.traced_norm_rows = rule
        # The reference backend and the interpreter on several ranks run every rank in this
        # process: global input in, global output out.
        spmd = args.backend == "triton" and (self.world == 1 or not args.interpret)

        def call() -> torch.Tensor:
            return prog(self.x_local) if spmd else prog(self.x).chunk(self.world, 1)[self.rank]

        out = {**stage_times(times, wall), "tasks": len(prog.graph.tasks), "backend": args.backend}
        t0 = time.perf_counter()
        with torch.no_grad():
            got = call()
        sync(self.device)
        out["first_call_s"] = time.perf_counter() - t0
        errs = [rel(got, self.want)]
        t0 = time.perf_counter()
        errs.append(self.check(call, calls=1))
        out["second_call_s"] = time.perf_counter() - t0
        out["error"] = max(errs)
        if impl == "mgraph":
            self.timed[impl] = call
            self.program, self.layer = prog, layer  # alive until the end
            runtime = getattr(prog, "_runtime", None)  # Program has no public accessor for it
            if runtime is not None:
                self.timed["mgraph_kernel"] = runtime.launch
                self.after["mgraph_kernel"] = lambda: rel(
                    kernel_output(prog, self.rank).reshape(self.want.shape), self.want
                )
                out.update(runtime.kernel_info())
        elif tile is not None or glu or norm_rows is not None:  # a sweep point: its kernel
            # alone, beside the default's
            runtime = prog._runtime
            self.timed[impl] = runtime.launch
            self.after[impl] = lambda: rel(
                kernel_output(prog, self.rank).reshape(self.want.shape), self.want
            )
            self.variants[impl] = (prog, layer)
            out["tile"] = list(tile) if tile else None
            out["glu"] = glu
            out["norm_rows"] = norm_rows
            out["note"] = (
                f"megakernel relaunches alone, linears' GEMM tasks tile={tile}, "
                f"gated units fused: {glu}, norms' row tile: {norm_rows or 'default'}"
            )
            out.update(runtime.kernel_info())
        else:
            del prog, layer
            gc.collect()
        return out

    def eager_tp(self) -> dict:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh(self.device.type, (self.world,))
        # parallelize_module shards the module in place: a module of its own
        self.tp_layer = parallelize_module(build_layer(self.args, self.device), mesh, torch_plan())
        call = lambda: self.tp_layer(self.x_local)  # noqa: E731
        out = {"error": self.check(call)}
        self.timed["eager_tp"] = call
        return out

    def torch_compile(self) -> dict:
        backend = self.args.compile_backend
        if not hasattr(self, "tp_layer"):
            raise RuntimeError("eager_tp failed: no parallelized module to compile")
        compiled = torch.compile(self.tp_layer, backend=backend)
        t0 = time.perf_counter()
        with torch.no_grad():
            got = compiled(self.x_local)
        sync(self.device)
        out = {"compile_s": time.perf_counter() - t0, "compile_backend": backend}
        out["error"] = max(rel(got, self.want), self.check(lambda: compiled(self.x_local)))
        self.timed["torch_compile_tp"] = lambda: compiled(self.x_local)
        return out

    # -- timing -------------------------------------------------------------------------------
    def time_all(self) -> None:
        """Two rounds over every implementation that passed, pooled per implementation."""
        args = self.args
        pooled: dict[str, list[float]] = {impl: [] for impl in self.timed}
        chained: dict[str, list[float]] = {impl: [] for impl in self.timed}
        failed: dict[str, str] = {}
        for _ in range(args.rounds):
            for impl, fn in self.timed.items():
                if impl in failed:
                    continue
                try:
                    with torch.no_grad():
                        pooled[impl] += samples(fn, args.warmup, args.reps, self.device)
                        if args.back_to_back:
                            chained[impl].append(back_to_back(fn, args.back_to_back, self.device))
                    mine = None
                except Exception as exc:  # noqa: BLE001 - e.g. a watchdog record read by prog()
                    mine = f"FAIL while timing: {type(exc).__name__}: {str(exc)[:300]}"
                # Only a failure every rank meets at the same call keeps the ranks in step; it
                # ends this implementation's timing on all of them.
                everyone: list = [None] * self.world
                dist.all_gather_object(everyone, mine)
                if any(everyone):
                    failed[impl] = next(m for m in everyone if m)
        for row in self.rows:
            if row["impl"] in failed:
                row["status"] = failed[row["impl"]]
            elif row["impl"] in pooled:
                row["ms"] = self.slowest(statistics.median(pooled[row["impl"]]))
                if chained[row["impl"]]:
                    row["ms_back_to_back"] = round(
                        self.slowest(statistics.median(chained[row["impl"]])), 4
                    )
        if "mgraph_kernel" in pooled:
            parent = next(r for r in self.rows if r["impl"] == "mgraph")

            def kernel_row() -> dict:
                if "mgraph_kernel" in failed:
                    raise RuntimeError(failed["mgraph_kernel"])
                self.program._runtime.check()  # the kernel's watchdog record, if any
                return {
                    "error": self.after["mgraph_kernel"](),
                    "tasks": parent.get("tasks"),
                    "ms": statistics.median(pooled["mgraph_kernel"]),
                    **(
                        {"ms_back_to_back": round(statistics.median(chained["mgraph_kernel"]), 4)}
                        if chained["mgraph_kernel"]
                        else {}
                    ),
                    "note": "megakernel relaunches alone (inputs loaded once)",
                }

            self.step("mgraph_kernel", kernel_row)
        for impl, (prog, _) in self.variants.items():
            if impl in pooled and impl not in failed:
                row = next(r for r in self.rows if r["impl"] == impl)
                prog._runtime.check()
                row["error_after"] = self.after[impl]()
                if not row["error_after"] < TOL:
                    row["status"] = "FAIL (error after timing)"
        eager = next((r["ms"] for r in self.rows if r["impl"] == "eager_tp" and r["ms"]), None)
        for row in self.rows:
            if eager and row["ms"]:
                row["vs_eager_tp"] = round(eager / row["ms"], 3)
            if row["ms"] is not None:
                row["ms"] = round(row["ms"], 4)
        self.save()

    def timeline(self, calls: int) -> None:
        """Where each implementation's back-to-back time goes on the GPU (gpu_timing.timeline_row
        per impl), in two passes over the impls: a duration that follows the order (clocks,
        heat) rather than the impl shows as a difference between the passes."""
        rows = []
        for round_, (impl, fn) in [(r, kv) for r in range(2) for kv in self.timed.items()]:
            found = timeline_row(fn, calls, self.device)
            if found is None:
                continue
            row = {"impl": impl, "round": round_, **found}
            rows.append(row)
            if self.rank == 0:
                print("timeline:", json.dumps(row), flush=True)
        if self.rank == 0 and rows:
            out = Path(self.args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "bench_layer_timeline.json").write_text(json.dumps(rows, indent=1) + "\n")

    def profile_call(self) -> None:
        """Where a Program call's time goes beyond its kernel's (the ``mgraph`` row against
        ``mgraph_kernel``): the host's Python by function, then CPU and CUDA time per op."""
        import cProfile
        import io
        import pstats

        call = self.timed["mgraph"]
        profile = cProfile.Profile()
        with torch.no_grad():
            call()
            sync(self.device)
            profile.enable()
            for _ in range(3):
                call()
                sync(self.device)
            profile.disable()
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            with torch.profiler.profile(activities=activities) as prof:
                for _ in range(3):
                    call()
                    sync(self.device)
        if self.rank == 0:
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(30)
            print("profile_call: cProfile of 3 Program calls\n" + text.getvalue(), flush=True)
            key = "cuda_time_total" if self.device.type == "cuda" else "cpu_time_total"
            print(
                "profile_call: torch.profiler, 3 Program calls\n"
                + prof.key_averages().table(sort_by=key, row_limit=20),
                flush=True,
            )

    def kinds(self) -> None:
        """Where the megakernel's time goes, per task kind (one traced launch, this rank), for
        the default Program and each sweep point (``bench_layer_kinds_<impl>.json``)."""
        from kind_breakdown import kind_breakdown

        programs = {"": self.program}
        programs.update({f"_{impl}": prog for impl, (prog, _) in self.variants.items()})
        for suffix, prog in programs.items():
            try:
                rows = kind_breakdown(prog._runtime)
            except Exception as exc:  # noqa: BLE001 - the timed rows are saved already
                rows = [{"error": repr(exc)[:400]}]
            if self.rank == 0:
                out = Path(self.args.out)
                out.mkdir(parents=True, exist_ok=True)
                (out / f"bench_layer_kinds{suffix}.json").write_text(json.dumps(rows, indent=1))
                for r in rows:
                    print(f"kinds{suffix}", json.dumps(r), flush=True)

    def slowest(self, ms: float) -> float:
        t = torch.tensor([ms], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def save(self) -> None:
        if self.rank != 0:
            return
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {
            k: getattr(self.args, k) for k in ("hidden", "heads", "kv_heads", "ffn", "seq", "batch")
        }
        rows = [
            {**meta, "dtype": str(self.args.dtype).removeprefix("torch."), "world": self.world, **r}
            for r in self.rows
        ]
        (out / "bench_layer.json").write_text(json.dumps(rows, indent=1))
        (out / "bench_layer.md").write_text(table(rows))


def kernel_output(prog: mg.Program, rank: int) -> torch.Tensor:
    """This rank's output buffer of the Program's megakernel as it stands (after the timed
    launches), viewed as the rank's output chunk."""
    from mgraph.runtime.megakernel.runtime import assemble_local

    name = prog.opgraph.output_names[0]
    buf = next(
        b
        for b in prog.graph.buffers.values()
        if b.rank == rank
        and b.role == "output"
        and b.binding is not None
        and b.binding.tensor == name
    )
    return assemble_local(prog.graph, rank, name, prog._runtime.views[buf.id])


def table(rows: list[dict]) -> str:
    if not rows:
        return ""
    r0 = rows[0]
    lines = [
        f"Llama layer: hidden {r0['hidden']}, {r0['heads']} heads, {r0['kv_heads']} KV heads, "
        f"FFN {r0['ffn']}, seq {r0['seq']}, batch {r0['batch']}, {r0['dtype']}, "
        f"TP+SP on {r0['world']} ranks",
        "",
        "| impl | ms | vs eager TP | error | status | compile |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = f"{r['ms']:.3f}" if r["ms"] is not None else "-"
        if r.get("ms_back_to_back") is not None:
            ms += f" (back to back {r['ms_back_to_back']:.3f})"
        ratio = f"{r['vs_eager_tp']:.2f}x" if r["vs_eager_tp"] is not None else "-"
        err = f"{r['error']:.2e}" if r["error"] is not None else "-"
        comp = ""
        if "trace_s" in r:
            comp = (
                f"trace {r['trace_s']:.1f} s + lower {r['lower_s']:.1f} s + schedule "
                f"{r['schedule_s']:.1f} s (mg.compile {r['compile_s']:.1f} s); first call "
                f"{r['first_call_s']:.1f} s, second {r['second_call_s']:.2f} s"
            )
        elif "compile_s" in r:
            comp = f"first call {r['compile_s']:.1f} s ({r.get('compile_backend')})"
        lines.append(f"| {r['impl']} | {ms} | {ratio} | {err} | {r['status'][:80]} | {comp} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--ffn", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float16", "float32"],
        help="default bfloat16; float32 with --interpret (the interpreter's bf16 tl.dot is wrong)",
    )
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--no-warm", dest="warm", action="store_false", help="skip the second (warm) mg.compile"
    )
    p.add_argument("--no-torch-compile", dest="torch_compile", action="store_false")
    p.add_argument(
        "--kinds",
        action="store_true",
        help="after timing, one traced launch of mgraph's kernel: time per task kind "
        "(bench_layer_kinds.json; benchmarks/kind_breakdown.py)",
    )
    p.add_argument(
        "--profile-call",
        action="store_true",
        help="after timing, where a Program call's time goes: cProfile of its host work and "
        "torch.profiler's CPU and CUDA time per op over 3 calls (printed by rank 0)",
    )
    p.add_argument(
        "--compile-backend", help="torch.compile backend (default inductor; aot_eager with --smoke)"
    )
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny sizes")
    p.add_argument(
        "--interpret",
        action="store_true",
        help="with --smoke: mgraph on backend='triton' in Triton's interpreter (TRITON_INTERPRET=1 "
        "set; on several ranks every process runs all ranks with the global input)",
    )
    p.add_argument(
        "--glu-row",
        action="store_true",
        help="also time the megakernel of mg.compile(..., glu=True): SwiGLU as one GEMM op "
        "(matmul_glu) instead of two GEMMs and a pointwise pass (the default)",
    )
    p.add_argument(
        "--gemm-tiles",
        nargs="*",
        default=[],
        type=lambda v: [int(x) for x in v.split(",")],
        help="sweep points beside the default: the linears' GEMM task tile, e.g. 128,512 "
        "(each its own Program; its megakernel timed alone in the same rounds)",
    )
    p.add_argument(
        "--back-to-back",
        type=int,
        default=0,
        metavar="N",
        help="also time N calls issued back to back between one pair of events, per round "
        "(ms_back_to_back: host work hidden behind the GPU), beside the idle-start samples",
    )
    p.add_argument(
        "--norm-rows",
        type=int,
        nargs="*",
        default=[],
        metavar="ROWS",
        help="sweep points: the layer with its norms in tasks of ROWS rows (the default is "
        "ops/tilewise.traced_norm_rows), each kernel timed alone beside the default's",
    )
    p.add_argument(
        "--timeline",
        type=int,
        default=0,
        metavar="N",
        help="after timing, N back-to-back calls of every impl under torch.profiler: GPU span, "
        "busy time and longest activities per call beside CUDA events (bench_layer_timeline.json)",
    )
    p.add_argument(
        "--policy",
        default="critical_path",
        help="the scheduler's queue order policy (mg.compile's; the default's)",
    )
    p.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = p.parse_args(argv)
    sizes = (
        SMOKE
        if args.smoke
        else dict(hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=4096, batch=1)
    )
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("hidden", "heads", "kv_heads", "ffn", "seq", "batch", "reps", "rounds"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be at least 0")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error("--hidden must divide by --heads, and --heads by --kv-heads")
    args.compile_backend = args.compile_backend or ("aot_eager" if args.smoke else "inductor")
    if args.interpret and not args.smoke:
        p.error("--interpret runs on the CPU: add --smoke")
    args.backend = "reference" if args.smoke and not args.interpret else "triton"
    args.dtype = getattr(torch, args.dtype or ("float32" if args.interpret else "bfloat16"))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        torch.set_num_threads(1)  # two processes on a small CPU
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        # Read when CUDA and NCCL start (below), so set here: importing this file changes nothing.
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # GPU.md: lazy loading can hang
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # GPU.md: no NVLink multicast there
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        # The first call JIT-builds the megakernel on each rank: one rank may start it seconds
        # before its peer and wait at the entry barrier longer than the 5 s default bound.
        os.environ.setdefault("MGRAPH_WATCHDOG_S", "60")
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    start = time.time()
    try:
        bench = Bench(args, device)
        # mgraph first: its cold compile and kernel build run before torch.compile warms Triton
        bench.step("mgraph", lambda: bench.mgraph("mgraph"))
        if args.glu_row:  # the gated unit as one GEMM op (mg.compile glu=True), beside it
            bench.step("mgraph_kernel_glu", lambda: bench.mgraph("mgraph_kernel_glu", glu=True))
        for tile in args.gemm_tiles:  # sweep points beside the default, timed in its rounds
            impl = f"mgraph_kernel_tile{tile[0]}x{tile[1]}"
            bench.step(impl, lambda tile=tile, impl=impl: bench.mgraph(impl, tile))
        for rows in args.norm_rows:  # the norms' row tile, beside the default's
            impl = f"mgraph_kernel_norm{rows}"
            bench.step(impl, lambda rows=rows, impl=impl: bench.mgraph(impl, norm_rows=rows))
        bench.step("eager_tp", bench.eager_tp)
        if args.torch_compile:
            import torch._dynamo as dynamo

            if dynamo.is_dynamo_supported():
                bench.step("torch_compile_tp", bench.torch_compile)
            else:  # e.g. a Python that this torch's dynamo does not support
                bench.rows.append(
                    {
                        "impl": "torch_compile_tp",
                        "ms": None,
                        "vs_eager_tp": None,
                        "error": None,
                        "status": "skipped: torch.compile unavailable",
                    }
                )
        bench.time_all()
        if args.kinds and bench.program is not None and bench.program._runtime is not None:
            bench.kinds()
        if args.timeline and bench.timed:
            bench.timeline(args.timeline)
        if args.profile_call and "mgraph" in bench.timed:
            bench.profile_call()
        if args.warm:
            bench.step("mgraph_warm", lambda: bench.mgraph("mgraph_warm"))
        bench.save()
    finally:
        dist.barrier()
        dist.destroy_process_group()
    if bench.rank == 0:
        print(Path(args.out, "bench_layer.md").read_text(), flush=True)
        print(f"total {time.time() - start:.0f} s", flush=True)
    failed = [r["impl"] for r in bench.rows if r["status"].startswith("FAIL")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
