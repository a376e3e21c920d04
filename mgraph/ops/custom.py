"""User-registered ops: ``@mg.register_op`` turns a torch function into an op mgraph can trace,
lower and run.

    @mg.register_op("fused_rmsnorm")
    def fused_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

The decorated function is the op's meaning (its torch reference). Registration makes:
- a torch custom op ``mgraph_user::<name>``: calling the returned object runs the reference
  eagerly and appears as ONE node when torch.export traces a module that calls it;
- a task kind ``<name>`` whose CPU body runs the reference on one row tile, and whose
  megakernel tile body is ``triton=`` (a ``@triton.jit`` function; without one, graphs with the
  op run on the reference backend only);
- an OpDef ``<name>`` (dims rows x cols) lowered to one task per ``tile_rows`` rows of each
  rank's part, in the layout of the first tensor argument, like the builtin norms.

Tensor arguments after the first are the first one's shape (read tile by tile) or a vector over
its last dim (read whole, e.g. a weight); other arguments are python scalars. ``shape``, when
given, maps the arguments (tensors replaced by their shapes) to the output shape, which must
keep the leading dims; the default is the first argument's shape. ``whole_rows=True`` (the
default) promises the op needs complete rows (a norm); False allows column-sharded inputs (a
pure elementwise op).

The ``triton=`` body follows the megakernel's convention (runtime/megakernel/dispatch.py): its
PARAMETER NAMES say which kernel values it receives (``tp``, ``params``, ``regions``,
``bufaddr``, ``bufcols``, ``DT``, ``RB_M``, ``RB_N``...: dispatch.ABI_NAMES). One task covers a
row tile: its reads are the tensor arguments in signature order (read ``i`` is region
``tl.load(tp + F_READ0) + i``; a ``row`` operand's region is one row, to broadcast), its write
0 is ``out``; the float/int/bool scalar arguments are the task's params in signature order
(``abi.param_f32(params, tp, i)`` for a float, ``abi.param_i32`` for an int or bool; other
scalars reach the CPU body only). Regions are ``abi.load_region(regions, index)``; a buffer's
typed base is ``abi.buffer_base(bufaddr, slot, DT)``; mgraph.ops.tilewise.tile_ptrs builds
broadcasting pointers. The body computes in fp32 and casts once to ``DT`` on the store, as the
reference does.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..builder import GraphBuilder
from ..errors import RegistrationError
from ..graph import Task
from ..kinds import KINDS, Role, define_kind
from ..topology import Topology
from .registry import OPS, OpDef
from .tilewise import lower_tilewise, tile_shapes

__all__ = ["register_op", "CustomOp", "CUSTOM"]

NAMESPACE = "mgraph_user"
CUSTOM: dict[str, CustomOp] = {}


class CustomOp:
    """A registered user op; call it like the function it was made from."""

    def __init__(
        self,
        name: str,
        reference: Callable[..., torch.Tensor],
        *,
        shape: Callable[..., Sequence[int]] | None,
        whole_rows: bool,
        tile_rows: int,
        flops: Callable[[int, int], float] | None,
        triton: Any,
    ) -> None:
        self.name = name
        self.reference = reference
        self.shape_fn = shape
        self.whole_rows = whole_rows
        self.tile_rows = tile_rows
        sig = inspect.signature(reference)
        self.arg_names = list(sig.parameters)
        self.tensor_args = [
            p.name for p in sig.parameters.values() if _is_tensor_annotation(p.annotation)
        ]
        if not self.tensor_args:
            raise RegistrationError(
                f"op {name!r}: the reference takes no tensor argument",
                hint="annotate tensor parameters as torch.Tensor",
            )
        clash = {"x", "out"} & set(self.tensor_args[1:])
        if clash:
            raise RegistrationError(
                f"op {name!r}: argument name(s) {sorted(clash)} are reserved after the first",
                hint="rename them",
            )
        try:
            self.torch_op = torch.library.custom_op(
                f"{NAMESPACE}::{name}", reference, mutates_args=()
            )
        except Exception as e:  # noqa: BLE001  (torch's schema inference explains what it needs)
            raise RegistrationError(
                f"op {name!r}: torch cannot make a custom op of the reference: {e}",
                hint="annotate every parameter (torch.Tensor, float, int, bool) and the return",
            ) from e
        self.torch_op.register_fake(self._fake)
        # the scalars a Triton body reads as task params (float32 or int32 words), in order
        self.gpu_scalars = {
            p.name: (float if _is_annotation(p.annotation, float) else int, p.default)
            for p in sig.parameters.values()
            if any(_is_annotation(p.annotation, t) for t in (float, int, bool))
        }
        reserved = {"forms", "scalars"} & set(self.gpu_scalars)
        if reserved:
            raise RegistrationError(
                f"op {name!r}: scalar argument name(s) {sorted(reserved)} are reserved",
                hint="rename them",
            )
        self.kind = define_kind(name, [Role.COMPUTE], f"user op {name} on one row tile",
                                params=tuple(self.gpu_scalars))
        self.kind.cpu(self._cpu_body)
        self.kind.flops(
            lambda reads, writes, params: float(
                flops(*writes[0]) if flops else math.prod(writes[0])
            )
        )
        if triton is not None:
            self.kind.triton(triton)
        self.opdef = _make_opdef(self)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.torch_op(*args, **kwargs)

    def out_shape(self, *args: Any, **kwargs: Any) -> tuple[int, ...]:
        """The output shape for arguments given as tensors (or shapes) and scalars."""
        bound = inspect.signature(self.reference).bind(*args, **kwargs)
        bound.apply_defaults()
        shapes = {
            k: (tuple(v.shape) if isinstance(v, torch.Tensor) else v)
            for k, v in bound.arguments.items()
        }
        if self.shape_fn is None:
            return tuple(shapes[self.tensor_args[0]])
        return tuple(int(s) for s in self.shape_fn(**shapes))

    def gpu_params(self, scalars: dict[str, Any]) -> dict[str, float | int]:
        """The scalars as the Triton body reads them: every declared one (the reference's
        default where the call left it out), floats as floats and ints/bools as ints. One with
        no value is left out: the reference backend never needs it, and the megakernel's
        encoder names it (a ScheduleError) before anything launches."""
        out = {}
        for name, (kind, default) in self.gpu_scalars.items():
            value = scalars.get(name, default)
            if value is not inspect.Parameter.empty and value is not None:
                out[name] = kind(value)
        return out

    def _fake(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        first = next(a for a in args if isinstance(a, torch.Tensor))
        return first.new_empty(self.out_shape(*args, **kwargs))

    def _cpu_body(
        self, task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]
    ) -> None:
        p = task.params
        tensors = dict(zip(self.tensor_args, reads, strict=True))
        kwargs: dict[str, Any] = {}
        for name in self.arg_names:
            if name in tensors:
                t = tensors[name]
                kwargs[name] = t.reshape(-1) if p["forms"].get(name) == "row" else t
            elif name in p["scalars"]:
                kwargs[name] = p["scalars"][name]
        writes[0].copy_(self.reference(**kwargs).reshape(writes[0].shape))


def _make_opdef(op: CustomOp) -> OpDef:
    opdef = OpDef(op.name, dims=("rows", "cols"), inputs=tuple(op.tensor_args), outputs=("out",))

    def operands(forms: dict[str, str]) -> dict[str, str]:
        return {name: forms.get(name, "full") for name in op.tensor_args[1:]}

    @opdef.shapes
    def _shapes(
        topology: Topology,
        rows: int,
        cols: int,
        forms: dict | None = None,
        out_cols: int | None = None,
        shape: Sequence[int] | None = None,
        layout: Sequence | None = None,
        **_: object,
    ) -> dict[str, tuple]:
        return tile_shapes(
            op.name,
            topology,
            rows,
            cols,
            shape,
            layout,
            operands(forms or {}),
            out_cols,
            whole_rows=op.whole_rows,
        )

    @opdef.reference
    def _reference(scalars: dict | None = None, forms: dict | None = None, **kw: Any):
        tensors = {name: kw[name if i else "x"] for i, name in enumerate(op.tensor_args)}
        args = {
            n: (t.reshape(-1) if (forms or {}).get(n) == "row" else t) for n, t in tensors.items()
        }
        return {"out": op.reference(**args, **(scalars or {}))}

    @opdef.lower
    def _lower(
        b: GraphBuilder,
        rows: int,
        cols: int,
        forms: dict | None = None,
        scalars: dict | None = None,
        out_cols: int | None = None,
        shape: list[int] | None = None,
        layout: list | None = None,
        tile_rows: int = op.tile_rows,
    ) -> None:
        lower_tilewise(
            b,
            op.kind.name,
            rows=rows,
            cols=cols,
            shape=shape,
            layout=layout,
            operands=operands(forms or {}),
            out_cols=out_cols,
            params={"forms": dict(forms or {}), "scalars": dict(scalars or {}),
                    **op.gpu_params(scalars or {})},
            tile_rows=tile_rows,
            label=op.name,
        )

    return opdef


def _is_annotation(annotation: Any, kind: type) -> bool:
    return annotation is kind or annotation == kind.__name__


def _is_tensor_annotation(annotation: Any) -> bool:
    return annotation is torch.Tensor or annotation in ("torch.Tensor", "Tensor")


def register_op(
    name: str,
    reference: Callable[..., torch.Tensor] | None = None,
    *,
    shape: Callable[..., Sequence[int]] | None = None,
    whole_rows: bool = True,
    tile_rows: int = 64,
    flops: Callable[[int, int], float] | None = None,
    triton: Any = None,
) -> Any:
    """Register a user op (see the module docstring); usable as ``@register_op("name")``."""

    def make(fn: Callable[..., torch.Tensor] | None) -> CustomOp:
        if fn is None:
            raise RegistrationError(
                f"op {name!r} has no torch reference: its tile kind would have no CPU body",
                hint="decorate the reference function, or pass reference=",
            )
        if not name.isidentifier():
            raise RegistrationError(f"op name {name!r} must be a python identifier")
        taken = [what for what, table in (("op", OPS), ("task kind", KINDS)) if name in table]
        if name in CUSTOM or taken:
            raise RegistrationError(
                f"{' and '.join(taken) or 'op'} {name!r} is already registered",
                hint="pick another name; each op is registered once per process",
            )
        op = CustomOp(
            name,
            fn,
            shape=shape,
            whole_rows=whole_rows,
            tile_rows=tile_rows,
            flops=flops,
            triton=triton,
        )
        CUSTOM[name] = op
        return op

    return make if reference is None else make(reference)
