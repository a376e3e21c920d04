"""Per-rank buffers of a TaskGraph: allocation, sharding global inputs, gathering outputs.

Every backend goes through these three functions, so a graph's Bindings mean the same thing
everywhere.

NaN is data: a user's input may hold NaN and the outputs then hold NaN where torch's would. So
"unwritten" is never read from the values. Instead the graph itself must write every element of
every output buffer (``check_outputs_written``: the union of its tasks' write regions, computed
once per graph), and a run that finishes has run every task. Scratch and output buffers are still
filled with NaN before a launch, so a lowering that READS a region nobody wrote yet gets NaN (it
shows in the comparison with the torch reference) rather than a plausible stale value.
"""

from __future__ import annotations

import weakref

import torch

from mgraph.errors import DTypeError, InputError, OutputError
from mgraph.graph import Binding, Region, TaskGraph, torch_dtype

__all__ = [
    "allocate", "shard_inputs", "gather_outputs", "region_view", "Memory",
    "check_outputs_written", "same_values", "worst_tile_error",
]

Memory = dict[str, torch.Tensor]  # buffer id -> 2-D tensor


def allocate(graph: TaskGraph, device: str | torch.device = "cpu", poison: bool = True) -> Memory:
    mem: Memory = {}
    for buf in graph.buffers.values():
        dt = torch_dtype(buf.dtype)
        if buf.zeroed:  # tasks accumulate into it (graph.Buffer)
            mem[buf.id] = torch.zeros((buf.rows, buf.cols), dtype=dt, device=device)
        elif poison and buf.role != "input":
            mem[buf.id] = torch.full((buf.rows, buf.cols), float("nan"), dtype=dt, device=device)
        else:
            mem[buf.id] = torch.empty((buf.rows, buf.cols), dtype=dt, device=device)
    return mem


def region_view(mem: Memory, region: Region) -> torch.Tensor:
    return mem[region.buffer][region.row0 : region.row1, region.col0 : region.col1]


def _pieces(binding: Binding, tensor: torch.Tensor) -> torch.Tensor:
    parts = [tensor[tuple(slice(lo, hi) for lo, hi in p)] for p in binding.pieces]
    joined = parts[0] if len(parts) == 1 else torch.cat(parts, dim=binding.cat_dim)
    return joined.reshape(-1, joined.shape[-1])


def check_inputs(graph: TaskGraph, inputs: dict[str, torch.Tensor]) -> None:
    """Names, shapes and dtypes of the GLOBAL inputs, before anything runs."""
    missing = sorted(set(graph.inputs) - set(inputs))
    extra = sorted(set(inputs) - set(graph.inputs))
    if missing or extra:
        raise InputError(
            f"{graph.op}: inputs do not match the graph (missing {missing}, unexpected {extra})",
            hint=f"pass exactly {', '.join(graph.inputs)}",
        )
    for name, spec in graph.inputs.items():
        t = inputs[name]
        if not isinstance(t, torch.Tensor):
            raise InputError(
                f"{graph.op}: input {name!r} is a {type(t).__name__}, not a tensor",
                hint=f"pass a torch.Tensor of shape {spec.shape} and dtype {spec.dtype}",
            )
        if tuple(t.shape) != spec.shape:
            raise InputError(
                f"{graph.op}: input {name!r} has shape {tuple(t.shape)}, the graph was built "
                f"for {spec.shape}",
                hint="rebuild the graph for these sizes",
            )
        if t.dtype != torch_dtype(spec.dtype):
            raise DTypeError(
                f"{graph.op}: input {name!r} is {t.dtype}, the graph was built for {spec.dtype}",
                hint=f"cast it with .to(torch.{spec.dtype}) or rebuild the graph",
            )


def shard_inputs(graph: TaskGraph, inputs: dict[str, torch.Tensor], mem: Memory) -> None:
    check_inputs(graph, inputs)
    for buf in graph.buffers.values():
        if buf.role == "input" and buf.binding is not None:
            mem[buf.id].copy_(_pieces(buf.binding, inputs[buf.binding.tensor]))


# id(graph) -> weak reference: graphs whose outputs are known to be written (TaskGraph is an
# unhashable dataclass, so no WeakSet; the reference guards against a reused id).
_WRITTEN_CHECKED: dict[int, weakref.ref] = {}


