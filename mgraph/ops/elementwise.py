"""Elementwise math: ``out = fn(x)`` or ``out = fn(x, y)`` (``y`` a tensor or a scalar).

The activations (silu, gelu, relu, ...), residual adds and scalings of a traced module lower to
this op: one ``ewise`` compute task per row tile, in the layout of ``x`` (see tilewise.py for
operand forms and layouts). Math runs in fp32 and is stored once in the buffer dtype.

The megakernel's body (``ewise_tile``) reads the function as an integer code: the lowering adds
the GPU params ``code`` (index into :data:`CODES`), ``scalar_f``, ``alpha_f`` and ``swap`` next to
the ``fn``/``scalar``/``alpha``/``swap`` the CPU body reads, so both bodies mean the same thing.
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
from .abi import F_NREAD, F_READ0, F_WRITE0, HAVE_TRITON
from .registry import OpDef
from .tilewise import lower_tilewise, tile_shapes

__all__ = ["elementwise", "UNARY", "BINARY"]

elementwise = OpDef("elementwise", dims=("rows", "cols"), inputs=("x", "y"), outputs=("out",))
# GPU params: the fn as a code, the scalar operand and alpha as floats, swap as 0/1
EWISE = define_kind("ewise", [Role.COMPUTE], "elementwise math of one row tile (params: fn)",
                    params=("code", "scalar_f", "alpha_f", "swap"))

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


# The fn codes the Triton body switches on: unary fns first, then binary ones (a binary fn's
# code is its index here too). Appending keeps old codes valid; ewise_tile must follow.
CODES: tuple[str, ...] = (*UNARY, *BINARY)


def gpu_params(fn: str, scalar: float | None, alpha: float, swap: bool) -> dict:
    """The ewise params the Triton body reads (see the module docstring)."""
    return {"code": CODES.index(fn), "scalar_f": float(0.0 if scalar is None else scalar),
            "alpha_f": float(alpha), "swap": int(bool(swap))}


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
        params={"fn": fn, "scalar": scalar, "alpha": alpha, "swap": swap,
                **gpu_params(fn, scalar, alpha, swap)},
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


# -- megakernel tile body ------------------------------------------------------------------------
if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .abi import load_region, param_f32, param_i32
    from .tilewise import tile_ptrs

    _READ0, _NREAD, _WRITE0 = tl.constexpr(F_READ0), tl.constexpr(F_NREAD), tl.constexpr(F_WRITE0)

    @triton.jit
    def _tanh(x):
        # no tanh in triton.language's core: 1 - 2 / (e^2x + 1) saturates cleanly at +-1
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    @triton.jit
    def _pow(a, b):
        # |a|^b through exp2/log2, with torch's signs: a negative base keeps its sign for an odd
        # integer exponent and gives NaN for a non-integer one; b == 0 gives 1 (0^0 included)
        mag = tl.exp2(b * tl.log2(tl.abs(a)))
        whole = b == tl.floor(b)
        odd = whole & (b - 2.0 * tl.floor(b * 0.5) == 1.0)
        neg = tl.where(odd, -mag, tl.where(whole, mag, float("nan")))
        out = tl.where(a < 0.0, neg, mag)
        return tl.where(b == 0.0, 1.0, out)

    @triton.jit
    def _ewise_math(code, x, a, b):
        """The fn ``CODES[code]``: unary fns of ``x``, binary ones of ``(a, b)``."""
        y = x
        if code == 0:
            y = -x
        elif code == 1:
            y = x / (1.0 + tl.exp(-x))
        elif code == 2:
            y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
        elif code == 3:
            y = 0.5 * x * (1.0 + _tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
        elif code == 4:
            y = tl.maximum(x, 0.0)
        elif code == 5:
            y = 1.0 / (1.0 + tl.exp(-x))
        elif code == 6:
            y = _tanh(x)
        elif code == 7:
            y = tl.exp(x)
        elif code == 8:
            y = tl.log(x)
        elif code == 9:
            y = tl.sqrt(x)
        elif code == 10:
            y = tl.rsqrt(x)
        elif code == 11:
            y = tl.abs(x)
        elif code == 13:
            y = a + b
        elif code == 14:
            y = a - b
        elif code == 15:
            y = a * b
        elif code == 16:
            y = a / b
        elif code == 17:
            y = _pow(a, b)
        elif code == 18:
            y = tl.maximum(a, b)
        elif code == 19:
            y = tl.minimum(a, b)
        return y  # code 12: identity

    @EWISE.triton
    @triton.jit
    def ewise_tile(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr,
                   RB_M: tl.constexpr, RB_N: tl.constexpr):
        """out = fn(x) or fn(x, y) over the task's row tile, in RB_M x RB_N blocks. ``y`` is the
        second read (full, row or col form: tile_ptrs broadcasts it) or, with one read, the
        scalar param; fp32 math, one cast on the store."""
        r0 = tl.load(tp + _READ0)
        nread = tl.load(tp + _NREAD)
        w0 = tl.load(tp + _WRITE0)
        code = param_i32(params, tp, 0)
        scalar = param_f32(params, tp, 1)
        alpha = param_f32(params, tp, 2)
        swap = param_i32(params, tp, 3)
        _s, xm0, xm1, xn0, xn1 = load_region(regions, r0)
        for i in range(0, xm1 - xm0, RB_M):
            for j in range(0, xn1 - xn0, RB_N):
                om = i + tl.arange(0, RB_M)
                on = j + tl.arange(0, RB_N)
                mask = (om < xm1 - xm0)[:, None] & (on < xn1 - xn0)[None, :]
                x = tl.load(tile_ptrs(regions, bufaddr, bufcols, r0, om, on, DT),
                            mask=mask).to(tl.float32)
                if nread > 1:
                    other = tl.load(tile_ptrs(regions, bufaddr, bufcols, r0 + 1, om, on, DT),
                                    mask=mask).to(tl.float32)
                else:
                    other = tl.zeros((RB_M, RB_N), dtype=tl.float32) + scalar
                other = other * alpha
                a = tl.where(swap != 0, other, x)
                b = tl.where(swap != 0, x, other)
                y = _ewise_math(code, x, a, b)
                tl.store(tile_ptrs(regions, bufaddr, bufcols, w0, om, on, DT), y.to(DT), mask=mask)
