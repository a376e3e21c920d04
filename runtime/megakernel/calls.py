"""What a run copies in and out of the megakernel's buffers: each rank's shard of a global input
(``local_shards``), a rank's local output assembled from its buffers (``assemble_local``), the
arena's per-buffer views, and the per-runtime ``_CallPlan`` (what every run reads of the graph,
worked out once). Split from runtime.py, which launches and checks the kernel."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mgraph.errors import InputError
from mgraph.graph import Buffer, TaskGraph, torch_dtype

__all__ = ["arena_views", "buffer_shard", "BufferShards", "local_shards", "assemble_local"]


def arena_views(graph: TaskGraph, lay, rank: int, arena: torch.Tensor) -> dict[str, torch.Tensor]:
    """``rank``'s buffers (by id) as 2-D views of its arena (its own, or a peer's mapped one)."""
    views = {}
    for buf in graph.buffers.values():
        if buf.rank == rank:
            dt = torch_dtype(buf.dtype)
            start = lay.offset[buf.id]
            nbytes = buf.rows * buf.cols * torch.empty((), dtype=dt).element_size()
            views[buf.id] = arena[start : start + nbytes].view(dt).view(buf.rows, buf.cols)
    return views


def buffer_shard(buf, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The part of a GLOBAL input that input buffer ``buf`` holds."""
    b = buf.binding
    parts = [inputs[b.tensor][tuple(slice(lo, hi) for lo, hi in p)] for p in b.pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=b.cat_dim)


class BufferShards(dict):
    """One input's local shards on a rank that holds it in several buffers with different parts
    (a folded RoPE table read whole by one op and by rows by another): buffer id -> the part
    that buffer holds. ``local_shards(..., per_buffer=True)`` gives one for such an input, and
    ``TritonRuntime.load_inputs`` copies each buffer from its own entry."""


def local_shards(
    graph: TaskGraph, rank: int, inputs: dict[str, torch.Tensor], *, per_buffer: bool = False
) -> dict:
    """The rank's local input tensors (what an SPMD caller passes) cut from GLOBAL inputs; a
    name missing from ``inputs`` is missing from the result too. A rank with two buffers of one
    input with different parts (a chunk and the whole, say) cannot be fed one tensor per name:
    a named error, or with ``per_buffer`` (what a Program passes: it holds the global tensors)
    a ``BufferShards`` of that input's parts."""
    bufs_of: dict[str, list[Buffer]] = {}
    for buf in graph.buffers.values():
        if buf.rank == rank and buf.role == "input" and buf.binding is not None:
            bufs_of.setdefault(buf.binding.tensor, []).append(buf)
    out: dict = {}
    for name, bufs in bufs_of.items():
        first = bufs[0].binding
        apart = any(b.binding.pieces != first.pieces or b.binding.cat_dim != first.cat_dim
                    for b in bufs[1:])  # fmt: skip
        if apart and not per_buffer:
            raise InputError(
                f"{graph.op}: rank {rank} holds input {name!r} in two buffers with different "
                "parts; one local tensor per name cannot feed both",
                hint="run it from one process with global inputs (mg.run, a Program), "
                "which fills each buffer from the global tensor",
            )
        if name not in inputs:  # one left out stays out (a resident input, see load_inputs)
            continue
        if apart:
            out[name] = BufferShards({b.id: buffer_shard(b, inputs) for b in bufs})
        else:
            out[name] = buffer_shard(bufs[0], inputs)
    return out


def assemble_local(graph: TaskGraph, rank: int, name: str, data: torch.Tensor) -> torch.Tensor:
    """A rank's 2-D output buffer viewed as its local shard of the global output."""
    buf = next(
        b for b in graph.buffers.values()
        if b.rank == rank and b.role == "output" and b.binding and b.binding.tensor == name
    )
    shape = [hi - lo for lo, hi in buf.binding.pieces[0]]
    shape[buf.binding.cat_dim] = sum(
        p[buf.binding.cat_dim][1] - p[buf.binding.cat_dim][0] for p in buf.binding.pieces
    )
    return data.reshape(shape)