def check_outputs_written(graph: TaskGraph) -> None:
    """OutputError if some element of an output buffer is written by no task of the graph."""
    known = _WRITTEN_CHECKED.get(id(graph))
    if known is not None and known() is graph:
        return
    masks = {
        b.id: torch.zeros((b.rows, b.cols), dtype=torch.bool)
        for b in graph.buffers.values()
        if b.role == "output"
    }
    for t in graph.tasks:
        for w in t.writes:
            mask = masks.get(w.buffer)
            if mask is not None:
                mask[w.row0 : w.row1, w.col0 : w.col1] = True
    for bid, mask in masks.items():
        if not mask.all():
            row, col = (~mask).nonzero()[0].tolist()
            raise OutputError(
                f"{graph.op}: output buffer {bid!r} element [{row}, {col}] (and "
                f"{int((~mask).sum()) - 1} more) is written by no task",
                hint="the lowering leaves part of an output unwritten: add the missing tile "
                "tasks, or shrink the buffer to what is written",
            )
    _WRITTEN_CHECKED[id(graph)] = weakref.ref(graph)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal element for element, NaN equal to NaN (replicas of a NaN result agree)."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def gather_outputs(
    graph: TaskGraph, mem: Memory, *, ranks=None, partial: bool = False
) -> dict[str, torch.Tensor]:
    """Assemble global outputs from the ranks' output buffers.

    A piece held by several ranks (replicated outputs) must agree (NaN agreeing with NaN); a
    piece nobody holds, or a graph that writes only part of an output, is an error: no silent
    wrong answers. ``partial`` (a process that holds only some ranks) leaves out the outputs
    those ranks do not hold in full instead.
    """
    check_outputs_written(graph)
    out: dict[str, torch.Tensor] = {}
    for name, spec in graph.outputs.items():
        dt = torch_dtype(spec.dtype)
        device = next(iter(mem.values())).device
        result = torch.full(spec.shape, float("nan"), dtype=dt, device=device)
        covered = torch.zeros(spec.shape, dtype=torch.bool, device=device)
        holders: dict[tuple, int] = {}
        for buf in graph.buffers.values():
            if buf.role != "output" or buf.binding is None or buf.binding.tensor != name:
                continue
            if ranks is not None and buf.rank not in ranks:
                continue
            data = mem[buf.id]
            sizes = [p[buf.binding.cat_dim][1] - p[buf.binding.cat_dim][0] for p in buf.binding.pieces]
            shapes = [[hi - lo for lo, hi in p] for p in buf.binding.pieces]
            joined_shape = list(shapes[0])
            joined_shape[buf.binding.cat_dim] = sum(sizes)
            parts = data.reshape(joined_shape).split(sizes, dim=buf.binding.cat_dim)
            for p, part in zip(buf.binding.pieces, parts, strict=True):
                index = tuple(slice(lo, hi) for lo, hi in p)
                if covered[index].all():
                    if not same_values(result[index], part):
                        diff = (result[index].float() - part.float()).abs().nan_to_num(float("inf"))
                        raise OutputError(
                            f"{graph.op}: replicas of output {name!r} disagree: rank {buf.rank} "
                            f"vs rank {holders[p]} on {p} (max diff {diff.max().item():.3g})"
                        )
                else:
                    result[index] = part
                    covered[index] = True
                    holders[p] = buf.rank
        if not covered.all():
            if partial:
                continue
            first = (~covered).nonzero()[0].tolist()
            raise OutputError(
                f"{graph.op}: no rank holds part of output {name!r} (first element {first})",
                hint="the output buffers' bindings leave a gap: check the lowering's bindings",
            )
        out[name] = result
    return out


def worst_tile_error(got: torch.Tensor, want: torch.Tensor, rows: int = 128,
                     cols: int = 128) -> float:
    """The largest relative error ||got - want|| / ||want|| of any ``rows`` x ``cols`` tile of
    two 2-D tensors; inf if ``got`` holds a value that is not finite where ``want`` is finite
    (an unwritten, NaN-poisoned element). One racy tile shows here even when the norm over the
    whole output hides it (the GPU tests and the benchmark check both). Tensors of more dims are
    read as 2-D: every leading dim folded into the rows ([B, H, S, D] -> [B*H*S, D])."""
    g, w = got.float(), want.float()
    if g.dim() != 2:
        g, w = g.reshape(-1, g.shape[-1]), w.reshape(-1, w.shape[-1])
    if not torch.isfinite(g[torch.isfinite(w)]).all():
        return float("inf")
    # short edge tiles count too (a mis-masked last tile row or column): zero-padded to whole
    # tiles, which adds nothing to either norm
    R, C = -(-g.shape[0] // rows) * rows, -(-g.shape[-1] // cols) * cols
    pad = (0, C - g.shape[-1], 0, R - g.shape[0])
    g, w = torch.nn.functional.pad(g, pad), torch.nn.functional.pad(w, pad)
    d = (g - w).reshape(R // rows, rows, C // cols, cols)
    ref = w.reshape(R // rows, rows, C // cols, cols)
    num = d.pow(2).sum(dim=(1, 3)).sqrt()
    den = ref.pow(2).sum(dim=(1, 3)).sqrt().clamp_min(1e-30)
    return (num / den).max().item()
