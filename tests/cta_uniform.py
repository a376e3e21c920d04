"""Which branches of a Triton kernel depend on a value that may differ between its warps.

Triton treats a scalar as one value per program, but on a GPU every thread computes it: a
scalar loaded with ``volatile=True`` (a word other programs change) or read from
``%globaltimer`` can differ between warps that execute the instruction at different times.
A branch or loop on such a value splits the program's warps, and the code inside holds CTA
barriers (a scalar atomic whose result is used broadcasts it through shared memory between two
``bar.sync``; reductions; ``tl.debug_barrier``). Warps that took different paths then meet at
different barriers: the kernel hangs on the hardware barrier, where no watchdog can see it.

``divergent_branches(ttir)`` is a taint analysis on the TTIR text (one function after inlining):
sources are volatile loads and inline asm that reads a clock or memory, scalar or block (a
block smaller than the program's threads is held by several threads each, and each copy is read
on its own); results of scalar atomics are uniform (the hardware broadcasts them through shared
memory), and so is a reduction to a scalar over a block of at least ``CTA_THREADS`` elements
(it spans every warp: its partial results meet in shared memory, as sync.load_uniform's do);
everything else, a smaller reduction included, carries its operands' taint, through the region results, loop-carried values
and block arguments of scf.if / scf.for / scf.while, to a fixpoint. It returns the tainted
conditions (scf.if, scf.while's scf.condition, scf.for bounds) with their source locations.
"""

from __future__ import annotations

import math
import re

__all__ = ["divergent_branches", "CTA_THREADS"]

# The most threads a program has (32 warps of 32): a block this large spans every warp.
CTA_THREADS = 1024

_VALUE = re.compile(r"%[\w.$-]+(?:#\d+)?")
_DEF = re.compile(r"^\s*(%[\w.$-]+)(?::(\d+))?\s*=\s*(.*)$")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_LOC = re.compile(r"loc\((#loc\d*)\)\s*$")
_UNIFORM_OPS = ("tt.atomic_rmw", "tt.atomic_cas")
_TENSOR = re.compile(r"tensor<([\dx]+)x[^>]*>")
# inline asm that reads a clock or memory, each thread on its own
_PER_THREAD_ASM = ("%globaltimer", "%clock", "ld.")


def _uses(text: str) -> list[str]:
    text = _STRING.sub('""', text)
    text = re.sub(r"loc\(.*$", "", text)
    return _VALUE.findall(text)


def _results(name: str, count: str | None) -> list[str]:
    return [f"{name}#{k}" for k in range(int(count))] if count else [name]


class _Region:
    def __init__(self, kind: str, results: list[str], line: int) -> None:
        self.kind, self.results, self.line = kind, results, line
        self.region = 0  # scf.if: then/else; scf.while: before/after
        self.carried: list[str] = []  # scf.for iter_args, scf.while before-region arguments
        self.control: list[str] = []  # what decides the region runs / iterates
        self.condition: list[str] = []  # scf.while: scf.condition's forwarded operands
        self.sink: int | None = None  # index of its condition in the sinks
        self.operands: list[str] = []  # tt.reduce: what it reduces


def _spans_every_warp(close: str) -> bool:
    """A tt.reduce's closing line ``}) : (tensor<1024xi64>) -> i64``: a scalar result of a
    block of at least CTA_THREADS elements."""
    types = close.split(":", 1)[1] if ":" in close else ""
    operands, _, result = types.partition("->")
    sizes = [math.prod(int(d) for d in dims.split("x")) for dims in _TENSOR.findall(operands)]
    return bool(sizes) and min(sizes) >= CTA_THREADS and "tensor<" not in result