@dataclass
class _CallPlan:
    """What every run reads of the graph, worked out once per runtime.

    ``inputs``: each input's buffers on the ranks this runtime runs; ``targets``: the same with
    each buffer's view. ``volatile``: inputs with a buffer that a task writes or that is zeroed
    before each launch; they are never resident (reloaded at every run). ``loaded``: inputs
    whose buffers hold what the last load copied. ``placeholders``: meta tensors of the inputs'
    global shapes and dtypes (a resident input's stand-in for check_inputs); ``specs``: the
    same as (shape, dtype) pairs, for ``accepts``. ``whole``: output name -> the id of the one
    buffer that holds the whole output in one piece and in its dtype, or None when some output
    has no such buffer; ``whole_views``: those buffers viewed in the outputs' global shapes.
    ``written_checked``: check_outputs_written has passed for the graph. ``local_outputs``
    (one rank of an SPMD graph, at its first run): output name -> its buffer viewed as the
    rank's local shard.
    """

    inputs: dict[str, list[Buffer]]
    targets: dict[str, list[tuple[Buffer, torch.Tensor]]]
    volatile: set[str]
    placeholders: dict[str, torch.Tensor]
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]]
    whole: dict[str, str] | None
    whole_views: dict[str, torch.Tensor]
    loaded: set[str] = field(default_factory=set)
    local_outputs: dict[str, torch.Tensor] | None = None
    written_checked: bool = False

    def accepts(self, inputs: dict[str, torch.Tensor], resident: list[str]) -> bool:
        """Whether ``inputs`` and the ``resident`` names (distinct, none of them in
        ``inputs``) are exactly the graph's inputs, each passed tensor of its global shape
        and dtype: check_inputs' checks without building its dict. False for anything else
        (check_inputs then names the error)."""
        specs = self.specs
        if len(inputs) + len(resident) != len(specs):
            return False
        for name in resident:
            if name not in specs:
                return False
        for name, t in inputs.items():
            spec = specs.get(name)
            if spec is None or not isinstance(t, torch.Tensor):
                return False
            if t.dtype != spec[1] or t.shape != spec[0]:
                return False
        return True

    @staticmethod
    def of(graph: TaskGraph, ranks: set[int], views: dict[str, torch.Tensor]) -> _CallPlan:
        inputs: dict[str, list[Buffer]] = {}
        for buf in graph.buffers.values():
            if buf.rank in ranks and buf.role == "input" and buf.binding is not None:
                inputs.setdefault(buf.binding.tensor, []).append(buf)
        written = {w.buffer for t in graph.tasks for w in t.writes}
        volatile = {
            name for name, bufs in inputs.items()
            if any(b.zeroed or b.id in written for b in bufs)
        }
        specs = {
            name: (tuple(spec.shape), torch_dtype(spec.dtype))
            for name, spec in graph.inputs.items()
        }
        placeholders = {
            name: torch.empty(shape, dtype=dtype, device="meta")
            for name, (shape, dtype) in specs.items()
        }
        targets = {name: [(b, views[b.id]) for b in bufs] for name, bufs in inputs.items()}
        holders: dict[str, list[Buffer]] = {}
        for buf in graph.buffers.values():
            if buf.rank in ranks and buf.role == "output" and buf.binding is not None:
                holders.setdefault(buf.binding.tensor, []).append(buf)
        whole: dict[str, str] | None = {}
        for name, spec in graph.outputs.items():
            bufs = holders.get(name, [])
            everything = tuple((0, n) for n in spec.shape)
            if (
                len(bufs) != 1
                or bufs[0].dtype != spec.dtype
                or [tuple(map(tuple, p)) for p in bufs[0].binding.pieces] != [everything]
            ):
                whole = None
                break
            whole[name] = bufs[0].id
        whole_views = {  # view, never reshape: a copy here would be a stale output
            name: views[bid].view(graph.outputs[name].shape)
            for name, bid in (whole or {}).items()
        }
        return _CallPlan(inputs, targets, volatile, placeholders, specs, whole, whole_views)
