"""Elementwise math: a chain of pointwise fns over tensors of one shape, run as ONE tile task.

``out = fn(x)`` or ``fn(x, y)`` (``y`` a tensor or a scalar) is a chain of one step; the tracer
fuses chains of pointwise ops (``silu(a) * b``, ``x * w + bias``, gelu, residual adds) into one
op (mgraph/trace/pointwise.py: fuse_pointwise), so a traced SwiGLU runs one ``ewise`` task per
row tile, not one per op. Layouts and operand forms are tilewise.py's: one compute task per row
tile in the layout of ``x``; other operands full, a row vector or one value per row.

Two more operand forms serve rotary embeddings (``q * cos + rotate_half(q) * sin``) without
relayouts:

- ``bcast:<d0>x<d1>x...``: a tensor of that N-D shape (the output's rank, last dim equal to the
  output's) that broadcasts to the output over one run of leading dims (``cos`` ``[1, 1, S, D]``
  or ``[B, 1, S, D]`` against ``[B, H, S, D]``). Each output row ``g`` (its flat global row)
  reads operand row ``(g // A) * M + g % M`` (:func:`row_map`); the task's ``row0`` param is
  the global row of its first row (its tiles never straddle two runs of the layout), and it
  reads the operand rows from ``lo`` on that its rows map to (whole periods of ``M`` when the
  tile wraps around one); a rank holds only the span of rows its tasks read. Broadcasts the map cannot express stay ``*_bcast`` relayouts.
- the step ``["rotate_half", a, -1, 0]`` (:data:`ROTATE`) reads input ``a`` rotated by half the
  last dim with the sign on the first half, ``cat((-x[..., D/2:], x[..., :D/2]), -1)``: a load
  of other columns, so ``a`` must be an input (not a step) and the tiles whole rows.
- ``gather:<json>`` (:func:`gather_form`): the result of a relayout (mgraph/ops/relayout.py:
  a head split ``x.view(B, S, H, D).transpose(1, 2)``) read from the relayout's SOURCE, so
  the relayout is no task of its own. The operand is the source tensor (its global shape
  flattened, held in the source's layout; the form's JSON names its shape, the steps and
  that layout); each task reads it through the relayout's gather map of its rows
  (relayout.tile_gathers: ``base`` and mixed-radix row and column digits, the ``g_*``
  params), from the box of the source buffer that the map reaches (its region). One such
  operand per chain (it may be ``x``: option ``x_form``); the op refuses one whose source
  layout does not hold every element a rank reads (ShapeError), and its lowering one whose
  map has no gather form on some tile. fuse_pointwise makes these forms.

A chain (option ``chain``) is a list of steps ``[fn, a, b, scalar]``: ``fn`` a key of
:data:`UNARY` or :data:`BINARY`; ``a`` and ``b`` name values: ``0..n-1`` the op's inputs
(``x``, then ``y``, ``y2``, ``y3``... whose forms ``operands`` lists), ``n + j`` the result of
step ``j``, ``-1`` the step's ``scalar``. A unary step reads ``a`` (``b`` is -1). The chain's
result is its last step. Math runs in fp32 and is stored once in the buffer dtype.

The task carries the chain as a small bytecode in its params row (see :func:`compile_chain`):
``nops``, ``result``, then four words per instruction ``(opcode, dst, a, b)`` over
:data:`REGISTERS` fp32 tile registers: ``LOAD dst <- read a``, ``ROT dst <- read a rotated``,
``CONST dst <- float b``, or a fn of registers ``a`` (and ``b``); then ``half`` (D/2 of a
rotation), ``maps`` (each input's map, 2 bits), ``row0`` and A, M, lo per map, then the gather map of a ``gather:``
operand (map code 3). The CPU body and the Triton body both interpret that
bytecode, so the reference runtime checks the compiler too; the op's reference (its meaning on
global tensors) evaluates the chain itself.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..builder import GraphBuilder
from ..errors import OptionError, ShapeError, UnknownNameError
from ..graph import Task
from ..kinds import Role, define_kind
from ..layout import canonical, flat_shape, layout_runs, runs_pieces
from ..topology import Topology
from .abi import HAVE_TRITON
from .elementwise_operands import (
    GATHER,
    MAPS,
    _gathers,
    _tiles,
    bcast_form,
    bcast_shape,
    gather_fits,
    gather_form,
    gather_spec,
    operand_maps,
    row_map,
)
from .registry import OpDef
from .relayout import (
    _GPU_PARAMS,
    apply_steps,
    relayout_feasible,
    steps_shape,
)
from .tilewise import lower_tilewise, parse_layout, parse_shape, tile_shapes

__all__ = [
    "elementwise",
    "UNARY",
    "BINARY",
    "MAX_OPS",
    "REGISTERS",
    "compile_chain",
    "run_chain",
    "single_chain",
    "input_names",
    "ROTATE",
    "row_map",
    "operand_maps",
    "gather_form",
    "gather_spec",
    "gather_fits",
    "bcast_form",
]

elementwise = OpDef("elementwise", dims=("rows", "cols"), inputs=("x", "y"), outputs=("out",))

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

# Opcodes: the fns (unary first, then binary: _ewise_math switches on these indices), then the
# two data instructions. Appending keeps old codes valid; the Triton body must follow.
CODES: tuple[str, ...] = (*UNARY, *BINARY)
LOAD, CONST = len(CODES), len(CODES) + 1
# rotate_half is a load (of other columns), not a fn of a register: it reads an input only, and
# the bodies run it as their loads do. Not in UNARY, so the fns' codes above stay unchanged.
ROTATE = "rotate_half"
ROT = CONST + 1
# MAPS broadcast row maps per chain, the GATHER map code: elementwise_operands.py.
MAP_PARAMS = tuple(f"map{k}_{f}" for k in range(1, MAPS + 1) for f in ("a", "m", "lo"))
# A gather operand's tile map (relayout's GPU params: base, row digits, column digits).
G_PARAMS = tuple(f"g_{name}" for name in _GPU_PARAMS)
# Sizes of the bytecode: the params row is fixed per kind (2 + 4 * MAX_OPS int32 words), the
# registers are the Triton body's loop-carried tiles. A chain that needs more is not fused
# further (fuse_pointwise) or refused (an OptionError from the op's shape check).
MAX_OPS = 16
REGISTERS = 6
WORDS = tuple(f"w{i}" for i in range(4 * MAX_OPS))

EWISE = define_kind(
    "ewise",
    [Role.COMPUTE],
    "a chain of elementwise fns over one row tile (params: its bytecode)",
    params=("nops", "result", *WORDS, "half", "maps", "row0", *MAP_PARAMS, *G_PARAMS),
)
# A chain without rotation or broadcast operands leaves these out of its tasks' params.
EWISE.param_defaults = {"half": 0, "maps": 0, "row0": 0, **dict.fromkeys(MAP_PARAMS, 1)}
for _k in range(1, MAPS + 1):
    EWISE.param_defaults[f"map{_k}_lo"] = 0
# no gather operand: radices 1, strides 0 (never read)
EWISE.param_defaults.update({n: int(n.endswith("n")) for n in G_PARAMS})

Step = list  # [fn, a, b, scalar]


# Elements a traced elementwise task covers: a narrow op (RoPE over 128-column head rows) in
# 64-row tiles made 2,560 tasks of 64 KiB each in the Llama layer, each paying the megakernel's
# per-task cost (~9 us) for ~1 us of memory traffic; a wide one (SwiGLU over 14336 columns)
# made 64 tasks of 5.5 MiB for 132 programs, half of them idle (benchmarks/NOTES.md v12).
TRACED_TILE_ELEMS = 1 << 16


def traced_tile_rows(cols: int) -> int:
    """Row tile of a traced elementwise op of ``cols`` columns: a power of two from 16 to 1024
    rows, about TRACED_TILE_ELEMS elements a task (16 rows, one block of the generated code's,
    for rows of 4096 columns and wider)."""
    rows = 1 << max(0, (TRACED_TILE_ELEMS // max(1, int(cols))).bit_length() - 1)
    return max(16, min(1024, rows))


def input_names(n: int) -> list[str]:
    """The op's input names for ``n`` inputs: x, y, y2, y3, ..."""
    return ["x", "y", *(f"y{i}" for i in range(2, n))][:n]


