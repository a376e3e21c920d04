"""The memory-bound tile bodies of a Llama layer, each alone in the megakernel on one GPU: bytes
a second per program (the body's time per task, from one traced launch) and for the launch.

    python3 benchmarks/bench_bodies.py [--seq 4096] [--reps 10] [--bodies swiglu rope ...] [--out DIR]

Each body is traced from the layer's own code at its shapes (hidden 4096, 32 heads of 128,
FFN 14336, bf16, batch 1, ``--seq`` tokens), so its tasks are the layer's (the traced tile
rows, operand forms and ewise chains of mg.compile), on one GPU (topology 1x1):

- ``swiglu``: ``silu(g) * u`` over [seq, 14336] (the layer's 16 x 14336 tasks);
- ``residual``: ``x + y`` over [seq, 4096] (16 x 4096);
- ``rope``: ``q * cos + rotate_half(q) * sin`` with q the head split of a [seq, 4096]
  projection output (read through the split's gather map) and cos/sin [seq, 128] broadcast
  over the heads (512 x 128 tasks);
- ``rms_norm``: ``nn.RMSNorm(4096)`` over [2 x seq, 4096] (the layer's two norms' rows).

Per body: its output checked against eager torch on the GPU (relative error; the same module
in eager torch is also timed, ``eager_ms``: its kernels, e.g. SwiGLU's silu and mul), then the
megakernel (built with its per-task timer on: TRACE) relaunched ``--reps`` times (CUDA events;
the launch includes the kernel's queue set-up, so it is a floor on the rate, not the bodies'
own) and one more traced launch
(kind_breakdown: ``mean_work_us``, the body's time per task without waits). Bytes per task:
every region the task reads and writes, once (rms_norm's x too, which its fast path reads
once). ``gbs_per_program`` is a task's bytes over its body time: what one SM streams (an
H200's HBM gives ~31-33 GB/s to each of 132 SMs streaming at once). JSON rows go to
``DIR/bench_bodies.json`` (DIR: ``--out``, else $OUT, else /tmp/mgraph_out); one line per
body is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mgraph as mg  # noqa: E402

HIDDEN, HEADS, HEAD_DIM, FFN = 4096, 32, 128, 14336
BF16 = torch.bfloat16


class SwiGLU(nn.Module):
    def forward(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return F.silu(g) * u


class Residual(nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + y


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Rope(nn.Module):
    """bench_layer's RoPE on q: the projection output split into heads, cos/sin [S, D]."""

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        q = x.view(B, S, -1, HEAD_DIM).transpose(1, 2)
        return q * cos + rotate_half(q) * sin


