"""Where a megakernel launch spends its time, per task kind: one traced launch (in-kernel
%globaltimer stamps per task) of a runtime's schedule on the inputs that runtime holds.

    from kind_breakdown import kind_breakdown
    rows = kind_breakdown(runtime)   # a TritonRuntime that has run once (its inputs loaded)

Each row: kind, role, tasks, busy_ms (the tasks' summed durations, from ticket to signal),
work_ms and wait_ms (busy time split at the moment the task's waits were met: the body's
time, and the time spent waiting for its inputs), means per task, tflops_per_program (the
kind's Task.flops over its body time: what one SM's worker reached; times the programs that
ran the kind at once for the kernel's rate), and the traced launch's makespan. A separate runtime
is traced so the timed one keeps its CUDA graph; it costs one more kernel build only when the
trace flag changes the compiled kernel (it does: TRACE is a constexpr).
"""

from __future__ import annotations

from collections import defaultdict


def kind_breakdown(runtime) -> list[dict]:
    from mgraph.runtime.megakernel import TritonRuntime

    traced = TritonRuntime(
        runtime.schedule,
        rank=runtime.rank,
        settings=runtime.settings,
        trace=True,
        gemm_config=runtime.gemm_config,
        interpret=runtime.interpret,
        interpret_roles=runtime.interpret and not runtime.single_program,
    )
    for buf_id, view in runtime.views.items():
        if runtime.graph.buffers[buf_id].role == "input":
            traced.views[buf_id].copy_(view)
    try:
        traced.launch()
        if not runtime.interpret:
            import torch

            torch.cuda.synchronize()
        traced.check()
        trace = traced.trace()
    finally:
        traced.close()
    return kind_rows(trace, runtime.graph.tasks)


def row_label(kind: str, task) -> str:
    """The row a task counts in: its kind; an ewise task's also names its tile and its reads
    (a layer's RoPE, SwiGLU and residual chains differ in both), so each chain gets a row; a
    gemm task's names its tile and K range (a layer's projections differ in them)."""
    if kind not in ("ewise", "gemm") or not getattr(task, "writes", None):
        return kind
    rows, cols = task.writes[0].shape
    if kind == "gemm":
        return f"gemm {rows}x{cols} k{task.reads[0].shape[1]}"
    return f"ewise {rows}x{cols} {len(task.reads)} reads"


def kind_rows(trace, tasks) -> list[dict]:
    """The rows of one trace (records with start, ready and end), tasks indexed by record.task."""
    busy: dict[tuple[str, str], float] = defaultdict(float)
    work: dict[tuple[str, str], float] = defaultdict(float)
    count: dict[tuple[str, str], int] = defaultdict(int)
    flops: dict[tuple[str, str], float] = defaultdict(float)
    programs: dict[tuple[str, str], set] = defaultdict(set)
    for r in trace.records:
        key = (row_label(r.kind, tasks[r.task]), r.role)
        busy[key] += r.end - r.start
        work[key] += r.end - (r.start if r.ready is None else r.ready)
        count[key] += 1
        flops[key] += float(tasks[r.task].flops or 0.0)
        programs[key].add(r.worker)
    span = trace.makespan
    rows = []
    for key in sorted(busy, key=lambda k: -busy[k]):
        kind, role = key
        b = busy[key]
        rows.append(
            {
                "kind": kind,
                "role": role,
                "tasks": count[key],
                "programs": len(programs[key]),
                "busy_ms": round(b * 1e3, 3),
                # the bodies alone: busy time less the waits for the task's inputs
                "work_ms": round(work[key] * 1e3, 3),
                "wait_ms": round((b - work[key]) * 1e3, 3),
                "mean_us": round(b / count[key] * 1e6, 2),
                "mean_work_us": round(work[key] / count[key] * 1e6, 2),
                # per program-second of body time: times the programs running it at once for
                # the kernel's rate
                "tflops_per_program": round(flops[key] / work[key] / 1e12, 3)
                if work[key] and flops[key]
                else None,
                "makespan_ms": round(span * 1e3, 3),
            }
        )
    return rows
