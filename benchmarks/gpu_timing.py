"""Timing helpers the one-GPU benchmarks share (bench_layer.py, bench_gemm_tasks.py): CUDA events
around a window of calls, and where those calls' GPU time goes from torch.profiler's trace."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def window(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    """ms per call of ``calls`` calls issued back to back after a synchronize, between one pair
    of CUDA events (the wall clock on the CPU). One call: a call started on an idle device;
    several: each call's host work overlaps the GPU work of the calls before it, as in a
    training step."""
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) * 1e3 / calls


def timeline_row(fn: Callable[[], object], calls: int, device: torch.device) -> dict | None:
    """``calls`` back-to-back calls of ``fn`` (on a GPU, after one untimed) under torch.profiler:
    from its trace the span (first GPU activity's start to the last's end), the busy time (union
    of kernels, copies and memsets), the longest activities, GPU time per activity name, and
    every run of the longest activity's name in time order; CUDA events around the same calls
    beside them, so a gap the profiler does not see (events >> span) shows too. None on the CPU
    or when the trace has no GPU activity."""
    if device.type != "cuda":
        return None
    with torch.no_grad():
        fn()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            events_ms = window(fn, calls, device)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    gpu = sorted(
        (e["ts"], e["ts"] + e["dur"], e.get("name", ""))
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    if not gpu:
        return None
    busy, cur_s, cur_e = 0.0, gpu[0][0], gpu[0][1]
    for s0, e0, _ in gpu[1:]:
        if s0 > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s0, e0
        else:
            cur_e = max(cur_e, e0)
    busy += cur_e - cur_s
    longest = sorted((e0 - s0 for s0, e0, _ in gpu), reverse=True)[:calls]
    longest_name = max(gpu, key=lambda g: g[1] - g[0])[2]
    by_name: dict[str, float] = {}
    for s0, e0, name in gpu:
        by_name[name] = by_name.get(name, 0.0) + (e0 - s0)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {
        "calls": calls,
        "events_ms_per_call": round(events_ms, 4),
        "span_ms_per_call": round((gpu[-1][1] - gpu[0][0]) / 1e3 / calls, 4),
        "busy_ms_per_call": round(busy / 1e3 / calls, 4),
        "gpu_activities_per_call": round(len(gpu) / calls, 1),
        "longest_ms": [round(x / 1e3, 4) for x in longest],
        # per GPU activity name, ms per call: where a baseline's time goes
        "top_ms_per_call": {n[:90]: round(v / 1e3 / calls, 4) for n, v in top},
        # the longest activity's name, every run of it in time order: a kernel whose duration
        # drifts over back-to-back calls (clocks) against one that varies
        "longest_name_in_order_ms": [
            round((e0 - s0) / 1e3, 4) for s0, e0, n in gpu if n == longest_name
        ],
    }
