"""Elementwise math: ``out = fn(x)`` or ``out = fn(x, y)`` (``y`` a tensor or a scalar).

The activations (silu, gelu, relu, ...), residual adds and scalings of a traced module lower to
this op: one ``ewise`` compute task per row tile, in the layout of ``x`` (see tilewise.py for
operand forms and layouts). Math runs in fp32 and is stored once in the buffer dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..builder import GraphBuilder
from ..errors import UnknownNameError
from ..graph import Task
from ..kinds import Role, define_kind
from ..topology import Topology
from .registry import OpDef
from .tilewise import lower_tilewise, tile_shapes

__all__ = ["elementwise", "UNARY", "BINARY"]

elementwise = OpDef("elementwise", dims=("rows", "cols"), inputs=("x", "y"), outputs=("out",))
EWISE = define_kind("ewise", [Role.COMPUTE], "elementwise math of one row tile (params: fn)")

UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "neg": torch.neg,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "exp": torch.exp,
    "log": torch.log,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "abs": torch.abs,
    "identity": lambda x: x,
}
BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": torch.add,
    "sub": torch.sub,
    "mul": torch.mul,
    "div": torch.div,
    "pow": torch.pow,
    "maximum": torch.maximum,
    "minimum": torch.minimum,
}


def _check_fn(fn: str, other: str | None, scalar: float | None) -> None:
    binary = other is not None or scalar is not None
    table = BINARY if binary else UNARY
    if fn not in table:
        raise UnknownNameError(
            f"elementwise: unknown {'binary' if binary else 'unary'} fn {fn!r}; valid: "
            f"{', '.join(sorted(table))}",
            hint="a binary fn needs other= (a tensor operand) or scalar=",
        )


def apply(
    fn: str,
    x: torch.Tensor,
    y: torch.Tensor | None,
    scalar: float | None,
    alpha: float,
    swap: bool,
) -> torch.Tensor:
    """The op's meaning on fp32 tensors (tiles or whole tensors alike)."""
    if y is None and scalar is None:
        return UNARY[fn](x)
    other = y if y is not None else torch.tensor(scalar, dtype=torch.float32)
    if alpha != 1.0:
        other = other * alpha
    a, b = (other, x) if swap else (x, other)
    return BINARY[fn](a, b)


@elementwise.shapes
def _shapes(
    topology: Topology,
    rows: int,
    cols: int,
    fn: str = "add",
    other: str | None = None,
    scalar: float | None = None,
    shape: Sequence[int] | None = None,
    layout: Sequence | None = None,
    **_: object,
) -> dict[str, tuple]:
    _check_fn(fn, other, scalar)
    operands = {} if other is None else {"y": other}
    return tile_shapes("elementwise", topology, rows, cols, shape, layout, operands)


@elementwise.reference
def _reference(
    x: torch.Tensor,
    y: torch.Tensor | None = None,
    fn: str = "add",
    scalar: float | None = None,
    alpha: float = 1.0,
    swap: bool = False,
    **_: object,
) -> dict[str, torch.Tensor]:
    out = apply(fn, x.float(), None if y is None else y.float(), scalar, alpha, swap)
    return {"out": out.to(x.dtype)}


@elementwise.lower
def _lower(
    b: GraphBuilder,
    rows: int,
    cols: int,
    fn: str = "add",
    other: str | None = None,
    scalar: float | None = None,
    alpha: float = 1.0,
    swap: bool = False,
    shape: list[int] | None = None,
    layout: list | None = None,
    tile_rows: int = 64,
) -> None:
    lower_tilewise(
        b,
        EWISE.name,
        rows=rows,
        cols=cols,
        shape=shape,
        layout=layout,
        operands={} if other is None else {"y": other},
        params={"fn": fn, "scalar": scalar, "alpha": alpha, "swap": swap},
        tile_rows=tile_rows,
        label=fn,
    )


@EWISE.cpu
def _ewise_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    p = task.params
    y = reads[1].float() if len(reads) > 1 else None
    writes[0].copy_(apply(p["fn"], reads[0].float(), y, p["scalar"], p["alpha"], p["swap"]))


@EWISE.flops
def _ewise_flops(reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict):
    rows, cols = writes[0]
    return float(rows * cols)