def divergent_branches(ttir: str) -> list[str]:
    """Locations ("file:line <- caller..." chains) of branches on warp-divergent values."""
    lines = ttir.splitlines()
    edges: list[tuple[list[str], list[str]]] = []  # (targets, sources): any source -> all
    tainted: set[str] = set()
    sinks: list[tuple[list[str], int]] = []
    stack: list[_Region] = []
    # MLIR reuses value names in sibling regions: each name is bound per region, and a use
    # means the innermost binding (ids are "name@line of its definition").
    scopes: list[dict[str, str]] = [{}]

    def define(name: str, n: int) -> str:
        uid = f"{name}@{n}"
        scopes[-1][name] = uid
        return uid

    def use(names: list[str]) -> list[str]:
        out = []
        for name in names:
            out.append(next((sc[name] for sc in reversed(scopes) if name in sc), name))
        return out

    for n, raw in enumerate(lines):
        line = raw.strip()
        if line.startswith("}"):
            if line.startswith(("} else {", "} do {")):
                stack[-1].region = 1
                scopes[-1] = {}
                continue
            region = stack.pop()
            scopes.pop()
            if region.kind == "reduce" and not _spans_every_warp(line):
                edges.append((region.results, region.operands))
            if region.sink is not None:  # an scf.if / scf.for: its location is on this line
                sinks[region.sink] = (sinks[region.sink][0], n)
            continue
        opens = line.endswith("{")
        m = _DEF.match(line)
        rhs = m.group(3) if m else line
        names = _results(m.group(1), m.group(2)) if m else []
        # a result of a region op is bound outside the op's regions
        results = [define(r, n) for r in names]
        if m and m.group(2):  # %x:2 is used as %x#0, %x#1
            scopes[-1].update({r: f"{r}@{n}" for r in names})
        region = None
        if rhs.startswith("scf.if"):
            cond = use(_uses(rhs.split("->")[0]))
            sinks.append((cond, n))
            region = _Region("if", results, n)
            region.control, region.sink = cond, len(sinks) - 1
            edges.append((results, cond))
        elif rhs.startswith("scf.for"):
            head = rhs.split("iter_args")[0]
            bounds = use(_uses(head)[1:])  # after the induction variable
            sinks.append((bounds, n))
            region = _Region("for", results, n)
            region.control, region.sink = bounds, len(sinks) - 1
            edges.append((results, bounds))
            pairs = []
            if "iter_args(" in rhs:
                inner = rhs.split("iter_args(")[1].split(")")[0]
                pairs = [_uses(pair)[:2] for pair in inner.split(",") if "=" in pair]
            inits = [use([init])[0] for _arg, init in pairs]
            scopes.append({})
            edges.append(([define(_uses(head)[0], n)], bounds))
            for (arg, _init), init in zip(pairs, inits, strict=True):
                region.carried.append(define(arg, n))
                edges.append(([region.carried[-1]], [init, *bounds]))
        elif rhs.startswith("scf.while"):
            region = _Region("while", results, n)
            inner = rhs.split("(", 1)[1].split(")")[0]
            pairs = [_uses(pair)[:2] for pair in inner.split(",") if "=" in pair]
            inits = [use([init])[0] for _arg, init in pairs]
            scopes.append({})
            for (arg, _init), init in zip(pairs, inits, strict=True):
                region.carried.append(define(arg, n))
                edges.append(([region.carried[-1]], [init]))
        elif rhs.startswith('"tt.reduce"'):  # uniform or not: decided at its closing line
            region = _Region("reduce", results, n)
            region.operands = use(_uses(rhs.split(")")[0]))
        elif line.startswith("scf.condition("):
            cond = use(_uses(line.split(")")[0]))
            sinks.append((cond, n))
            forwarded = use(_uses(line.split(")", 1)[1].split(" : ")[0]))
            loop = stack[-1]
            loop.control, loop.condition = cond, forwarded
            for res, val in zip(loop.results, forwarded, strict=False):
                edges.append(([res], [val, *cond]))
        elif line.startswith("^bb"):
            args = [define(a, n) for a in re.findall(r"(%[\w.$-]+):", _STRING.sub('""', line))]
            loop = stack[-1] if stack else None
            if loop is not None and loop.kind == "while" and loop.region == 1:
                # (the warps inside an iteration agree on these; whether they all entered it
                # is the condition's question, reported there)
                for arg, val in zip(args, loop.condition, strict=False):
                    edges.append(([arg], [val]))
        elif line.startswith("scf.yield"):
            vals = use(_uses(line.split(" : ")[0]))
            owner = stack[-1]
            if owner.kind == "if":
                targets = owner.results
            elif owner.kind == "for":
                targets = owner.carried
                for res, val in zip(owner.results, vals, strict=False):
                    edges.append(([res], [val]))
            elif owner.kind == "while":
                targets = owner.carried
            else:
                targets = []
            for tgt, val in zip(targets, vals, strict=False):
                edges.append(([tgt], [val]))
        elif m:
            kind = rhs.split()[0] if rhs.split() else ""
            if kind == "tt.load" and "isVolatile = true" in rhs:
                tainted.update(results)
            elif kind == "tt.elementwise_inline_asm" and any(c in rhs for c in _PER_THREAD_ASM):
                tainted.update(results)
            elif not rhs.startswith(_UNIFORM_OPS):
                edges.append((results, use(_uses(rhs))))
        if opens:
            if region is None:
                region = _Region("other", results, n)
            stack.append(region)
            if region.kind in ("if", "other", "reduce"):
                scopes.append({})
    changed = True
    while changed:
        changed = False
        for targets, sources in edges:
            if any(s in tainted for s in sources) and not all(t in tainted for t in targets):
                tainted.update(targets)
                changed = True
    locs = _locations(ttir)
    found = []
    for values, n in sinks:
        if any(v in tainted for v in values):
            loc = _LOC.search(lines[n])
            found.append(locs.get(loc.group(1), "?") if loc else f"TTIR line {n}")
    return found


def _locations(ttir: str) -> dict[str, str]:
    """#locN -> "file:line", a call site as "callee <- caller" (the kernel's own files only)."""
    raw = dict(re.findall(r"^(#loc\d*) = loc\((.*)\)\s*$", ttir, flags=re.M))
    memo: dict[str, str] = {}

    def resolve(ref: str, depth: int = 0) -> str:
        if ref in memo or depth > 50:
            return memo.get(ref, "?")
        body = raw.get(ref, "unknown")
        if m := re.match(r'^"([^"]*)":(\d+):\d+', body):
            out = f"{m.group(1).rsplit('/', 1)[-1]}:{m.group(2)}"
        elif m := re.match(r"^callsite\((#loc\d*) at (#loc\d*)\)$", body):
            out = f"{resolve(m.group(1), depth + 1)} <- {resolve(m.group(2), depth + 1)}"
        elif m := re.match(r'^"[^"]*"\((#loc\d*)\)$', body):
            out = resolve(m.group(1), depth + 1)
        else:
            out = "?"
        memo[ref] = out
        return out

    return {ref: resolve(ref) for ref in raw}
