"""Straight-line Triton code for the ``ewise`` chains of one kernel.

The ``ewise`` body (elementwise_bodies.ewise_tile) interprets a task's bytecode block by block:
every instruction reads its four words, branches over every fn and moves fp32 tiles between six
registers. v12 measured what that costs (benchmarks/NOTES.md): 80 us a task in the Llama layer
on one H200, about ten times what the task's bytes need, the kernel bound by instructions, not
memory. A chain is fixed when the graph is built, so the megakernel's generated copy
(runtime/megakernel/dispatch.py) gets one function per chain its rank runs, written here from the
bytecode: one loop over the tile's blocks, each block's loads issued together and one block
ahead (block_shape: 64 KiB a program in flight for SwiGLU's two bf16 operands, while the
previous block's fns and store run), the fns as plain expressions, no register file, no
branches. The kind's dispatch picks the function whose bytecode (and operand
forms) a task carries and falls back to the interpreter for any other chain, and for operands
the fast path cannot vectorise (the same gate as ewise_tile).

Up to ``Settings.ewise_chains`` chains per kernel (MGRAPH_EWISE_CHAINS, default 6), the ones
with the most tasks first; each costs compile time and code size. Each chain, the fallback to
ewise_tile (ewise_other: compiled only where the kernel runs a chain with no function of its
own) and the general path are functions of their own (``noinline``; none has a dot): the
chains do not repeat the general path, and Triton's layout pass (TritonGPUCoalesce, quadratic in
the memory accesses a function's values connect) sees one chain at a time
(runtime/megakernel/dispatch.called_apart; benchmarks/build_time.py).
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from .elementwise import CODES, CONST, EWISE, GATHER, LOAD, ROT

if TYPE_CHECKING:
    from mgraph.graph import TaskGraph

__all__ = ["chain_keys", "special_source"]

# The fns as expressions of fp32 tiles x (unary) or a, b (binary): elementwise_bodies._ewise_math's
# arithmetic exactly, so both paths round alike.
_FN = {
    "neg": "-{x}",
    "silu": "{x} / (1.0 + tl.exp(-{x}))",
    "gelu": "0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476))",
    "gelu_tanh": "0.5 * {x} * (1.0 + _tanh(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x})))",
    "relu": "tl.maximum({x}, 0.0)",
    "sigmoid": "1.0 / (1.0 + tl.exp(-{x}))",
    "tanh": "_tanh({x})",
    "exp": "tl.exp({x})",
    "log": "tl.log({x})",
    "sqrt": "tl.sqrt({x})",
    "rsqrt": "tl.rsqrt({x})",
    "abs": "tl.abs({x})",
    "identity": "{x}",
    "add": "{a} + {b}",
    "sub": "{a} - {b}",
    "mul": "{a} * {b}",
    "div": "{a} / {b}",
    "pow": "_pow({a}, {b})",
    "maximum": "tl.maximum({a}, {b})",
    "minimum": "tl.minimum({a}, {b})",
}
assert set(_FN) == set(CODES), "every ewise fn needs its expression here"
_P_MAPS = EWISE.params.index("maps")


def _key(words: list[int]) -> tuple[int, ...]:
    """A task's chain: its bytecode words (nops, result, 4 per instruction) and its operand
    forms (``maps``: 2 bits per input)."""
    nops = words[0]
    return (*words[: 2 + 4 * nops], words[_P_MAPS])


def chain_keys(
    graph: TaskGraph, task_ids: Iterable[int], limit: int
) -> list[tuple[tuple[int, ...], tuple[int, int]]]:
    """The chains of ``graph``'s ewise tasks among ``task_ids``, most tasks first (ties by key,
    so every rank of one graph orders alike), at most ``limit``; each with the tile shape most
    of its tasks have (the generated block's shape follows it)."""
    from mgraph.runtime.megakernel.encode import _param_words

    counts: Counter = Counter()
    shapes: dict[tuple[int, ...], Counter] = {}
    for i in task_ids:
        task = graph.tasks[i]
        if task.kind == EWISE.name:
            key = _key(_param_words(task))
            counts[key] += 1
            shapes.setdefault(key, Counter())[tuple(task.writes[0].shape)] += 1
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return [
        (key, min(shapes[key].items(), key=lambda kv: (-kv[1], kv[0]))[0])
        for key, _n in ranked[:limit]
    ]


def _const(word: int) -> str:
    value = struct.unpack("<f", struct.pack("<i", word))[0]
    if math.isnan(value):
        return 'float("nan")'
    if math.isinf(value):
        return 'float("inf")' if value > 0 else '-float("inf")'
    return repr(value)


def _pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def block_shape(loads: int, bits: int, shape: tuple[int, int]) -> tuple[int, int]:
    """Rows and columns of the block one iteration computes, for a chain with ``loads`` loads a
    block over tiles of ``shape``: 16 vectors of 16 bytes a thread in flight over all its loads
    in 16-bit dtypes, 8 in fp32 (64 registers either way, at the megakernel's 8 warps), i.e.
    64 KiB a program for two operands in bf16: what covers HBM latency at an SM's share of its
    bandwidth. Columns up to 1024 (whole rows of the tile where they fit), then rows."""
    vec = 128 // bits
    per_op = max(1, (16 if bits <= 16 else 8) // max(1, loads))
    per_op = 1 << (per_op.bit_length() - 1)  # Triton's blocks are powers of two
    elems = per_op * vec * 256
    cols = min(max(_pow2(shape[1]), vec), 1024, elems)
    rows = max(1, min(elems // cols, _pow2(shape[0])))
    return rows, cols


def _chain_source(i: int, key: tuple[int, ...], bits: int, shape: tuple[int, int]) -> str:
    """The functions ``_ewise_chain_<i>`` (the task's gate and fallback) and its fast path."""
    nops, result = key[0], key[1]
    maps = key[-1]
    code = [key[2 + 4 * k : 6 + 4 * k] for k in range(nops)]
    reads = sorted({a for op, _d, a, _b in code if op in (LOAD, ROT)})
    loads = [k for k, (op, _d, _a, _b) in enumerate(code) if op in (LOAD, ROT)]
    br, bc = block_shape(len(loads), bits, shape)
    form = {a: (maps >> (2 * a)) & 3 for a in reads}
    out = []
    w = out.append
    w("@triton.jit")
    w(f"def _ewise_chain_{i}_vec(tp, params, regions, bufaddr, bufcols, r0, w0, m, n, half, row0,")
    w("                        DT: tl.constexpr):")
    w(f'    """Chain {i}: {nops} instructions, {len(loads)} loads a block of {br} x {bc}."""')
    w("    VEC: tl.constexpr = 128 // DT.primitive_bitwidth")
    for a in reads:
        if form[a] == GATHER:
            w(f"    ga{a}, pp{a} = _gather_at(params, tp, regions, bufaddr, r0 + {a})")
            continue
        w(f"    a{a}, p{a}, _v{a} = row_operand(regions, bufaddr, bufcols, r0 + {a}, DT)")
        if form[a]:  # a broadcast operand's row map, hoisted out of the blocks
            base = f"_P_MAP + {3 * (form[a] - 1)}"
            w(f"    ma{a} = param_i32(params, tp, {base})")
            w(f"    mm{a} = param_i32(params, tp, {base} + 1)")
            w(f"    lo{a} = param_i32(params, tp, {base} + 2)")
    w("    oa, opitch, _vo = row_operand(regions, bufaddr, bufcols, w0, DT)")
    w("    out_p = vec_ptr(oa, DT)")
    w("    opitch = opitch // VEC * VEC")
    w("    n = n // VEC * VEC")
    w("    half = half // VEC * VEC")
    for a in reads:
        if form[a] == GATHER:
            w(f"    gp{a} = vec_ptr(ga{a}, DT)")
            w(f"    gb{a} = tl.load(pp{a})")
    # The next block's loads are issued before this block's fns and store: a program keeps a
    # block of loads in flight while it computes, instead of waiting out HBM latency once per
    # block (v13: SwiGLU's tasks moved ~16 GB/s a program, latency-bound). Only the loaded
    # blocks are carried between iterations; rows, columns and masks are recomputed, so they
    # keep the alignment hints the 16-byte accesses need. A chain whose usual tile is one
    # column block wide (RoPE's 512 x 128) loops over row blocks inside a column-block loop,
    # which computes what depends on the columns alone (a rotation's columns, a gather's
    # column positions: integer divisions per element) once; wider ones (SwiGLU's 16 x 14336)
    # run one loop over every block, so the next block may be in the next column block.
    flat = shape[1] > bc

    def cols(sfx: str, cb: str, ind: str, full: bool) -> dict[tuple[int, bool], str]:
        """Columns of column block ``cb`` (and, ``full``, what the loads derive from them)."""
        w(f"{ind}on{sfx} = vec_cols(({cb}) * {bc}, {bc}, VEC)")
        cv: dict[tuple[int, bool], str] = {}
        for k in loads if full else []:
            op, _d, a, _b = code[k]
            rot = op == ROT
            src = f"on{sfx}"
            if rot:  # runs of VEC columns stay runs: half is a multiple of VEC
                if (-1, True) not in cv:
                    w(f"{ind}rc{sfx} = tl.max_contiguous(")
                    w(f"{ind}    tl.multiple_of(_rot_cols(on{sfx}, half), VEC), VEC)")
                    cv[(-1, True)] = f"rc{sfx}"
                src = f"rc{sfx}"
            if form[a] == GATHER and (a, rot) not in cv:
                name = f"gc{a}{'r' if rot else ''}{sfx}"
                w(f"{ind}{name} = _digit_sum({src}, pp{a} + 1 + 2 * _DIGITS, VEC, VEC)")
                cv[(a, rot)] = name
        return cv

    def rows(sfx: str, rb: str, ind: str, on: str, full: bool) -> None:
        """Rows and mask of row block ``rb`` (and, ``full``, each read's row positions)."""
        w(f"{ind}om{sfx} = ({rb}) * {br} + tl.arange(0, {br})")
        w(f"{ind}mk{sfx} = (om{sfx} < m)[:, None] & ({on} < n)[None, :]")
        for a in reads if full else []:
            if form[a] == GATHER:
                w(f"{ind}gr{a}{sfx} = tl.multiple_of(")
                w(f"{ind}    gb{a} + _digit_sum(om{sfx}, pp{a} + 1, VEC, 1), VEC)")
            elif form[a]:
                w(
                    f"{ind}rr{a}{sfx} = ((row0 + om{sfx}) // ma{a}) * mm{a} "
                    f"+ (row0 + om{sfx}) % mm{a} - lo{a}"
                )

    def issue(dest: str, sfx: str, on: str, cv: dict[tuple[int, bool], str], ind: str) -> None:
        """Block ``sfx``'s loads, all in flight together, into ``dest``<k>."""
        for k in loads:
            op, _d, a, _b = code[k]
            rot = op == ROT
            c = cv[(-1, True)] if rot else on
            if form[a] == GATHER:
                w(
                    f"{ind}{dest}{k} = tl.load(gp{a} + gr{a}{sfx}[:, None] + "
                    f"{cv[(a, rot)]}[None, :], mask=mk{sfx}, other=1.0)"
                )
                continue
            r = f"rr{a}{sfx}" if form[a] else f"om{sfx}"
            w(f"{ind}{dest}{k} = _vload(a{a}, p{a}, {r}, {c}, mk{sfx}, DT)")

    w(f"    nrb = tl.cdiv(m, {br})")
    if flat:
        w(f"    nb = tl.cdiv(n, {bc}) * nrb")
        cv = cols("", "0", "    ", True)
        rows("", "0", "    ", "on", True)
        issue("l", "", "on", cv, "    ")
        w("    for b in range(0, nb):")
        ind = "        "
        # past the last block: columns past n, every lane masked off
        cvn = cols("_n", "(b + 1) // nrb", ind, True)
        rows("_n", "(b + 1) % nrb", ind, "on_n", True)
        issue("ln", "_n", "on_n", cvn, ind)
        cols("", "b // nrb", ind, False)
        rows("", "b % nrb", ind, "on", False)
    else:
        w(f"    for cb in range(0, tl.cdiv(n, {bc})):")
        cv = cols("", "cb", "        ", True)
        rows("", "0", "        ", "on", True)
        issue("l", "", "on", cv, "        ")
        w("        for rb in range(0, nrb):")
        ind = "            "
        rows("_n", "rb + 1", ind, "on", True)  # past the last row block: every lane masked
        issue("ln", "_n", "on", cv, ind)
        rows("", "rb", ind, "on", False)
    reg: dict[int, str] = {}
    for k, (op, dst, a, b) in enumerate(code):
        name = f"t{k}"
        if op == LOAD:
            expr = f"l{k}.to(tl.float32)"
        elif op == ROT:
            w(f"{ind}u{k} = l{k}.to(tl.float32)")
            expr = f"tl.where((on < half)[None, :], -u{k}, u{k})"
        elif op == CONST:
            expr = f"tl.full(({br}, {bc}), {_const(b)}, tl.float32)"
        else:
            expr = _FN[CODES[op]].format(x=reg[a], a=reg[a], b=reg.get(b, reg[a]))
        w(f"{ind}{name} = {expr}")
        reg[dst] = name
    w(f"{ind}tl.store(out_p + (om * opitch)[:, None] + on[None, :], {reg[result]}.to(DT), mask=mk)")
    for k in loads:
        w(f"{ind}l{k} = ln{k}")
    w("")
    w("")
    w("@triton.jit(noinline=True)")
    w(f"def _ewise_chain_{i}(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr):")
    w("    # ewise_tile's gate; a task it fails runs the general path over the same bytecode")
    w("    fast, r0, _nread, w0, m, n = ewise_gate(tp, params, regions, bufaddr, bufcols, DT)")
    w("    if fast:")
    w("        half = param_i32(params, tp, _P_HALF)")
    w("        row0 = param_i32(params, tp, _P_HALF + 2)")
    w(
        f"        _ewise_chain_{i}_vec(tp, params, regions, bufaddr, bufcols, r0, w0, m, n, half, row0,"
    )
    w("                             DT)")
    w("    else:")
    w("        _ewise_general(tp, params, regions, bufaddr, bufcols, r0, w0, m, n, DT)")
    return "\n".join(out) + "\n"


_HEADER = """
# -- generated by mgraph.ops.elementwise_special: this kernel's ewise chains --
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from mgraph.ops.abi import F_PARAM0 as _sp_param0  # noqa: E402
from mgraph.ops.elementwise_bodies import (  # noqa: E402
    _DIGITS, _P_HALF, _P_MAP, _ewise_general, _gather_at, _pow, _rot_cols, _tanh, _vload,
    ewise_gate, ewise_other,
)
from mgraph.ops.abi import param_i32  # noqa: E402
from mgraph.ops.relayout import _digit_sum  # noqa: E402
from mgraph.ops.tilewise import row_operand, vec_cols, vec_ptr  # noqa: E402
_SP_PARAM0 = tl.constexpr(_sp_param0)

"""


def special_source(
    chains: list[tuple[tuple[int, ...], tuple[int, int]]], bits: int, entry: str,
    fallback: bool = True,
) -> str:
    """Module text defining ``entry(tp, params, regions, bufaddr, bufcols, DT)``: the ewise
    body for a kernel whose tasks carry ``chains`` (chain_keys: key and shape), ``bits`` the graph
    dtype's width. A task whose words match no key runs ewise_tile (through ewise_other);
    without ``fallback`` (``chains`` are every chain of the kernel's tasks) that path is not
    compiled: nothing the kernel runs takes it."""
    parts = [_HEADER]
    keys = [key for key, _shape in chains]
    for i, (key, shape) in enumerate(chains):
        parts.append(_chain_source(i, key, bits, shape))
        parts.append("\n")
    longest = max((len(k) - 1 for k in keys), default=0)
    w = parts.append
    w("@triton.jit\n")
    w(f"def {entry}(tp, params, regions, bufaddr, bufcols, DT: tl.constexpr):\n")
    w("    # the chain whose words the task carries (its params row: nops, result, bytecode)\n")
    w("    pb = params + tl.load(tp + _SP_PARAM0)\n")
    for j in range(longest):
        w(f"    k{j} = tl.load(pb + {j})\n")
    w(f"    mp = tl.load(pb + {_P_MAPS})\n")
    for i, key in enumerate(keys):
        words = key[:-1]
        test = " & ".join(f"(k{j} == {v})" for j, v in enumerate(words))
        head = "if" if i == 0 else "elif"
        w(f"    {head} {test} & (mp == {key[-1]}):\n")
        w(f"        _ewise_chain_{i}(tp, params, regions, bufaddr, bufcols, DT)\n")
    if keys and fallback:
        w("    else:\n")
        w("        ewise_other(tp, params, regions, bufaddr, bufcols, DT)\n")
    elif not keys:
        w("    ewise_other(tp, params, regions, bufaddr, bufcols, DT)\n")
    return "".join(parts)
