"""``mg.compile``: nn.Module + example inputs + plan -> Program (trace, lower, validate, schedule).

A Program runs single-controller on the CPU backends: ``prog(*inputs)`` takes the module's
GLOBAL inputs and returns its global outputs; the parameters are read from the module at every
call (so updated weights are used), laid out as the ops read them. It runs through ``mg.run``,
so any backend registered in ``mgraph.api.BACKENDS`` serves it.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from .api import BACKENDS, backend_names, run
from .errors import DTypeError, InputError, UnknownNameError
from .graph import TaskGraph, torch_dtype
from .hardware import H200, HardwareProfile
from .layout import flat_shape
from .lower import lower
from .plans import ParallelStyle
from .scheduler import Schedule, schedule
from .settings import Settings
from .topology import Topology
from .trace import OpGraph, trace
from .trace.attention_map import additive_mask

__all__ = ["compile", "Program"]


def compile(  # noqa: A001  (mg.compile mirrors torch.compile)
    module: nn.Module,
    example_inputs: Sequence[torch.Tensor] | torch.Tensor,
    *,
    plan: Mapping[str, ParallelStyle] | None = None,
    topology: Topology | str = "1x1",
    backend: str = "reference",
    hardware: HardwareProfile = H200,
    policy: str = "critical_path",
    workers: Mapping[str, int] | None = None,
    validate: bool = True,
) -> Program:
    """Trace ``module`` under ``plan``, lower it to ONE TaskGraph on ``topology``, validate and
    schedule it; the Program runs it on ``backend``."""
    check_backend(backend)
    opgraph = trace(module, example_inputs, plan, topology)
    # The graph is 10^4+ small objects that all live on: the cyclic collector would rescan
    # them again and again while validating and scheduling (see OpDef.__call__) and free none.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        graph = lower(opgraph)
        if validate:
            graph.validate()
        sched = schedule(graph, hardware, policy, workers)
    finally:
        if was_enabled:
            gc.enable()
    return Program(module, opgraph, sched, backend)


def check_backend(backend: str) -> None:
    if backend in BACKENDS:
        return
    raise UnknownNameError(f"unknown backend {backend!r}; available: {', '.join(backend_names())}")


class Program:
    """A compiled module: ``prog(*inputs)`` runs it; ``graph``, ``schedule``, ``opgraph``
    are the objects each stage produced."""

    def __init__(self, module: nn.Module, opgraph: OpGraph, sched: Schedule, backend: str):
        self.module = module
        self.opgraph = opgraph
        self.schedule = sched
        self.backend = backend
        self.last_result: Any = None

    @property
    def graph(self) -> TaskGraph:
        return self.schedule.graph

    @property
    def topology(self) -> Topology:
        return self.opgraph.topology

    def inputs(self, *args: torch.Tensor) -> dict[str, torch.Tensor]:
        """The graph's global inputs for module inputs ``args``: the arguments and parameters,
        each flattened to the 2-D view its buffers use."""
        og = self.opgraph
        if len(args) != len(og.inputs):
            raise InputError(
                f"{og.name} was compiled for {len(og.inputs)} input(s), got {len(args)}",
                hint="pass the same positional inputs as the example inputs",
            )
        wanted = self.graph.inputs
        dtype = torch_dtype(og.dtype)
        out: dict[str, torch.Tensor] = {}
        for value, arg in zip(og.inputs, args, strict=True):
            if not isinstance(arg, torch.Tensor) or tuple(arg.shape) != value.shape:
                got = tuple(arg.shape) if isinstance(arg, torch.Tensor) else type(arg).__name__
                raise InputError(
                    f"{og.name}: input {value.name!r} is {got}, the program was compiled for "
                    f"{list(value.shape)}",
                    hint="compile again with example inputs of this shape",
                )
            if value.encoding == "bool_mask":
                if arg.dtype != torch.bool:
                    raise DTypeError(
                        f"{og.name}: input {value.name!r} is {arg.dtype}, compiled as a boolean "
                        "attention mask",
                        hint="pass a torch.bool mask (True = attend), as at compile time",
                    )
                arg = additive_mask(arg, dtype)
            elif arg.dtype != dtype:
                raise DTypeError(
                    f"{og.name}: input {value.name!r} is {arg.dtype}, compiled for {og.dtype}",
                    hint=f"cast it with .to(torch.{og.dtype})",
                )
            if value.name in wanted:
                out[value.name] = arg.reshape(flat_shape(value.shape))
        tensors = dict(self.module.named_parameters(remove_duplicate=False))
        tensors.update(self.module.named_buffers(remove_duplicate=False))
        tensors.update(og.constants)
        for value in og.params:
            if value.name in wanted:
                assert value.source is not None
                t = value.source.build(tensors).to(dtype)
                out[value.name] = t.reshape(flat_shape(value.shape))
        return out

    def run(self, *args: torch.Tensor, settings: Settings | None = None, **options: Any) -> Any:
        """Run once; the RunResult's outputs are the module's outputs by name (out, out0, ...),
        in their traced shapes."""
        result = run(
            self.schedule, self.inputs(*args), backend=self.backend, settings=settings, **options
        )
        for name, value in zip(self.opgraph.output_names, self.opgraph.outputs, strict=True):
            if name in result.outputs:  # timing-only backends (sim) compute no values
                result.outputs[name] = result.outputs[name].reshape(value.shape)
        self.last_result = result
        return result

    def __call__(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        outputs = self.run(*args).outputs
        values = [outputs[name] for name in self.opgraph.output_names]
        return values[0] if self.opgraph.single_output else tuple(values)

    def view(self, path: str | None = None, **kw: Any):
        """Write the offline HTML viewer of this program's graph, schedule and last run's
        timeline; returns the file's path (mgraph.viz.view)."""
        from .viz import view

        return view(self, path, **kw)

    def __repr__(self) -> str:
        g = self.graph
        return (
            f"Program({self.opgraph.name}, topology={self.topology}, backend={self.backend!r}, "
            f"ops={len(self.opgraph.nodes)}, tasks={len(g.tasks)})"
        )