def single_chain(
    fn: str, has_other: bool, scalar: float | None, alpha: float, swap: bool
) -> list[Step]:
    """The chain of ``fn(x)``, ``fn(x, alpha * y)`` or ``fn(x, alpha * scalar)`` (operands
    swapped when ``swap``)."""
    if not has_other and scalar is None:
        return [[fn, 0, -1, 0.0]]
    if not has_other:
        s = float(scalar) * alpha  # type: ignore[arg-type]
        return [[fn, -1, 0, s] if swap else [fn, 0, -1, s]]
    steps: list[Step] = []
    other = 1
    if alpha != 1.0:
        steps.append(["mul", 1, -1, float(alpha)])
        other = 2  # 2 inputs, then step 0
    steps.append([fn, other, 0, 0.0] if swap else [fn, 0, other, 0.0])
    return steps


def _check_chain(chain: Sequence, nin: int) -> None:
    """OptionError (or UnknownNameError for a fn) unless ``chain`` is a valid chain over
    ``nin`` inputs that fits the bytecode."""
    if not chain:
        raise OptionError(
            "elementwise: option chain=[] has no step",
            hint="a chain is a list of [fn, a, b, scalar] steps",
        )
    for j, step in enumerate(chain):
        if (
            not isinstance(step, (list, tuple))
            or len(step) != 4
            or not isinstance(step[0], str)
            or any(isinstance(r, bool) or not isinstance(r, int) for r in step[1:3])
            or isinstance(step[3], bool)
            or not isinstance(step[3], (int, float))
        ):
            raise OptionError(
                f"elementwise: chain step {j} is {step!r}",
                hint="each step is [fn, a, b, scalar] (a, b ints; scalar a number)",
            )
        fn, a, b, _ = step
        if fn == ROTATE:
            if not 0 <= a < nin or b != -1:
                raise OptionError(
                    f"elementwise: chain step {j} rotates value {a}: {ROTATE} reads an input "
                    f"(0..{nin - 1}), with b = -1",
                    hint="rotate_half is a load of other columns: it applies to an op input only",
                )
            continue
        if fn not in UNARY and fn not in BINARY:
            raise UnknownNameError(
                f"elementwise: chain step {j} has unknown fn {fn!r}; valid: "
                f"{', '.join(sorted(UNARY) + sorted(BINARY) + [ROTATE])}"
            )
        refs = (a,) if fn in UNARY else (a, b)
        for r in refs:
            if not -1 <= r < nin + j:
                raise OptionError(
                    f"elementwise: chain step {j} reads value {r}, which is not an input "
                    f"(0..{nin - 1}), an earlier step ({nin}..{nin + j - 1}) or the scalar (-1)"
                )
        if refs.count(-1) == len(refs):
            raise OptionError(f"elementwise: chain step {j} ({fn}) reads no tensor")
        if fn in UNARY and b != -1:
            raise OptionError(f"elementwise: chain step {j}: unary {fn} takes b = -1, got {b}")
    compile_chain(chain, nin)


