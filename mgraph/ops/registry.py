"""The op registry: one OpDef per fused op, its facets attached by decorators in the op's file.

Facets (each attached once):
- ``shapes(fn)``: ``fn(topology, **dims) -> {tensor name: global shape}`` for inputs and outputs;
  raises ShapeError for sizes the op cannot lower.
- ``lower(fn)``: ``fn(builder, **dims, **options)`` emits buffers, events and tile tasks.
  Its keyword parameters ARE the op's options: the builder call accepts exactly these, and their
  annotations ARE the options' types, checked strictly before building (mgraph/options.py).
- ``reference(fn)``: ``fn(**global_inputs, **params) -> {output name: tensor}``: the op's meaning
  on GLOBAL tensors, in torch. Every backend is checked against it.
- ``make_inputs(fn)`` (optional): ``fn(graph, generator) -> inputs``: random
  inputs with sensible scales; the default is a standard normal per input.
"""

from __future__ import annotations

import gc
import inspect
import json
from collections.abc import Callable
from typing import Any

import torch

from ..builder import GraphBuilder
from ..errors import RegistrationError, ShapeError, SizeLimitError, UnknownNameError
from ..graph import ITEMSIZE, TaskGraph, dtype_name, torch_dtype
from ..options import check_options, option_types
from ..settings import Settings
from ..topology import Topology

__all__ = ["OpDef", "OPS", "get_op", "op_names"]

OPS: dict[str, OpDef] = {}


