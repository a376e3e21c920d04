"""Which constructs stop Triton's automatic warp specialisation of a loop on sm_90, by minimal
kernels compiled ahead of time on the CPU (no GPU): the evidence behind attention_tiles.py's
"Warp specialisation" paragraph.

    PYTHONPATH=/tmp/t36 python benchmarks/ws_rule_probe.py          # under Triton 3.6 (the GPU's)
    python benchmarks/ws_rule_probe.py --mega ring_attention-1x2-bf16  # + the megakernel's blockers

Each case is the flat flash loop of bench_attention.py's ``flat_attention`` (TMA k / v, online
softmax, ``tl.range(..., warp_specialize=True)``) beside or around one other construct, compiled
to TTGIR for cuda:90 (tests/test_gpu_compile.py's ``compile_for_sm90``). A case prints ``ws``
when the TTGIR holds a ``ttg.warp_specialize`` op (the pass split the loop into a TMA producer
and consumer warpgroups), ``plain`` when the loop compiled without one, ``abort`` when the pass
failed the compilation (an UNREACHABLE or assertion inside it: Triton prints the MLIR reproducer).

On sm_80/90 Triton 3.6's pipeline runs ``nvgpu-warp-specialization`` (the Hopper pass,
third_party/nvidia/hopper) after canonicalisation; per function, after inlining, it skips
(loop left plain, no message) unless num_warps is exactly 4 and no ``scf.if`` in the whole function
has an else block holding an op other than its ``scf.yield``; past those checks it partitions the
whole function, and aborts on constructs it cannot partition (an ``scf.while`` anywhere, a
second flash loop meeting the first's results). :data:`CASES` pairs each case with what Triton 3.6
gives; Triton 3.9 (this machine's) gave the same for every case (tests/test_attention_ws.py).
``--mega NAME`` counts those constructs in the megakernel that tests/test_gpu_compile.py builds
for graph NAME (its own kinds' dispatch, the GPU's kernel arguments).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

_F = tl.constexpr(128)  # q rows, keys a chunk, head size


@triton.jit
def _flash(qb, kd, vd, base, S, qk_scale, WS: tl.constexpr):
    """bench_attention.flat_attention's loop; ``WS``: warp_specialize on it."""
    m_i = tl.full([_F], float("-inf"), tl.float32)
    l_i = tl.full([_F], 1.0, tl.float32)
    acc = tl.zeros([_F, _F], tl.float32)
    for n in tl.range(0, S, _F, warp_specialize=WS):
        s = tl.dot(qb, kd.load([base + n, 0]).T)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(tl.bfloat16), vd.load([base + n, 0]), acc * alpha[:, None])
        m_i = m_new
    return acc, l_i