def compile_chain(
    chain: Sequence[Step], nin: int, maps: Sequence[int] = ()
) -> dict[str, int | float]:
    """The ``ewise`` params of ``chain`` over ``nin`` inputs: its bytecode, registers allocated
    in one pass (an input is loaded at its first use, a register is reused after its value's
    last use); ``maps``: each input's broadcast map code (operand_maps), packed 2 bits per
    input into ``maps``. A ``rotate_half`` step is one ROT instruction (``ROT dst <- read a
    rotated``). OptionError when the chain needs more than MAX_OPS instructions or REGISTERS
    registers, or rotates a value that is not an input."""
    last_use: dict[int, int] = {}
    for j, (fn, a, b, _) in enumerate(chain):
        if fn == ROTATE:
            if not 0 <= a < nin:
                raise OptionError(
                    f"elementwise: chain step {j} rotates value {a}, which is not an input",
                    hint="rotate_half is a load of other columns: it applies to an op input only",
                )
            continue  # read from memory by its ROT, not from a register
        for r in (a,) if fn in UNARY else (a, b):
            if r >= 0:
                last_use[r] = j
    last_use[nin + len(chain) - 1] = len(chain)  # the result lives to the store
    free = list(range(REGISTERS))
    reg: dict[int, int] = {}
    code: list[tuple[int, int, int, int | float]] = []

    def take() -> int:
        if not free:
            raise OptionError(
                f"elementwise: the chain needs more than {REGISTERS} live tile registers",
                hint="split the chain into several elementwise ops",
            )
        return free.pop(0)

    for j, (fn, a, b, s) in enumerate(chain):
        if fn == ROTATE:
            dst = take()
            code.append((ROT, dst, a, 0))
            reg[nin + j] = dst
            continue
        refs = (a,) if fn in UNARY else (a, b)
        regs, temps = [], []
        for r in refs:
            if r == -1:
                t = take()
                code.append((CONST, t, 0, float(s)))
                regs.append(t)
                temps.append(t)
            else:
                if r not in reg:  # an input, first used here
                    reg[r] = take()
                    code.append((LOAD, reg[r], r, 0))
                regs.append(reg[r])
        for r in set(refs):  # values read for the last time: their registers are free again
            if r >= 0 and last_use[r] == j:
                free.insert(0, reg.pop(r))
        free[:0] = temps
        dst = take()
        code.append((CODES.index(fn), dst, regs[0], regs[1] if len(regs) > 1 else 0))
        reg[nin + j] = dst
    if len(code) > MAX_OPS:
        raise OptionError(
            f"elementwise: the chain compiles to {len(code)} instructions, more than {MAX_OPS}",
            hint="split the chain into several elementwise ops",
        )
    params: dict[str, int | float] = {"nops": len(code), "result": reg[nin + len(chain) - 1]}
    for k in range(MAX_OPS):
        op, dst, a, b = code[k] if k < len(code) else (0, 0, 0, 0)
        params.update(
            {WORDS[4 * k]: op, WORDS[4 * k + 1]: dst, WORDS[4 * k + 2]: a, WORDS[4 * k + 3]: b}
        )
    packed = sum(c << (2 * k) for k, c in enumerate(maps))
    if packed:
        params["maps"] = packed
    return params


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def run_chain(chain: Sequence[Step], inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The chain's meaning on fp32 tensors (broadcasting like torch): its last step's value."""
    values = list(inputs)
    for fn, a, b, s in chain:
        if fn == ROTATE:
            values.append(_rotate_half(values[a]))
            continue
        scalar = torch.tensor(float(s), dtype=torch.float32)
        x = scalar if a == -1 else values[a]
        values.append(
            UNARY[fn](x) if fn in UNARY else BINARY[fn](x, scalar if b == -1 else values[b])
        )
    return values[-1]


def _chain_of(
    fn: str,
    other: str | None,
    scalar: float | None,
    alpha: float,
    swap: bool,
    chain: list | None,
    operands: list[str] | None,
) -> tuple[list[Step], list[str]]:
    """(chain, forms of the inputs after x) of the op's options."""
    if chain is not None:
        forms = list(operands or [])
        _check_chain(chain, 1 + len(forms))
        return [list(s) for s in chain], forms
    binary = other is not None or scalar is not None
    if fn not in (BINARY if binary else UNARY):
        raise UnknownNameError(
            f"elementwise: unknown {'binary' if binary else 'unary'} fn {fn!r}; valid: "
            f"{', '.join(sorted(BINARY if binary else UNARY))}",
            hint="a binary fn needs other= (a tensor operand) or scalar=",
        )
    return single_chain(fn, other is not None, scalar, alpha, swap), [] if other is None else [
        other
    ]


def _nd(rows: int, cols: int, shape: Sequence[int] | None) -> tuple[int, ...]:
    return (rows, cols) if shape is None else tuple(int(d) for d in shape)


def _check_forms(
    topology: Topology,
    rows: int,
    cols: int,
    steps: list[Step],
    forms: list[str],
    shape: Sequence[int] | None,
    layout: Sequence | None,
) -> None:
    """ShapeError for a broadcast operand that does not broadcast to the op's shape, a gather
    operand whose steps do not make it or whose source layout does not hold what a rank reads,
    or a rotation the tiles cannot hold (an odd last dim, or one split over the ranks).
    ``forms``: every input's, ``x`` first."""
    nd = _nd(rows, cols, shape)
    for form in forms:
        spec = gather_spec(form)
        if spec is not None:
            _check_gather(topology, spec, nd, layout)
        b = bcast_shape(form)
        if b is None:
            continue
        try:
            row_map(b, nd)
        except ValueError as e:
            raise ShapeError(
                f"elementwise: operand form {form!r}: {e}",
                hint="a bcast operand has the op's rank and last dim, and broadcasts over one "
                "run of leading dims",
            ) from None
    if any(step[0] == ROTATE for step in steps):
        lay = parse_layout(layout)
        if cols % 2 or (lay.kind == "shard" and lay.dim % len(nd) == len(nd) - 1):
            raise ShapeError(
                f"elementwise: {ROTATE} needs whole rows of an even width; cols={cols}, "
                f"layout {lay.to_json()}",
                hint="replicate the input, or shard it along another dim",
            )
    operand_maps(forms, nd)


def _check_gather(topology: Topology, spec: tuple, nd: tuple, layout: Sequence | None) -> None:
    shape, steps, src = spec
    if steps_shape(shape, steps) != nd:
        raise ShapeError(
            f"elementwise: a gather operand's steps make {list(steps_shape(shape, steps))} "
            f"from {list(shape)}, not the op's shape {list(nd)}",
            hint="the steps are the relayout's, from its source to the op's operand",
        )
    world = topology.world_size
    dst = canonical(nd, parse_layout(layout), world)
    if not relayout_feasible(shape, steps, src, dst, world):
        raise ShapeError(
            f"elementwise: a gather operand held as {src.describe()} of {list(shape)} lacks "
            f"elements the op's ranks ({dst.describe()} of {list(nd)}) read",
            hint="keep the relayout as its own op",
        )


def _global_shape(form: str, rows: int, cols: int) -> tuple[int, int]:
    b = bcast_shape(form)
    if b is not None:
        return (math.prod(b[:-1]), cols)
    spec = gather_spec(form)
    if spec is not None:
        return flat_shape(spec[0])
    return {"full": (rows, cols), "row": (1, cols), "col": (rows, 1)}[form]


@elementwise.shapes
def _shapes(
    topology: Topology,
    rows: int,
    cols: int,
    fn: str = "add",
    other: str | None = None,
    scalar: float | None = None,
    alpha: float = 1.0,
    swap: bool = False,
    chain: list | None = None,
    operands: list[str] | None = None,
    shape: Sequence[int] | None = None,
    layout: Sequence | None = None,
    x_form: str = "full",
    **_: object,
) -> dict[str, tuple]:
    steps, forms = _chain_of(fn, other, scalar, alpha, swap, chain, operands)
    if x_form != "full" and gather_spec(x_form) is None:
        raise OptionError(
            f"elementwise: x_form={x_form!r}", hint="x is 'full' or a gather: operand"
        )
    names = input_names(1 + len(forms))
    plain = {n: ("full" if ":" in f else f) for n, f in zip(names[1:], forms, strict=True)}
    out = tile_shapes("elementwise", topology, rows, cols, shape, layout, plain)
    _check_forms(topology, rows, cols, steps, [x_form, *forms], shape, layout)
    for n, f in zip(names, [x_form, *forms], strict=True):
        out[n] = _global_shape(f, rows, cols)
    return out


@elementwise.reference
def _reference(
    x: torch.Tensor,
    fn: str = "add",
    other: str | None = None,
    scalar: float | None = None,
    alpha: float = 1.0,
    swap: bool = False,
    chain: list | None = None,
    operands: list[str] | None = None,
    shape: Sequence[int] | None = None,
    x_form: str = "full",
    **kw: Any,
) -> dict[str, torch.Tensor]:
    steps, forms = _chain_of(fn, other, scalar, alpha, swap, chain, operands)
    names = input_names(1 + len(forms))
    spec = gather_spec(x_form)
    if spec is not None:  # the relayout's result, in the op's flat shape
        x = apply_steps(x.reshape(spec[0]), spec[1]).reshape(flat_shape(steps_shape(*spec[:2])))
    tensors = [x.float()]
    for n, form in zip(names[1:], forms, strict=True):
        t = kw[n].float()
        b, spec = bcast_shape(form), gather_spec(form)
        if b is not None:  # the operand's rows each output row reads, as the tasks map them
            a, m = row_map(b, _nd(*x.shape, shape))
            g = torch.arange(x.shape[0])
            t = t[(g // a) * m + g % m]
        elif spec is not None:
            t = apply_steps(t.reshape(spec[0]), spec[1]).reshape(x.shape)
        tensors.append(t)
    return {"out": run_chain(steps, tensors).expand(x.shape).to(x.dtype)}


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
    chain: list | None = None,
    operands: list[str] | None = None,
    shape: list[int] | None = None,
    layout: list | None = None,
    tile_rows: int = 64,
    x_form: str = "full",
) -> None:
    steps, forms = _chain_of(fn, other, scalar, alpha, swap, chain, operands)
    names = input_names(1 + len(forms))
    codes, maps = operand_maps([x_form, *forms], _nd(rows, cols, shape))
    params = compile_chain(steps, 1 + len(forms), codes)
    if any(step[0] == ROTATE for step in steps):
        params["half"] = cols // 2
    label = "*".join(s[0] for s in steps) if chain is not None else fn
    if not any(codes):
        lower_tilewise(
            b,
            EWISE.name,
            rows=rows,
            cols=cols,
            shape=shape,
            layout=layout,
            operands=dict(zip(names[1:], forms, strict=True)),
            params=params,
            tile_rows=tile_rows,
            label=label,
        )
        return
    for k, (a, m) in enumerate(maps, start=1):
        params[f"map{k}_a"], params[f"map{k}_m"] = a, m
    forms_of = dict(zip(names, [x_form, *forms], strict=True))
    _lower_mapped(b, rows, cols, shape, layout, forms_of, params, maps, codes, tile_rows, label)


def _lower_mapped(
    b: GraphBuilder,
    rows: int,
    cols: int,
    shape: Sequence[int] | None,
    layout: Sequence | None,
    forms: dict[str, str],
    params: dict[str, Any],
    maps: list[tuple[int, int]],
    codes: list[int],
    tile_rows: int,
    label: str,
) -> None:
    """tilewise.lower_tilewise for chains with broadcast or gather operands: a task's rows lie
    in one run of the layout, so that ``row0``, the global row of its first row, maps them
    all; each rank holds the span of a broadcast operand's rows that its tasks read (only its
    columns of a column-sharded ``x``), each task's region the window of its own rows. A
    gather operand is bound in its source's layout, each task's region the box its map
    reaches, its map in the task's ``g_*`` params. ``forms``: every input's, ``x`` first."""
    if isinstance(tile_rows, bool) or not isinstance(tile_rows, int) or tile_rows <= 0:
        raise ShapeError(f"elementwise: tile_rows={tile_rows!r} must be a positive int")
    nd = parse_shape("elementwise", rows, cols, shape)
    lay = parse_layout(layout)
    for name, form in forms.items():
        b.global_input(name, _global_shape(form, rows, cols))
    b.global_output("out", (rows, cols))
    for r in b.topo.ranks:
        runs = layout_runs(nd, lay, r, b.world)
        tiles = _tiles(nd, lay, r, b.world, tile_rows)
        windows = [[_window(*m, g0, g0 + n) for m in maps] for _, g0, n in tiles]
        spans = [
            (min(w[k][0] for w in windows), max(w[k][1] for w in windows)) for k in range(len(maps))
        ]
        c0, c1 = runs[0][2], runs[0][3]
        reads: list[tuple[Any, str]] = []
        gather: Any = None
        for (name, form), code in zip(forms.items(), codes, strict=True):
            if code == GATHER:
                src_shape, _, src = gather_spec(form)  # type: ignore[misc]
                pieces = runs_pieces(layout_runs(src_shape, src, r, b.world))
                gather = _gathers(form, tuple(nd), lay, r, b.world, tiles)
                if gather is None:
                    raise ShapeError(
                        f"elementwise: operand {name}'s relayout map has no gather form on "
                        f"some tile of rank {r} (tile_rows={tile_rows})",
                        hint="keep the relayout as its own op (fuse_pointwise does where the "
                        "map does not fit)",
                    )
            elif form == "full":
                pieces = runs_pieces(runs)
            elif form == "col":
                pieces = tuple(((r0, r1), (0, 1)) for r0, r1, _, _ in runs)
            elif code:
                pieces = ((spans[code - 1], (c0, c1)),)
            else:
                pieces = (((0, 1), (c0, c1)),)
            reads.append((b.bound_buffer(name, r, name, pieces), form))
        out = b.bound_buffer("out", r, "out", runs_pieces(runs), role="output")
        if gather is not None:  # G's range and F's columns (by buffer width), once a rank
            g_range = (int(gather[2].min()), int(gather[2].max()))
            f_cols_of: dict[int, torch.Tensor] = {}
        for i, ((t0, g0, n), window) in enumerate(zip(tiles, windows, strict=True)):
            task_params = {**params, "row0": g0}
            for k, (lo, _) in enumerate(window, start=1):
                task_params[f"map{k}_lo"] = lo
            regions = []
            for (buf, form), code in zip(reads, codes, strict=True):
                if code == GATHER:
                    fits, f_rows, _ = gather
                    width = buf.cols
                    task_params.update(fits[i], gather_cols=width)
                    f_cols = f_cols_of.get(width)
                    if f_cols is None:
                        f_cols = f_cols_of[width] = f_rows % width
                    box = _gather_box(f_rows[t0 : t0 + n], f_cols[t0 : t0 + n], *g_range, width)
                    regions.append(buf.region(*box))
                elif code:  # the window, in the buffer's rows (it holds the span from its start)
                    (lo, hi), first = window[code - 1], spans[code - 1][0]
                    regions.append(buf.region((lo - first, hi - first)))
                elif form == "row":
                    regions.append(buf.region())
                else:
                    regions.append(buf.region((t0, t0 + n)))
            b.task(
                r,
                Role.COMPUTE,
                EWISE.name,
                regions,
                [out.region((t0, t0 + n))],
                name=f"{label} r{r} [{t0}:{t0 + n}]",
                params=task_params,
            )


def _gather_box(
    f_rows: torch.Tensor, f_cols: torch.Tensor, g_lo: int, g_hi: int, width: int
) -> tuple:
    """(rows, cols) of the box of a buffer ``width`` wide that positions F[i] + G[j] reach
    (``f_cols``: F % width; ``g_lo``, ``g_hi``: G's least and greatest): exact when no row of
    the tile wraps past the buffer's width, else whole buffer rows. Two reductions a tile
    (F // width's least and greatest are F's, divided): a 2x8 layer's rope has 256 tiles of
    512 rows, and torch's per-call cost, not the rows, dominated."""
    lo, hi = (int(v) for v in torch.aminmax(f_rows))
    c_lo, c_hi = (int(v) for v in torch.aminmax(f_cols))
    if c_hi + g_hi < width:
        return (lo // width, hi // width + 1), (c_lo + g_lo, c_hi + g_hi + 1)
    return ((lo + g_lo) // width, (hi + g_hi) // width + 1), None


def _window(a: int, m: int, g0: int, g1: int) -> tuple[int, int]:
    """The operand rows ``[lo, hi)`` that output rows ``[g0, g1)`` read through map ``(a, m)``:
    one contiguous run, unless the tile wraps around ``m`` (then the whole periods it
    touches)."""
    if g0 // a == (g1 - 1) // a and g0 % m + (g1 - g0) <= m:
        lo = (g0 // a) * m + g0 % m
        return lo, lo + (g1 - g0)
    return (g0 // a) * m, ((g1 - 1) // a) * m + m


def _digit_values(p: dict, axis: str, i: torch.Tensor) -> torch.Tensor:
    """sum over the ``g_`` map's digits of ``((i // div_k) % radix_k) * stride_k`` (axis "r"
    or "c"), as the Triton body's relayout._digit_sum."""
    out = torch.zeros_like(i)
    for k in range(len(G_PARAMS) // 4):
        n, s = p[f"g_{axis}{k}n"], p[f"g_{axis}{k}s"]
        out += (i % n) * s
        i = i // n
    return out


@EWISE.cpu
def _ewise_cpu(task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    """Interprets the task's bytecode, as the Triton body does."""
    p = task.params
    maps, (rows, cols) = int(p.get("maps", 0)), writes[0].shape

    def load(a: int) -> torch.Tensor:
        t = reads[a].float()
        code = (maps >> (2 * a)) & 3
        if code == GATHER:  # the relayout's map: flat positions in the source buffer
            pos = p["g_base"] + (
                _digit_values(p, "r", torch.arange(rows))[:, None]
                + _digit_values(p, "c", torch.arange(cols))[None, :]
            )
            width, box = p["gather_cols"], task.reads[a]
            return t[pos // width - box.row0, pos % width - box.col0]
        if code:  # a broadcast operand: the rows the task's rows map to, from its region's lo
            g = torch.arange(p["row0"], p["row0"] + rows)
            a, m = p[f"map{code}_a"], p[f"map{code}_m"]
            t = t[(g // a) * m + g % m - p[f"map{code}_lo"]]
        return t

    regs: list[Any] = [None] * REGISTERS
    for k in range(p["nops"]):
        op, dst, a, b = (p[WORDS[4 * k + i]] for i in range(4))
        if op == LOAD:
            regs[dst] = load(a)
        elif op == ROT:
            regs[dst] = _rotate_half(load(a))
        elif op == CONST:
            regs[dst] = torch.tensor(float(b), dtype=torch.float32)
        elif CODES[op] in UNARY:
            regs[dst] = UNARY[CODES[op]](regs[a])
        else:
            regs[dst] = BINARY[CODES[op]](regs[a], regs[b])
    writes[0].copy_(regs[p["result"]].expand(writes[0].shape))


@EWISE.flops
def _ewise_flops(reads: Sequence[tuple[int, int]], writes: Sequence[tuple[int, int]], params: dict):
    rows, cols = writes[0]
    return float(rows * cols * max(1, int(params.get("nops", 1))))


# The Triton body lives in elementwise_bodies.py (it reads the kind and the bytecode's constants
# above); importing it registers the body.
from . import elementwise_bodies  # noqa: E402, F401

if HAVE_TRITON:
    from .elementwise_bodies import ewise_tile  # noqa: E402, F401
