"""The Tracer: captured nodes + a parallel plan -> OpGraph, deciding every tensor's layout.

Layouts propagate like DTensor placements on a 1-D mesh of all ranks. Program inputs and
parameters are free (bound as each consumer asks). An op follows the layout of its main input,
except where the plan says otherwise: a planned linear (colwise/rowwise), and the inputs that
enter a SequenceParallel or ContextParallel region, which are requested sharded along the tokens.
Whenever a requested layout differs from the one a value has, the lowering inserts resharding
tasks, so a layout decision here never makes a program wrong, only faster or slower.

Op mapping lives in aten.py (one handler per ATen op family) and modules.py (leaf modules and
user-registered ops); this module holds the state they share.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from ..errors import DTypeError, MgraphError, UnsupportedOpError
from ..graph import dtype_name, torch_dtype
from ..layout import (
    Layout,
    canonical,
    check_layout,
)
from ..plans import ContextParallel, ParallelStyle, SequenceParallel
from ..topology import Topology
from .capture import Captured, CNode
from .fold import Folded, fold
from .opgraph import OpGraph, OpNode, ParamSource, Value

__all__ = ["Tracer"]


class Tracer:
    def __init__(
        self,
        module: nn.Module,
        captured: Captured,
        plan: dict[str, ParallelStyle],
        topology: Topology,
        dtype: str,
    ) -> None:
        self.module = module
        self.cap = captured
        self.plan = plan
        self.topo = topology
        self.world = topology.world_size
        self.dtype = dtype
        self.og = OpGraph(type(module).__name__, topology, dtype, single_output=captured.single)
        self.og.constants = dict(captured.constants)
        self.env: dict[CNode, Any] = {}
        self.params: dict[tuple[str, str], Value] = {}
        self.node_path: dict[str, str] = {}  # value name -> module path of its producer
        self.relayouts: dict[str, OpNode] = {}  # value name -> relayout node producing it
        self.names: set[str] = set()
        # Buffers and lifted constants: fixed state that constant folding may read.
        self.fixed: dict[str, torch.Tensor] = dict(module.named_buffers(remove_duplicate=False))
        self.fixed.update(captured.constants)
        self.consts: dict[CNode, Any] = {}
        self.regions = sorted(
            ((p, s) for p, s in plan.items() if isinstance(s, (SequenceParallel, ContextParallel))),
            key=lambda ps: -len(ps[0]),
        )

    # -- driver -------------------------------------------------------------------------------
    def run(self) -> OpGraph:
        from . import eager_attention
        from .mapping import load_handlers

        handlers = load_handlers()
        outputs = set(self.cap.outputs)
        # Hand-written attention (matmul, softmax, matmul) is one attention node: its inner
        # nodes are skipped, its last matmul emits it.
        eager = eager_attention.find(self.cap)
        absorbed = {c for match in eager.values() for c in match.nodes}
        for n in self.cap.nodes:
            if n.op == "input":
                if n.dtype == torch.bool:  # an attention mask (see attention_map.py)
                    v = Value(n.name, n.shape, self.dtype, None, "input", encoding="bool_mask")
                elif n.dtype is not None and not n.dtype.is_floating_point:
                    raise DTypeError(
                        f"{self.og.name}: input {n.name!r} is {n.dtype}; a program's inputs are "
                        f"{self.dtype} activations, or boolean attention masks",
                        hint="token ids: embed them outside and pass the embeddings; a padding "
                        "or attention mask: pass it as torch.bool (True = a real token / attend)",
                    )
                else:
                    v = Value(n.name, n.shape, self._dtype(n), None, "input")
                self.names.add(n.name)
                self.og.inputs.append(v)
                self.env[n] = v
                continue
            if n.op == "param" or (not n.users and n not in outputs) or n in absorbed:
                continue  # parameters are made per use; dead code never runs
            if n.fn is not None:
                folded = fold(n, self.env, self.fixed)
                if folded is not None:
                    self.env[n] = folded
                    continue
            handler = handlers.get(n.op)
            if n in eager:
                handler = functools.partial(eager_attention.emit, match=eager[n])
            if handler is None and n.op.startswith("custom:"):
                handler = handlers["custom"]
            if handler is None:
                raise _unsupported(n)
            if n.shape is not None and n.dtype != torch.bool:  # bool: masks, checked by use
                self._dtype(n)
            try:
                self.env[n] = handler(self, n)
            except MgraphError:
                raise  # already named (a DTypeError is also a TypeError)
            except (TypeError, IndexError, KeyError, AttributeError) as e:
                # An argument form the handler does not know (a list where it expects an int,
                # a missing keyword): name the op rather than fail inside mgraph.
                raise UnsupportedOpError(
                    f"{n.where()}: mgraph cannot map this call's arguments ({type(e).__name__}: {e})",
                    hint="rewrite the call in a more common form, or register an op for it",
                ) from e
        for out in self.cap.outputs:
            v = self.env.get(out) if isinstance(out, CNode) else None
            if isinstance(out, CNode) and (out.op == "param" or isinstance(v, Folded)):
                v = self.value(out)
            if not isinstance(v, Value):
                raise UnsupportedOpError(
                    f"{self.og.name}: output {out!r} is not a tensor computed by the module",
                    hint="return tensors (a single one or a tuple)",
                )
            self.og.outputs.append(v)
        return self.og

    def _dtype(self, n: CNode) -> str:
        name = dtype_name(n.dtype)
        if n.op not in ("input", "param") and name == "float32" and self.dtype in (
            "bfloat16", "float16"
        ):
            # Model code in bf16 upcasts around its numerically touchy steps (transformers'
            # RMSNorm, softmax(dtype=float32), rotary tables) and casts back after: casts are
            # identities here, the fused bodies compute in float32 inside a task, and values
            # between tasks are stored at the program's dtype.
            return self.dtype
        if name != self.dtype:
            raise DTypeError(
                f"{n.where()} is {name}, the program computes in {self.dtype}",
                hint="cast the module and its inputs to one dtype before mg.compile",
            )
        return name

    # -- values -------------------------------------------------------------------------------
    def value(self, arg: Any) -> Any:
        """The Value of a captured tensor (a parameter as stored), or the python constant."""
        if isinstance(arg, CNode):
            if arg.op == "param":
                return self.param(arg)
            v = self.env[arg]
            return self.constant(arg, v) if isinstance(v, Folded) else v
        return arg

    def folded(self, arg: Any) -> torch.Tensor | None:
        """The trace-time tensor of a constant argument (folded, or a buffer), else None."""
        if not isinstance(arg, CNode):
            return None
        if arg.op == "param":
            return self.fixed.get(arg.fqn)
        v = self.env.get(arg)
        return v.value if isinstance(v, Folded) and isinstance(v.value, torch.Tensor) else None

    def constant(self, n: CNode, folded: Folded) -> Any:
        """A folded tensor as the program reads it: a python number when 0-d, else a constant
        of the program bound like a parameter."""
        if n in self.consts:
            return self.consts[n]
        t = folded.value
        if isinstance(t, torch.Tensor) and t.dim() == 0:
            v: Any = t.item()
        elif not isinstance(t, torch.Tensor):
            raise UnsupportedOpError(f"{n.where()}: a constant {type(t).__name__} used as a tensor")
        elif t.dtype != torch_dtype(self.dtype):
            raise DTypeError(
                f"{n.where()} is a {t.dtype} constant computed in forward; the program computes "
                f"in {self.dtype}",
                hint="cast it to the activations' dtype (.to(x.dtype)), or use it only as an "
                "attention mask",
            )
        else:
            name = self.unique(f"const.{n.name}")
            self.og.constants[name] = t.detach().contiguous()
            v = Value(name, tuple(t.shape), self.dtype, None, "param", source=ParamSource((name,)))
            self.og.params.append(v)
        self.consts[n] = v
        return v

    def tensor(self, n: CNode, arg: Any, what: str, empty_ok: bool = False) -> Value:
        """``arg``'s Value; ``empty_ok``: also an empty one (an empty slice: slicing.slice_of),
        which only cat, skipping it, may read."""
        v = self.value(arg)
        if not isinstance(v, Value):
            raise UnsupportedOpError(f"{n.where()}: {what} must be a tensor, got {v!r}")
        if v.kind == "empty" and not empty_ok:
            raise UnsupportedOpError(
                f"{n.where()}: {what} is an empty tensor of shape {list(v.shape)} (an empty "
                "slice); only torch.cat, which skips it, may read one"
            )
        return v

    def param(self, c: CNode, transform: str = "none") -> Value:
        """A parameter (or buffer, or lifted constant) as a free global input of the program."""
        key = (c.fqn, transform)
        v = self.params.get(key)
        if v is None:
            shape = tuple(c.shape)
            if transform == "t":
                shape = (shape[1], shape[0])
            name = self.unique(c.fqn if transform == "none" else f"{c.fqn}.T")
            self._dtype(c)
            v = Value(
                name, shape, self.dtype, None, "param", source=ParamSource((c.fqn,), transform)
            )
            self.params[key] = v
            self.og.params.append(v)
        return v

    def stacked(
        self, name: str, fqns: Sequence[str], shape: tuple[int, ...], transform: str = "stack_t"
    ) -> Value:
        """A parameter built from module tensors that are not graph inputs (leaf modules)."""
        source = ParamSource(tuple(fqns), transform)
        v = Value(self.unique(name), shape, self.dtype, None, "param", source=source)
        self.og.params.append(v)
        return v

    # -- plan regions -------------------------------------------------------------------------
    def region(self, n: CNode) -> tuple[str, ParallelStyle] | None:
        """The innermost SequenceParallel/ContextParallel module ``n`` runs in."""
        for path, style in self.regions:
            if path == "" or path in n.paths:
                return path, style
        return None

    def _inside(self, v: Value, path: str) -> bool:
        root = v.root()
        if root.free:
            return False
        produced = self.node_path.get(root.name, "")
        return path == "" or produced == path or produced.startswith(path + ".")

    def layout_in(self, v: Value, n: CNode) -> Layout | None:
        """The layout ``n`` reads its main input ``v`` in (None: free, any layout)."""
        region = self.region(n)
        if region is not None and not self._inside(v, region[0]):
            return self.region_layout(region, v.shape, n)
        return None if v.root().free and v.layout is None else v.layout

    def region_layout(self, region: tuple[str, ParallelStyle], shape: Sequence[int], n: CNode):
        path, style = region
        nd = len(shape)
        if isinstance(style, SequenceParallel):
            dim, zigzag = (style.sequence_dim if nd >= 3 else 0), False
        else:
            dim = style.seq_dim if style.seq_dim is not None else {3: 1, 4: 2}.get(nd, 0)
            zigzag = self.causal(path)
        if not -nd <= dim < nd:
            raise UnsupportedOpError(
                f"plan {path or '<root>'!r} {type(style).__name__}: sequence dim {dim} is out of "
                f"range for the {nd}-D input of {n.where()}",
                hint="set sequence_dim / seq_dim to the dim that indexes tokens",
            )
        layout = Layout("shard", dim % nd, zigzag)
        check_layout(
            shape,
            layout,
            self.world,
            f"plan {path or '<root>'!r} {type(style).__name__}",
            f"the sequence length must be a multiple of {(2 if zigzag else 1) * self.world}",
        )
        return canonical(shape, layout, self.world)

    def causal(self, path: str) -> bool:
        """Whether a ContextParallel module's attention is causal (then the layout zigzags)."""
        for n in self.cap.nodes:
            if n.op == "scaled_dot_product_attention" and (path == "" or path in n.paths):
                if n.arg(5, "is_causal", False):
                    return True
        return False

    # -- emitting -----------------------------------------------------------------------------
    def unique(self, name: str) -> str:
        base, k = name, 1
        while name in self.names:
            name = f"{base}_{k}"
            k += 1
        self.names.add(name)
        return name

    def emit(
        self,
        n: CNode,
        op: str,
        params: dict[str, Any],
        inputs: dict[str, Value],
        shape: Sequence[int],
        layout: Layout,
        *,
        name: str | None = None,
        mask_math: bool = False,
    ) -> Value:
        """One OpNode. ``mask_math``: the op combines attention masks (masks.py), so it may
        read a boolean input's additive form, and its result is a mask too."""
        empty = [v for v in inputs.values() if v.kind == "empty"]
        if empty:
            raise UnsupportedOpError(
                f"{n.where()}: reads an empty tensor of shape {list(empty[0].shape)} (an empty "
                "slice); only torch.cat, which skips it, may read one"
            )
        self._check(n, op, params)
        encoded = [v for v in inputs.values() if (v.encoding or v.root().encoding)]
        if encoded and op not in ("attention", "relayout") and not mask_math:
            raise UnsupportedOpError(
                f"{n.where()}: reads the boolean input {encoded[0].root().name!r}; a boolean "
                "program input can only be an attention mask (SDPA's attn_mask, after views)",
                hint="pass a float tensor instead, or build the mask inside the module from "
                "shapes (torch.triu/arange), where it is folded at trace time",
            )
        name = self.unique(name or n.name)
        out = Value(
            name,
            tuple(shape),
            self.dtype,
            canonical(shape, layout, self.world),
            "op",
            producer=name,
        )
        if encoded and (op == "relayout" or mask_math):  # a moved mask is still a mask
            out.encoding = encoded[0].encoding or encoded[0].root().encoding
        node = OpNode(name, op, params, inputs, {"out": out}, n.path, n.target or n.op)
        self.og.nodes.append(node)
        self.node_path[name] = n.path
        return out

    def _check(self, n: CNode, op: str, params: dict[str, Any]) -> None:
        """The op's own shape rules, now, so a bad size is reported with the module code."""
        from ..ops import get_op

        opdef = get_op(op)
        full = json.loads(json.dumps({**opdef.options, **params}))
        try:
            opdef.check_params(self.topo, full)
        except MgraphError as e:
            raise type(e)(f"{n.where()}: {e.message}", hint=e.hint) from e

    def relayout(
        self,
        n: CNode,
        x: Value,
        step: tuple[str, tuple[int, ...]] | list[tuple[str, tuple[int, ...]]],
        *,
        shape: Sequence[int] | None = None,
        name: str | None = None,
        want: Layout | None = None,
    ) -> Value:
        """``x`` viewed, permuted, expanded or sliced (relayouts.py)."""
        from .relayouts import relayout

        return relayout(self, n, x, step, shape=shape, name=name, want=want)


def _unsupported(n: CNode) -> UnsupportedOpError:
    from .mapping import HANDLERS

    internal = {"custom", "leaf", "alias", "lift_fresh_copy", "feature_dropout"}
    known = sorted(k for k in HANDLERS if k not in internal and not k.startswith("_"))
    return UnsupportedOpError(
        f"{n.where()} has no mgraph op",
        hint="register one with @mg.register_op (README: 'Tracing modules and custom ops') and "
        f"call it in the module, or rewrite with supported ops: {', '.join(known)}",
    )
