"""What the megakernel runtime accepts (backend="triton"), checked on the graph before anything
is allocated or launched, and the per-buffer dtype codes the kernel reads (``bufdt``)."""

from __future__ import annotations

from mgraph.errors import DTypeError, ScheduleError, SlowPathWarning
from mgraph.graph import TaskGraph
from mgraph.kinds import KINDS, TaskKind

from .dispatch import body_params, has_body
from .encode import GEMM_KINDS, gemm_block, gemm_by_pointers, tma_exact, tma_rows

__all__ = ["supported_kinds", "check_graph", "buffer_dtype_code", "DT_DATA", "DT_F32"]


def supported_kinds() -> set[str]:
    """The kinds with a Triton body (the megakernel's dispatch is generated from them)."""
    return {k for k in KINDS if has_body(k)}


# Per-buffer dtypes: a buffer holds the graph's data dtype (DT in the kernel) or float32 (a
# kernel's partials: attention's running max/sum, MoE routing weights). Code per slot in ``bufdt``.
DT_DATA, DT_F32 = 0, 1


def buffer_dtype_code(graph: TaskGraph, dtype: str) -> int:
    return DT_DATA if dtype == graph.dtype else DT_F32


def _check_dtypes(graph: TaskGraph) -> None:
    """Buffers are the graph's dtype or float32; a float32 buffer is touched only by kinds whose
    Triton body takes ``bufdt`` (the others cast every address to DT), never by the GEMM path."""
    for b in graph.buffers.values():
        if b.dtype not in (graph.dtype, "float32"):
            raise DTypeError(
                f"{graph.op}: buffer {b.id} is {b.dtype}; backend='triton' holds buffers of the "
                f"graph's dtype ({graph.dtype}) or float32",
                hint="store partials as float32 and data in the graph's dtype",
            )
    if all(b.dtype == graph.dtype for b in graph.buffers.values()):
        return
    for t in graph.tasks:
        if t.role == "rdma":
            continue  # the proxy moves bytes
        if t.kind == TaskKind.COPY.value:
            kinds = {graph.buffers[r.buffer].dtype for r in (*t.reads, *t.writes)}
            if len(kinds) > 1:
                raise DTypeError(
                    f"{graph.op}: copy task {t.id} ({t.name}) moves between dtypes {sorted(kinds)}",
                    hint="a copy keeps its dtype: convert in a compute task",
                )
            continue
        for r in (*t.reads, *t.writes):
            if graph.buffers[r.buffer].dtype == graph.dtype:
                continue
            if t.kind == TaskKind.GEMM.value or not (
                KINDS[t.kind].own_dtypes or "bufdt" in body_params(t.kind)
            ):
                raise DTypeError(
                    f"{graph.op}: task {t.id} ({t.kind}) touches float32 buffer {r.buffer} but its "
                    f"Triton body reads every buffer as {graph.dtype}",
                    hint="give the body a `bufdt` parameter and cast float32 slots accordingly",
                )


def _check_gemm_tiles(graph: TaskGraph, gemms, bk: int) -> None:
    """Short edge tiles: the GEMM prefix runs only tiles whole-block TMA computes exactly
    (encode.tma_exact); the dynamic body masks the others. A tile that ADDS into its outputs
    (``accumulate``) on the TMA path goes through a TMA reduce-add, so it must be exact (the
    pointer path, encode.gemm_by_pointers, masks its adds: any tile is exact there)."""
    block = gemm_block(gemms)
    for t in gemms:
        if (t.params.get("accumulate") and not gemm_by_pointers(graph, t)
                and not tma_exact(graph, t, block, bk)):
            raise ScheduleError(
                f"{graph.op}: gemm task {t.name!r} reduce-adds a short {t.writes[0].shape} tile "
                f"that does not end its buffers (block {block[0]}x{block[1]})",
                hint="tile the op so that only the last tile row/column is short, or use "
                "gemm_allreduce algorithm='oneshot'",
            )


def check_graph(graph: TaskGraph, bk: int) -> None:
    """What backend='triton' refuses before anything is allocated or launched: kinds without a
    Triton body, buffer dtypes, and GEMM edge tiles that a TMA reduce-add cannot clip (``bk``:
    the kernel's K block)."""
    unsupported = {t.kind for t in graph.tasks if t.role != "rdma"} - supported_kinds()
    if unsupported:
        raise ScheduleError(
            f"{graph.op}: backend='triton' has no tile bodies for {sorted(unsupported)} yet",
            hint="run this op on backend='reference'",
        )
    _check_dtypes(graph)
    # Rows TMA cannot address (not whole 16-byte units) are not refused: the GEMM body runs
    # those tasks by masked pointers (encode.gemm_by_pointers), as the other bodies do.
    gemms = [t for t in graph.tasks if t.kind == TaskKind.GEMM.value]
    if gemms:
        _check_gemm_tiles(graph, gemms, bk)


def warn_pointer_gemms(graph: TaskGraph, ranks: set[int]) -> None:
    """A SlowPathWarning naming the GEMM tasks of ``ranks`` that run by masked pointers (rows
    TMA cannot address): correct, but many times slower than the TMA path, and fixable by
    the user (pad the width), so said once per runtime rather than found in a profile."""
    import warnings

    slow = [t for t in graph.tasks
            if t.kind in GEMM_KINDS and t.rank in ranks and gemm_by_pointers(graph, t)]
    if not slow:
        return
    narrow = sorted({  # what sends a task there (encode.gemm_by_pointers): A, B, added-into
        f"{b} ({graph.buffers[b].cols} columns)" for t in slow
        for b in (r.buffer for r in (*t.reads[:2], *(t.writes if t.params.get("accumulate")
                                                     else ())))
        if not tma_rows(graph, b)})
    warnings.warn(SlowPathWarning(
        f"mgraph: {graph.op}: {len(slow)} GEMM task(s) (e.g. {slow[0].name!r}) run by masked "
        f"pointers, several times slower a task than TMA: rows of {', '.join(narrow[:4])} are not whole "
        "16-byte units; pad those widths to a multiple of 8 (bf16/fp16) or 4 (fp32) to run them "
        "on TMA"), stacklevel=3)