@triton.jit
def probe_kernel(q, k, v, o, S, scale, ROWS, x, flag, CASE: tl.constexpr):
    """The flash loop (warp-specialised) with case CASE's construct (:data:`CASES`)."""
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    qd = tl.make_tensor_descriptor(q, [ROWS, _F], [_F, 1], [_F, _F])
    kd = tl.make_tensor_descriptor(k, [ROWS, _F], [_F, 1], [_F, _F])
    vd = tl.make_tensor_descriptor(v, [ROWS, _F], [_F, 1], [_F, _F])
    od = tl.make_tensor_descriptor(o, [ROWS, _F], [_F, 1], [_F, _F])
    base = bh * S
    row = base + pid_m * _F
    qb = qd.load([row, 0])
    qk_scale = scale * 1.4426950408889634
    if CASE == 0:  # the loop alone
        acc, l_i = _flash(qb, kd, vd, base, S, qk_scale, True)
        od.store([row, 0], (acc / l_i[:, None]).to(tl.bfloat16))
    elif CASE == 1:  # an unrelated if/else before it, each branch a load yielding a scalar
        if flag > 0:
            y = tl.load(x)
        else:
            y = tl.load(x + 1)
        acc, l_i = _flash(qb, kd, vd, base, S, qk_scale, True)
        od.store([row, 0], (acc / l_i[:, None] * y).to(tl.bfloat16))
    elif CASE == 2:  # an if/else yielding nothing: a store in each branch
        if flag > 0:
            tl.store(x, 1.0)
        else:
            tl.store(x, 2.0)
        acc, l_i = _flash(qb, kd, vd, base, S, qk_scale, True)
        od.store([row, 0], (acc / l_i[:, None]).to(tl.bfloat16))
    elif CASE == 3:  # an if/else with scalar arithmetic in each branch
        if flag > 0:
            y = flag * 2
        else:
            y = flag + 3
        acc, l_i = _flash(qb, kd, vd, base + y, S, qk_scale, True)
        od.store([row, 0], (acc / l_i[:, None]).to(tl.bfloat16))
    elif CASE == 4:  # case 3 as tl.where
        y = tl.where(flag > 0, flag * 2, flag + 3)
        acc, l_i = _flash(qb, kd, vd, base + y, S, qk_scale, True)
        od.store([row, 0], (acc / l_i[:, None]).to(tl.bfloat16))
    elif CASE == 5:  # an if/else whose branches only pick values computed before it
        a = flag * 2
        b = flag + 3
        if flag > 0:
            y = a
        else:
            y = b
        acc, l_i = _flash(qb, kd, vd, base + y, S, qk_scale, True)
        od.store([row, 0], (acc / l_i[:, None]).to(tl.bfloat16))
    elif CASE == 6:  # an if without else (a store)
        if flag > 0:
            tl.store(x, 1.0)
        acc, l_i = _flash(qb, kd, vd, base, S, qk_scale, True)
        od.store([row, 0], (acc / l_i[:, None]).to(tl.bfloat16))
    elif CASE == 7:  # the loop inside an if without else
        if flag > 0:
            acc, l_i = _flash(qb, kd, vd, base, S, qk_scale, True)
            od.store([row, 0], (acc / l_i[:, None]).to(tl.bfloat16))
    elif CASE == 8:  # the loop inside an outer scf.for (a persistent loop over tiles)
        for t in range(0, flag):
            acc, l_i = _flash(qb, kd, vd, base, S, qk_scale, True)
            od.store([base + t * _F, 0], (acc / l_i[:, None]).to(tl.bfloat16))
    elif CASE == 9:  # an atomic beside it
        tl.atomic_add(x, 1.0)
        acc, l_i = _flash(qb, kd, vd, base, S, qk_scale, True)
        od.store([row, 0], (acc / l_i[:, None]).to(tl.bfloat16))
    elif CASE == 10:  # another loop, without a dot, before it
        for t in range(0, flag):
            tl.store(x + t, tl.load(x + t + 8) + 1.0)
        acc, l_i = _flash(qb, kd, vd, base, S, qk_scale, True)
        od.store([row, 0], (acc / l_i[:, None]).to(tl.bfloat16))
    elif CASE == 11:  # another loop of dots (a GEMM K loop) inside an if without else
        if flag > 5:
            a2 = tl.zeros([_F, _F], tl.float32)
            for t in range(0, flag):
                a2 = tl.dot(qb, kd.load([t * _F, 0]).T, a2)
            od.store([0, 0], a2.to(tl.bfloat16))
        acc, l_i = _flash(qb, kd, vd, base, S, qk_scale, True)
        od.store([row, 0], (acc / l_i[:, None]).to(tl.bfloat16))
    elif CASE == 12:  # an scf.while (a spin wait's shape) before it, no dot in it
        t = 0
        while t < flag:
            tl.store(x + t, 1.0)
            t += 1
        acc, l_i = _flash(qb, kd, vd, base, S, qk_scale, True)
        od.store([row, 0], (acc / l_i[:, None]).to(tl.bfloat16))
    elif CASE == 13:  # the loop inside an scf.while (a persistent scheduler loop)
        t = 0
        while t < flag:
            acc, l_i = _flash(qb, kd, vd, base, S, qk_scale, True)
            od.store([base + t * _F, 0], (acc / l_i[:, None]).to(tl.bfloat16))
            t += 1
    elif CASE == 14:  # a second flash loop (not specialised) whose result meets the first's
        acc, l_i = _flash(qb, kd, vd, base, S, qk_scale, True)
        acc2, l2 = _flash(qb, kd, vd, base, S, qk_scale, False)
        od.store([row, 0], (acc / l_i[:, None] + acc2 / l2[:, None]).to(tl.bfloat16))
    elif CASE == 15:  # two specialised flash loops
        acc, l_i = _flash(qb, kd, vd, base, S, qk_scale, True)
        acc2, l2 = _flash(qb, kd, vd, base + 128, S, qk_scale, True)
        od.store([row, 0], (acc / l_i[:, None] + acc2 / l2[:, None]).to(tl.bfloat16))
    elif CASE == 16:  # a plain flash loop continuing the first's state (attention_tiles'
        # plain loop, then its masked one)
        acc, l_i = _flash(qb, kd, vd, base, S, qk_scale, True)
        m_i = tl.full([_F], 0.0, tl.float32)
        for n in tl.range(0, S, _F):
            s = tl.dot(qb, kd.load([base + n, 0]).T)
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(tl.bfloat16), vd.load([base + n, 0]), acc * alpha[:, None])
            m_i = m_new
        od.store([row, 0], (acc / l_i[:, None]).to(tl.bfloat16))


