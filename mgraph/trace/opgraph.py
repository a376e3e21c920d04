"""The OpGraph: what tracing produces and lowering consumes.

- ``Value``: one tensor of the traced program: its N-D shape, dtype and the ``Layout`` the tracer
  chose for it. Program inputs and parameters are *free* (layout None): the runtime shards them
  from the global tensors, so each consumer gets them bound in the layout it asks for. A view that
  keeps the last dim is an *alias* (``alias_of``): same buffers, same flat 2-D view, no data moved.
- ``OpNode``: one registered op (``mgraph.ops.OPS``) with its dims and options (``params``), its
  input and output tensors by the op's names, and where it came from (module path, ATen target).
- ``OpGraph``: nodes in program order, the program's inputs (user arguments, in order), its
  parameters (with how to build each global tensor from the module) and its outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..layout import Layout
from ..topology import Topology

__all__ = ["Value", "ParamSource", "OpNode", "OpGraph"]


@dataclass(frozen=True)
class ParamSource:
    """How a parameter value is built from the module's tensors.

    ``transform``: ``none`` (as stored), ``t`` (a linear's weight, transposed to [in, out] as the
    GEMM ops read it), ``stack_t`` (expert weights, each transposed, stacked on a new dim 0);
    from one stacked ``[E, 2F, H]`` gate-up tensor: ``gate_t`` / ``up_t`` (its first / last F
    rows per expert, as [E, H, F]); ``batch_t`` (an [E, H, F] down tensor as [E, F, H]); from a
    gated unit's two weights: ``glu_pack`` ([K, N] each) / ``glu_pack_t`` (linear weights, [N, K]
    each), packed block by block as mgraph.ops.matmul_glu.pack_glu lays them out.
    """

    fqns: tuple[str, ...]
    transform: str = "none"

    def build(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [tensors[f].detach() for f in self.fqns]
        if self.transform == "none":
            return parts[0]
        if self.transform == "t":
            return parts[0].t().contiguous()
        if self.transform == "stack_t":
            return torch.stack([p.t() for p in parts]).contiguous()
        if self.transform in ("glu_pack", "glu_pack_t"):
            from ..ops.matmul_glu import pack_glu

            gate, up = (p.t() if self.transform == "glu_pack_t" else p for p in parts)
            return pack_glu(gate.contiguous(), up.contiguous())
        w = parts[0]
        half = w.shape[1] // 2
        if self.transform == "gate_t":
            return w[:, :half].transpose(1, 2).contiguous()
        if self.transform == "up_t":
            return w[:, half:].transpose(1, 2).contiguous()
        assert self.transform == "batch_t", self.transform
        return w.transpose(1, 2).contiguous()


@dataclass
class Value:
    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: Layout | None
    kind: str  # "input" | "param" | "op" | "empty" (an empty slice: only cat reads it)
    alias_of: Value | None = None
    source: ParamSource | None = None
    producer: str | None = None  # name of the OpNode that writes it
    # "bool_mask": a boolean attention mask held in its additive form (0 / -inf in the compute
    # dtype; the Program converts the boolean input), readable only by attention and relayouts.
    encoding: str | None = None

    @property
    def free(self) -> bool:
        return self.kind in ("input", "param")

    def root(self) -> Value:
        v = self
        while v.alias_of is not None:
            v = v.alias_of
        return v

    def __repr__(self) -> str:
        lay = "free" if self.layout is None else self.layout.describe()
        return f"Value({self.name!r}, {list(self.shape)}, {lay})"


@dataclass
class OpNode:
    name: str
    op: str
    params: dict[str, Any]
    inputs: dict[str, Value]
    outputs: dict[str, Value]
    path: str = ""  # module path of the traced code, "" for the root module
    origin: str = ""  # the ATen op (or leaf module) it comes from

    def where(self) -> str:
        path = self.path or "<root>"
        return f"node {self.name!r} ({self.op}, module {path}{', ' + self.origin if self.origin else ''})"


@dataclass
class OpGraph:
    name: str
    topology: Topology
    dtype: str
    nodes: list[OpNode] = field(default_factory=list)
    inputs: list[Value] = field(default_factory=list)
    params: list[Value] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    single_output: bool = True
    note: str = ""  # how the module was captured, when not by torch.export
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # tensors made in forward

    @property
    def output_names(self) -> list[str]:
        return ["out"] if len(self.outputs) == 1 else [f"out{i}" for i in range(len(self.outputs))]

    def to_text(self) -> str:
        """One line per node: ``name = op(inputs) [params] -> outputs``."""
        lines = [f"OpGraph {self.name} on {self.topology} ({self.dtype})"]
        lines += [f"  input {v!r}" for v in self.inputs]
        lines += [f"  param {v!r}" for v in self.params]
        for n in self.nodes:
            ins = ", ".join(f"{k}={v.name}" for k, v in n.inputs.items())
            outs = ", ".join(repr(v) for v in n.outputs.values())
            lines.append(f"  {n.name} = {n.op}({ins}) -> {outs}   [{n.path or '<root>'}]")
        lines += [f"  output {v!r}" for v in self.outputs]
        return "\n".join(lines)