def cases(seq: int) -> dict:
    """name -> (module, its inputs on the CPU: random, never zeros)."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(BF16)

    angles = torch.rand(seq, HEAD_DIM, generator=gen) * 6.3
    norm = nn.RMSNorm(HIDDEN, eps=1e-5)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=gen)
    return {
        "swiglu": (SwiGLU(), (rand(1, seq, FFN), rand(1, seq, FFN))),
        "residual": (Residual(), (rand(1, seq, HIDDEN), rand(1, seq, HIDDEN))),
        "rope": (Rope(), (rand(1, seq, HIDDEN), angles.cos().to(BF16), angles.sin().to(BF16))),
        "rms_norm": (norm.to(BF16), (rand(1, 2 * seq, HIDDEN),)),
    }


def task_bytes(graph, task) -> int:
    """Bytes a task reads and writes: each region once."""
    item = torch.empty((), dtype=BF16).element_size()
    return item * sum(r.shape[0] * r.shape[1] for r in (*task.reads, *task.writes))


def event_ms(fn, warmup: int, reps: int, cuda: bool) -> list[float]:
    """Times (ms) of ``reps`` calls after ``warmup``: CUDA events, or the wall clock."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if not cuda:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def bench(name: str, module: nn.Module, inputs: tuple, args) -> dict:
    from kind_breakdown import kind_breakdown

    dev = torch.device("cpu" if args.interpret else "cuda")
    module = module.to(dev)
    xs = tuple(x.to(dev) for x in inputs)
    t0 = time.perf_counter()
    prog = mg.compile(
        module,
        xs,
        topology="1x1",
        backend="triton",
        backend_options={"interpret": True} if args.interpret else None,
    )
    row: dict = {"body": name, "compile_s": round(time.perf_counter() - t0, 2)}
    with torch.no_grad():
        want = module(*xs)
        # the runtime built traced (its first run), so that kind_breakdown's traced runtime
        # is the same kernel (Triton's cache) and each body compiles once
        prog.run(*xs, trace=True)
        got = prog(*xs)
    if not args.interpret:
        torch.cuda.synchronize()
    row["rel_err"] = round(((got.float() - want.float()).norm() / want.float().norm()).item(), 5)
    graph = prog.graph
    kinds = {t.kind for t in graph.tasks}
    body = [t for t in graph.tasks if t.kind in ("ewise", "rms_norm")]
    nbytes = [task_bytes(graph, t) for t in body]
    row.update(
        kinds=sorted(kinds),
        tasks=len(body),
        task_shape=list(body[0].writes[0].shape),
        bytes_per_task=max(nbytes),
    )
    rt = prog._runtime
    ms = statistics.median(event_ms(rt.launch, args.warmup, args.reps, not args.interpret))
    rt.check()
    row["launch_ms"] = round(ms, 4)
    row["launch_tbs"] = round(sum(nbytes) / ms / 1e9, 3)
    with torch.no_grad():  # the baseline: the same module in eager torch, on the same inputs
        eager = statistics.median(
            event_ms(lambda: module(*xs), args.warmup, args.reps, not args.interpret)
        )
    row["eager_ms"] = round(eager, 4)
    row["vs_eager"] = round(eager / ms, 3)
    for r in kind_breakdown(rt):
        if r.get("kind", "").split(" ")[0] in ("ewise", "rms_norm"):
            row["mean_work_us"] = r["mean_work_us"]
            row["programs"] = r["programs"]
            row["gbs_per_program"] = round(
                sum(nbytes) / len(nbytes) / (r["mean_work_us"] * 1e-6) / 1e9, 2
            )
            break
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--bodies", nargs="+", default=["swiglu", "residual", "rope", "rms_norm"])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/mgraph_out"))
    ap.add_argument(
        "--interpret",
        action="store_true",
        help="on the CPU under TRITON_INTERPRET=1 (set it before running): a smoke run, "
        "wall-clock times that mean nothing",
    )
    args = ap.parse_args(argv)
    all_cases = cases(args.seq)
    unknown = set(args.bodies) - set(all_cases)
    if unknown:
        ap.error(f"unknown bodies {sorted(unknown)}; choose from {sorted(all_cases)}")
    rows = []
    for name in args.bodies:
        try:
            row = bench(name, *all_cases[name], args)
        except Exception as exc:  # noqa: BLE001 - the row says why; the other bodies still run
            row = {"body": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rows.append({"seq": args.seq, **row})
        print("body", json.dumps(rows[-1]), flush=True)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_bodies.json").write_text(json.dumps(rows, indent=1))
    for r in rows:
        if "error" in r:
            print(f"{r['body']:>9}: ERROR {r['error']}")
        else:
            print(
                f"{r['body']:>9}: {r['tasks']} tasks of {r['task_shape']}, "
                f"{r.get('mean_work_us')} us a task = {r.get('gbs_per_program')} GB/s a program"
                f" ({r.get('programs')} programs); launch {r['launch_ms']} ms = "
                f"{r['launch_tbs']} TB/s, eager torch {r['eager_ms']} ms ({r['vs_eager']}x); "
                f"rel_err {r['rel_err']}"
            )


if __name__ == "__main__":
    main()