# (case, num_warps) -> what Triton 3.6 compiles for sm_90 (measured: ws, plain or abort)
CASES = {
    (0, 4): "ws", (0, 2): "plain", (0, 8): "plain", (0, 16): "plain",
    (1, 4): "plain", (2, 4): "plain", (3, 4): "plain", (4, 4): "ws", (5, 4): "ws",
    (6, 4): "ws", (7, 4): "ws", (8, 4): "ws", (9, 4): "ws", (10, 4): "ws", (11, 4): "ws",
    (12, 4): "abort", (13, 4): "abort", (14, 4): "abort", (15, 4): "abort", (16, 4): "abort",
    (1, 8): "plain", (12, 8): "plain", (14, 8): "plain",
}


def compile_case(case: int, warps: int) -> str:
    """``ws``, ``plain`` or ``abort``: probe_kernel's case ``case`` at ``warps`` warps, to TTGIR
    for cuda:90 under the Triton on sys.path."""
    from test_gpu_compile import compile_for_sm90

    bf = torch.empty(8, dtype=torch.bfloat16)
    args = dict(q=bf, k=bf, v=bf, o=bf, S=4096, scale=0.1, ROWS=65536, x=torch.empty(8),
                flag=3, CASE=case, num_warps=warps, num_stages=2)
    texts: dict[str, str] = {}
    try:
        compile_for_sm90(probe_kernel, args, "ttgir", texts)
    except RuntimeError as exc:  # the pass failed the pipeline (PassManager::run failed)
        if "PassManager::run failed" not in str(exc):
            raise
        return "abort"
    return "ws" if "ttg.warp_specialize" in texts["ttgir"] else "plain"


def else_blocks_with_ops(ttir: str) -> int:
    """The ``scf.if`` else blocks of ``ttir`` (printed MLIR) holding an op other than their
    ``scf.yield``: the ones the Hopper pass refuses."""
    lines, count = ttir.splitlines(), 0
    for i, line in enumerate(lines):
        if line.strip() != "} else {":
            continue
        indent = len(line) - len(line.lstrip())
        for inner in lines[i + 1:]:
            if len(inner) - len(inner.lstrip()) == indent and inner.strip().startswith("}"):
                break
            if inner.strip() and not inner.strip().startswith("scf.yield"):
                count += 1
                break
    return count


def mega_blockers(name: str) -> dict:
    """The constructs of the rule in the megakernel test_gpu_compile builds for graph ``name``
    (its own kinds' dispatch, rank 0's GPU arguments), from its TTIR."""
    import test_gpu_compile as g

    from mgraph.runtime.megakernel.dispatch import PUSH_KIND, megakernel_for
    from mgraph.runtime.megakernel.encode import PUSH_ID, kind_id

    _args, kinds = g.gpu_args(name)
    fn = megakernel_for({k: PUSH_ID if k == PUSH_KIND else kind_id(k) for k in kinds})
    args = g.dispatch_args(name, kinds)
    texts: dict[str, str] = {}
    g.compile_for_sm90(fn, args, "ttir", texts)
    ttir = texts["ttir"]
    return dict(graph=name, kinds=sorted(kinds), num_warps=args["num_warps"],
                scf_while=ttir.count("scf.while"), else_blocks_with_ops=else_blocks_with_ops(ttir),
                dots=len(re.findall(r"tt\.dot ", ttir)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mega", nargs="*", default=[], metavar="GRAPH",
                    help="graphs of tests/test_gpu_compile.py GRAPHS whose megakernel to count")
    args = ap.parse_args()
    print(f"triton {triton.__version__}, cuda:90")
    differ = 0
    for (case, warps), want in CASES.items():
        got = compile_case(case, warps)
        differ += got != want
        doc = re.search(rf"CASE == {case}:  # (.*)", Path(__file__).read_text()).group(1)
        print(f"case {case:2d} warps {warps:2d}: {got:5s} (3.6: {want:5s}) {doc}", flush=True)
    print(f"{differ} case(s) differ from Triton 3.6's")
    for name in args.mega:
        print(mega_blockers(name), flush=True)


if __name__ == "__main__":
    main()
