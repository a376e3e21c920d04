"""The megakernel's dispatch, generated from the kinds that have a Triton body.

kernel.py holds the megakernel with a placeholder block between ``# <dispatch>`` and
``# </dispatch>``. For a schedule, :func:`megakernel_for` writes a copy of kernel.py whose block
has one branch per kind the schedule runs::

    if kind == 0:  # gemm: mgraph.ops.tiles.gemm_tile
        _body_gemm(tp, regions, bufaddr, ...)

and imports that copy (Triton compiles from source files), with each ``_body_<id>`` bound to the
kind's Triton body in the copy's namespace. A body without a dot is called through a generated
noinline wrapper ``_body_<id>_call`` instead (:func:`called_apart`: Triton's layout pass is
quadratic in a function's connected memory accesses; the wgmma bodies stay inlined). A body's PARAMETER NAMES say what it
receives: each must be one of :data:`ABI_NAMES`, the values the kernel has in scope at the
dispatch point (its task row ``tp``, the tables, the rank's A/B descriptors, constexpr block
sizes...). So a new tile body is one decorated function in its op's file: no kernel argument,
no positional list kept in lockstep, no literal table offsets (the fields are named in
mgraph/ops/abi.py). The rdma push is dispatched the same way (kernel.push_commands).

The generated file is named by a hash of its text, so every process that runs the same kinds
writes the same file and Triton's on-disk cache reuses its compiled kernels.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
import tempfile
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from mgraph.errors import RegistrationError
from mgraph.kinds import KINDS

if TYPE_CHECKING:
    from mgraph.graph import TaskGraph

__all__ = [
    "ABI_NAMES",
    "BODY_CONSTEXPRS",
    "PUSH_KIND",
    "megakernel_for",
    "dispatch_source",
    "has_body",
    "body_params",
    "body_constexprs",
    "called_apart",
]

# What a tile body may name as a parameter: the kernel's values at the dispatch point.
ABI_NAMES = {
    "tp": "the task's row of the task table (mgraph/ops/abi.py names its fields)",
    "params": "the int32 params table (abi.param_i32 / abi.param_f32)",
    "regions": "the region table: (slot, row0, row1, col0, col1) per region",
    "bufaddr": "int64 address per buffer slot (this GPU's or a peer's memory)",
    "bufrows": "rows per buffer slot",
    "bufcols": "columns per buffer slot",
    "bufdt": "dtype code per buffer slot: 0 the graph's dtype (DT), 1 float32 (partials)",
    "ad0": "TMA descriptor of the rank's most used GEMM A buffer",
    "bd0": "TMA descriptor of the rank's most used GEMM B buffer",
    "a0_slot": "buffer slot of ad0",
    "b0_slot": "buffer slot of bd0",
    "cmds": "the FIFO command rows (rdma tasks)",
    "ring": "the pinned host FIFO ring",
    "dhead": "the FIFO's device head counter",
    "tail": "the FIFO's host tail",
    "capacity": "FIFO slots",
    "epoch": "this launch's epoch",
    "limit": "the watchdog bound (ns on the GPU, polls in the interpreter)",
    "abort": "the abort flag",
    "err": "the error record",
    "rank": "this rank (-1: every rank in one interpreter program)",
    "pid": "this program's id",
    "DT": "constexpr: the graph's element type",
    "BM": "constexpr: GEMM tile rows",
    "BN": "constexpr: GEMM tile columns",
    "BK": "constexpr: GEMM K step",
    "RB_M": "constexpr: reduce/copy sub-block rows",
    "RB_N": "constexpr: reduce/copy sub-block columns",
    "USE_TIMER": "constexpr: on a GPU (inline PTX, %globaltimer) rather than the interpreter",
    "ATTN_D": "constexpr: the head size attn_block's fast path is compiled for, 0, 128 or 256 "
    "(mgraph.ops.attention_tiles.attn_head_size)",
    "GLU": "constexpr: the kernel runs gemm_glu tasks (gemm_tile, their body too, compiles their "
    "epilogue only then)",
    "GEMM_PTR": "constexpr: the kernel runs GEMM tasks whose rows TMA cannot address "
    "(encode.gemm_by_pointers: gemm_tile compiles its pointer path only then)",
}
# The constexprs of ABI_NAMES that only bodies read: kernel.py's template does not declare
# them; the generated copy's signature does, and the runtime passes body_constexprs(). Each
# is one value per kernel, fixed by the tasks it runs, so a graph compiles only the code
# paths its tasks need (a path in the function costs every path registers: ptxas gives a
# function one budget). (GEMM_PTR is read by the kernel too, which declares it: the A/B
# descriptors it builds once per launch may then be over rows TMA cannot address.)
BODY_CONSTEXPRS = ("ATTN_D", "GLU", "GEMM_PTR")
PUSH_KIND = "push"  # the rdma push: not a registry kind (it has no CPU body), dispatched alike
_BEGIN, _END = "# <dispatch>", "# </dispatch>"


def has_body(kind: str) -> bool:
    spec = KINDS.get(kind)
    return spec is not None and spec.triton_body is not None


def _body(kind: str):
    if kind == PUSH_KIND:
        from .kernel import push_commands

        return push_commands
    return KINDS[kind].triton_body


def body_params(kind: str) -> list[str]:
    """The ABI values the Triton body of ``kind`` takes, by name (checked against ABI_NAMES)."""
    return _params_of(kind, _body(kind))


def _params_of(kind: str, body) -> list[str]:
    fn = getattr(body, "fn", body)  # a JITFunction wraps the Python function
    names = list(inspect.signature(fn).parameters)
    unknown = [n for n in names if n not in ABI_NAMES]
    if unknown:
        raise RegistrationError(
            f"the Triton body of kind {kind!r} ({fn.__module__}.{fn.__qualname__}) takes "
            f"{unknown}, which the megakernel does not provide",
            hint=f"name parameters after the kernel's values: {', '.join(ABI_NAMES)}",
        )
    return names


def body_constexprs(graph: TaskGraph, task_ids: Iterable[int]) -> dict[str, int]:
    """The values of :data:`BODY_CONSTEXPRS` for a kernel that runs ``task_ids`` of ``graph``
    (one rank's tasks, or every rank's in one interpreter program)."""
    from mgraph.ops.attention_tiles import attn_head_size

    from .encode import GEMM_KINDS, gemm_by_pointers

    ids = list(task_ids)
    return {"ATTN_D": attn_head_size(graph, ids),
            "GLU": any(graph.tasks[t].kind == "gemm_glu" for t in ids),
            "GEMM_PTR": any(graph.tasks[t].kind in GEMM_KINDS
                            and gemm_by_pointers(graph, graph.tasks[t]) for t in ids)}


def _declare_body_constexprs(template: str) -> str:
    """kernel.py's text with :data:`BODY_CONSTEXPRS` appended to megakernel's parameters."""
    start = template.index("\ndef megakernel(")
    close = template.index("\n):", start)  # the signature's closing line
    missing = [n for n in BODY_CONSTEXPRS if f" {n}:" not in template[start:close]]
    added = "".join(f"\n    {n}: tl.constexpr," for n in missing)
    return template[:close] + added + template[close:]


def _uses_dot(body, seen: set[int] | None = None) -> bool:
    """Whether the ``@triton.jit`` function ``body`` or one it calls (resolved through its
    module's globals, as Triton resolves them) calls ``tl.dot``/``tl.dot_scaled``. A
    function whose source cannot be read counts as one that does (it stays inlined)."""
    import ast

    import triton.language as tl

    seen = set() if seen is None else seen
    if id(body) in seen:
        return False
    seen.add(id(body))
    fn = getattr(body, "fn", body)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return True
    scope = getattr(fn, "__globals__", {})
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        names, expr = [], node.func
        while isinstance(expr, ast.Attribute):
            names.insert(0, expr.attr)
            expr = expr.value
        if not isinstance(expr, ast.Name) or expr.id not in scope:
            continue
        callee = scope[expr.id]
        for name in names:
            callee = getattr(callee, name, None)
        if callee is None:
            continue
        if callee is tl.dot or callee is getattr(tl, "dot_scaled", None):
            return True
        if hasattr(callee, "fn") and hasattr(callee, "params") and _uses_dot(callee, seen):
            return True
    return False


def called_apart(kind: str) -> bool:
    """Whether the dispatch calls the body of ``kind`` as a function of its own (a noinline
    wrapper) rather than inlining it into the megakernel.

    Why: Triton's layout pass (TritonGPUCoalesce) gives each pointer load and store a layout
    chosen over every memory access it is connected to through values, and computes that set
    anew per access (``multiRootGetSlice``): quadratic in the size of the function. Inlined, every
    body's accesses connect through the task row, so the whole dispatch was one set: the
    Llama layer's kernel spent 93 of its 104 s of TTGIR there (benchmarks/build_time.py).
    A call boundary ends the set. Bodies with a ``tl.dot`` stay inlined: a wgmma in a noinline
    callee serialises the caller's (ptxas C7510), and the GEMM and attention loops are the hot
    paths; so do bodies that take a TMA descriptor (``ad0``/``bd0``: no call passes one)."""
    body = _body(kind)
    if not (hasattr(body, "fn") and hasattr(body, "params")):
        return False  # not a JITFunction (a test's plain function)
    if any(p in ("ad0", "bd0") for p in _params_of(kind, body)):
        return False
    return not _uses_dot(body)


def _wrapper(alias: str, body, params: list[str]) -> str:
    """A noinline ``@triton.jit`` function named ``alias + "_call"`` that calls ``alias`` with
    ``params`` (the body's own parameters, its constexprs still constexpr)."""
    constexpr = {p.name for p in body.params if p.is_constexpr}
    args = ", ".join(f"{n}: tl.constexpr" if n in constexpr else n for n in params)
    return (f"\n\n@triton.jit(noinline=True)\ndef {alias}_call({args}):\n"
            f"    {alias}({', '.join(params)})\n")


def dispatch_source(kinds: dict[str, int], indent: str) -> tuple[str, str]:
    """(the dispatch block, the module text after the kernel: the bodies' bindings and
    wrappers) for ``kinds`` (name -> kind id). Kinds that share a body share its branch: each
    call is inlined, and a second copy of the GEMM body's pipelined loop (gemm_glu's) ran ptxas
    out of registers and serialised every wgmma of the kernel (C7512; benchmarks/NOTES.md v15).
    A body without a dot is called through a noinline wrapper (:func:`called_apart`)."""
    block, imports = [], []
    branches: dict[int, list[tuple[str, int]]] = {}  # id(body) -> its kinds, in kind order
    for name, kid in sorted(kinds.items(), key=lambda kv: kv[1]):
        branches.setdefault(id(_body(name)), []).append((name, kid))
    wrappers = []
    for members in branches.values():
        name, kid = members[0]
        body = _body(name)
        fn = getattr(body, "fn", body)
        alias = f"_body_{kid}"
        params = _params_of(name, body)
        names = ", ".join(n for n, _ in members)
        # bound into the module's namespace before it runs (a body may live anywhere, even
        # in a function or __main__, where an import by name could not reach it)
        imports.append(f"# {alias} = {fn.__module__}.{fn.__qualname__}  ({names})")
        callee = alias
        if called_apart(name):
            wrappers.append(_wrapper(alias, body, params))
            callee = f"{alias}_call"
        cond = " or ".join(f"kind == {k}" for _, k in members)
        block.append(f"{indent}if {cond}:  # {names}: {fn.__module__}.{fn.__qualname__}")
        block.append(f"{indent}    {callee}({', '.join(params)})")
    if not block:
        block.append(f"{indent}pass")
    return "\n".join(block) + "\n", "\n".join(imports) + "\n" + "".join(wrappers)


def special_bodies(
    kinds: dict[str, int], graph: TaskGraph | None, task_ids: Iterable[int] | None,
    chains: int,
) -> tuple[str, set[str]]:
    """Module text that rebinds some kinds' ``_body_<id>`` to code written for this kernel's
    tasks, and those kinds. Today the ewise chains (elementwise_special: straight-line code per
    chain instead of the bytecode interpreter)."""
    if graph is None or task_ids is None or "ewise" not in kinds:
        return "", set()
    from mgraph.graph import ITEMSIZE
    from mgraph.ops.elementwise_special import chain_keys, special_source

    keys = chain_keys(graph, task_ids, chains + 1) if chains > 0 else []
    if not keys:
        return "", set()
    entry = "_ewise_special"
    # every chain of the kernel's tasks has its function: the fallback would be dead code
    text = special_source(keys[:chains], 8 * ITEMSIZE[graph.dtype], entry,
                          fallback=len(keys) > chains)
    return text + f"\n_body_{kinds['ewise']} = {entry}\n", {"ewise"}


def megakernel_for(
    kinds: dict[str, int],
    graph: TaskGraph | None = None,
    task_ids: Iterable[int] | None = None,
    chains: int = 6,
):
    """The megakernel JITFunction whose dispatch runs ``kinds`` (name -> kind id); with the
    ``graph`` and the ``task_ids`` it runs, kinds with code written per kernel get it
    (special_bodies; ``chains``: Settings.ewise_chains)."""
    from . import kernel

    template = Path(kernel.__file__).read_text()
    start = template.index(_BEGIN)
    line_start = template.rindex("\n", 0, start) + 1
    indent = template[line_start:start]
    end = template.index("\n", template.index(_END)) + 1
    block, imports = dispatch_source(kinds, indent)
    # the copy lives outside the package: its relative imports become absolute
    template = template.replace("\nfrom .", "\nfrom mgraph.runtime.megakernel.")
    template = _declare_body_constexprs(template)
    start = template.index(_BEGIN)
    line_start = template.rindex("\n", 0, start) + 1
    end = template.index("\n", template.index(_END)) + 1
    text = (template[:line_start] + block + template[end:] +
            "\n\n# -- generated by mgraph.runtime.megakernel.dispatch: the kinds' bodies --\n" +
            imports)
    special, rebound = special_bodies(kinds, graph, task_ids, chains)
    text += special
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    name = f"mgraph_megakernel_{digest}"
    cached = sys.modules.get(name)
    if cached is not None and all(
        getattr(cached, f"_body_{kid}", None) is _body(kind)
        for kind, kid in kinds.items() if kind not in rebound
    ):
        return cached.megakernel
    folder = Path(tempfile.gettempdir()) / f"mgraph-kernels-{os.getuid()}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    if not path.exists() or path.read_text() != text:
        partial = folder / f".{name}.{os.getpid()}.tmp"
        partial.write_text(text)
        os.replace(partial, path)  # atomic: a concurrent rank never reads half a file
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    for kind, kid in kinds.items():
        setattr(module, f"_body_{kid}", _body(kind))
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.megakernel
