"""Per-rank buffers of a TaskGraph: allocation, sharding global inputs, gathering outputs.

Every backend goes through these three functions, so a graph's Bindings mean the same thing
everywhere. Scratch and output buffers are poisoned with NaN: a tile nobody wrote shows up as NaN
in the gathered output (and is reported), never as a plausible stale value.
"""

from __future__ import annotations

import torch

from mgraph.errors import DTypeError, InputError, MgraphError
from mgraph.graph import Binding, Region, TaskGraph, torch_dtype

__all__ = ["allocate", "shard_inputs", "gather_outputs", "region_view", "Memory"]

Memory = dict[str, torch.Tensor]  # buffer id -> 2-D tensor


def allocate(graph: TaskGraph, device: str | torch.device = "cpu", poison: bool = True) -> Memory:
    mem: Memory = {}
    for buf in graph.buffers.values():
        dt = torch_dtype(buf.dtype)
        if poison and buf.role != "input":
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
            raise InputError(f"{graph.op}: input {name!r} is a {type(t).__name__}, not a tensor")
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


def gather_outputs(
    graph: TaskGraph, mem: Memory, *, ranks=None, partial: bool = False
) -> dict[str, torch.Tensor]:
    """Assemble global outputs from the ranks' output buffers.

    A piece held by several ranks (replicated outputs) must agree bit for bit; a piece nobody
    holds, or one left NaN, is an error: no silent wrong answers. ``partial`` (a process that
    holds only some ranks) leaves out the outputs those ranks do not hold in full instead.
    """
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
                    if not torch.equal(result[index], part):
                        diff = (result[index].float() - part.float()).abs().nan_to_num(float("inf"))
                        raise MgraphError(
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
            raise MgraphError(f"{graph.op}: no rank holds part of output {name!r}")
        if torch.isnan(result).any():
            bad = torch.isnan(result).nonzero()[0].tolist()
            raise MgraphError(
                f"{graph.op}: output {name!r} has unwritten (NaN) elements, first at {bad}",
                hint="a tile was never written: check the lowering's writes for that region",
            )
        out[name] = result
    return out