class OpDef:
    """A fused op: its dims (the CLI's --shape order), inputs, outputs and facets."""

    def __init__(
        self, name: str, *, dims: tuple[str, ...], inputs: tuple[str, ...], outputs: tuple[str, ...]
    ) -> None:
        if name in OPS:
            raise RegistrationError(f"op {name!r} is already registered", hint="pick another name")
        self.name = name
        self.dims = dims
        self.input_names = inputs
        self.output_names = outputs
        self.shapes_fn: Callable[..., dict[str, tuple[int, ...]]] | None = None
        self.lower_fn: Callable[..., None] | None = None
        self.reference_fn: Callable[..., dict[str, torch.Tensor]] | None = None
        self.make_inputs_fn: Callable[..., dict[str, torch.Tensor]] | None = None
        # (topology, **params) -> the fewest tasks the lowering makes: checked against
        # max_tasks before building, so an oversized graph is refused at once
        self.min_tasks_fn: Callable[..., int] | None = None
        OPS[name] = self

    def _attach(self, facet: str, fn: Callable) -> Callable:
        attr = f"{facet}_fn"
        if getattr(self, attr) is not None:
            raise RegistrationError(
                f"op {self.name!r} already has a {facet} facet", hint="attach each facet once"
            )
        setattr(self, attr, fn)
        return fn

    def shapes(self, fn: Callable) -> Callable:
        return self._attach("shapes", fn)

    def lower(self, fn: Callable) -> Callable:
        return self._attach("lower", fn)

    def reference(self, fn: Callable) -> Callable:
        return self._attach("reference", fn)

    def make_inputs(self, fn: Callable) -> Callable:
        return self._attach("make_inputs", fn)

    def min_tasks(self, fn: Callable) -> Callable:
        """Decorator: ``fn(topology, **params) -> int``, a lower bound of the graph's tasks."""
        return self._attach("min_tasks", fn)

    # -- use ----------------------------------------------------------------------------------
    def _signature(self) -> tuple[Callable, dict[str, Any], dict[str, Any]]:
        """(the lowering, its options, their types), computed once per lowering function:
        check_params asks for both once per traced op and once per lowered node, and
        inspect.signature and the type hints cost ~50 us a call (~15-25 ms a 2x8 compile)."""
        assert self.lower_fn is not None, self.name
        cached = self.__dict__.get("_signature_cache")
        if cached is None or cached[0] is not self.lower_fn:
            sig = inspect.signature(self.lower_fn)
            options = {
                p.name: p.default
                for p in list(sig.parameters.values())[1:]
                if p.name not in self.dims and p.default is not inspect.Parameter.empty
            }
            cached = (self.lower_fn, options, option_types(self.lower_fn, options))
            self._signature_cache = cached
        return cached

    @property
    def options(self) -> dict[str, Any]:
        """Lowering options and their defaults (keyword parameters after the dims); a copy."""
        return dict(self._signature()[1])

    @property
    def option_types(self) -> dict[str, Any]:
        """Each option's annotated type (``Any`` where the lowering gives none); a copy."""
        return dict(self._signature()[2])

    def check_params(self, topology: Topology, params: dict[str, Any]) -> dict[str, tuple]:
        """Validate dims and options (strictly typed); return the global shapes {name: shape}."""
        missing = [d for d in self.dims if d not in params]
        if missing:
            raise ShapeError(
                f"{self.name}: missing size(s) {', '.join(missing)}",
                hint=f"{self.name} takes {', '.join(self.dims)}",
            )
        unknown = set(params) - set(self.dims) - set(self.options)
        if unknown:
            raise UnknownNameError(
                f"{self.name}: unknown option(s) {', '.join(sorted(unknown))}; valid: "
                f"{', '.join(self.dims + tuple(self.options))}"
            )
        for d in self.dims:
            v = params[d]
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ShapeError(
                    f"{self.name}: {d}={v!r} must be a positive integer",
                    hint=f"pass {', '.join(self.dims)} as positive ints",
                )
        check_options(
            self.name, self.option_types, {k: v for k, v in params.items() if k not in self.dims}
        )
        assert self.shapes_fn is not None
        return self.shapes_fn(topology, **params)

    def __call__(
        self,
        *,
        topology: Topology | str,
        dtype: torch.dtype | str = torch.float32,
        settings: Settings | None = None,
        **params: Any,
    ) -> TaskGraph:
        """Build this op's TaskGraph for ``topology``.

        Sizes, options and the size guard (``settings.max_tasks``/``max_bytes``) are checked
        before any task is made; the builder stops at the task limit instead of running on."""
        if self.lower_fn is None or self.shapes_fn is None or self.reference_fn is None:
            raise RegistrationError(
                f"op {self.name!r} is missing a facet (shapes, lower and reference are required)"
            )
        topo = Topology.parse(topology)
        dt = dtype_name(dtype)
        # JSON-native values (lists, not tuples) so a graph's params survive a JSON round trip.
        full = json.loads(json.dumps({**self.options, **params}))
        shapes = self.check_params(topo, full)
        limits = settings or Settings.from_env()
        self._check_size(topo, dt, shapes, limits)
        if self.min_tasks_fn is not None:
            at_least = self.min_tasks_fn(topo, **full)
            if at_least > limits.max_tasks:
                raise SizeLimitError(
                    f"{self.name}: on {topo} this graph has at least {at_least:,} tasks, above "
                    f"the limit {limits.max_tasks:,}",
                    hint="use a smaller topology, larger tiles or smaller sizes, or raise the "
                    "limit: MGRAPH_MAX_TASKS=<n> or Settings(max_tasks=...) passed as settings=",
                )
        builder = GraphBuilder(self.name, topo, dt, full, limits=limits)
        # A graph is 10^4-10^6 small objects that all live on: the cyclic collector would rescan
        # them over and over (measured: 3x the build time at 133k tasks) and can free none.
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            self.lower_fn(builder, **full)
            return builder.finish()
        finally:
            if was_enabled:
                gc.enable()

    def _check_size(
        self, topo: Topology, dtype: str, shapes: dict[str, tuple], limits: Settings
    ) -> None:
        """Refuse before building what cannot fit: the global tensors alone (every run holds
        them) above ``max_bytes``, or more ranks than ``max_tasks`` (each rank gets tasks)."""
        nbytes = 0
        for shape in shapes.values():
            n = ITEMSIZE[dtype]
            for s in shape:
                n *= s
            nbytes += n
        if nbytes > limits.max_bytes:
            raise SizeLimitError(
                f"{self.name}: the inputs and outputs alone take {nbytes / 2**30:.3g} GiB "
                f"({', '.join(f'{k}{list(v)}' for k, v in shapes.items())}), above the limit "
                f"of {limits.max_bytes / 2**30:.3g} GiB",
                hint="use smaller sizes, or raise the limit: MGRAPH_MAX_BYTES=<bytes> or "
                "Settings(max_bytes=...) passed as settings=",
            )
        if topo.world_size > limits.max_tasks:
            raise SizeLimitError(
                f"{self.name}: topology {topo} has {topo.world_size} ranks, more than the task "
                f"limit {limits.max_tasks}",
                hint="use a smaller topology, or raise MGRAPH_MAX_TASKS",
            )

    def run_reference(
        self, inputs: dict[str, torch.Tensor], params: dict[str, Any]
    ) -> dict[str, torch.Tensor]:
        assert self.reference_fn is not None
        return self.reference_fn(**inputs, **params)

    def random_inputs(
        self, graph: TaskGraph, *, seed: int = 0, device: str = "cpu"
    ) -> dict[str, torch.Tensor]:
        """Fresh random global inputs for ``graph`` (never zeros)."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        if self.make_inputs_fn is not None:
            out = self.make_inputs_fn(graph, gen)
        else:
            out = {
                name: torch.randn(spec.shape, generator=gen).to(torch_dtype(spec.dtype))
                for name, spec in graph.inputs.items()
            }
        return {k: v.to(device) for k, v in out.items()}


def get_op(name: str) -> OpDef:
    from .. import ops  # noqa: F401  (importing the package registers the builtin ops)

    try:
        return OPS[name]
    except KeyError:
        raise UnknownNameError(
            f"unknown op {name!r}; registered ops: {', '.join(sorted(OPS))}",
            hint="list them with `mgraph ops`; new ops are defined with mgraph.ops.OpDef",
        ) from None


def op_names() -> list[str]:
    from .. import ops  # noqa: F401

    return sorted(OPS)
