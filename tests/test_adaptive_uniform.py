"""The megakernel branches only on values every warp of a program agrees on (sync.py, "Uniform
control flow"): the cause of the adaptive AG+GEMM hang on 2 H200 (NOTES v9).

The controller tested its window with each thread's own ``%globaltimer`` read and each thread's
own volatile load of the window start, then ran a compare-and-swap inside that branch; and
``_ticket`` chose a queue from each thread's volatile load of the target. A scalar atomic whose
result is used is a CTA barrier, a shared-memory store and another barrier in the compiled code,
so warps that disagreed met at different barriers and the kernel hung where no watchdog looks.
GEMM+AR and GEMM+RS ran: they have no NVLink tasks, so no program ever reached that code. The
watchdog's own loops (``sync.wait``) had the same flaw on their timeout and abort tests, and so
did the rdma push (``hostfifo.push``) on its wait for FIFO space: each thread read the proxy's
tail, the abort flag and the clock.

The interpreter runs a program as one thread and cannot show this; the compiled kernel can. Each
config is compiled for sm_90 to TTIR on the CPU and checked by tests/cta_uniform.py; the kernel
with every kind and the rdma push, in each of its configs, is checked the same way by
tests/test_gpu_compile.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from cta_uniform import divergent_branches  # noqa: E402
from test_gpu_compile import compile_for_sm90  # noqa: E402

import mgraph as mg  # noqa: E402
import mgraph.runtime.megakernel.runtime as megaruntime  # noqa: E402
from mgraph.runtime.megakernel.dispatch import body_params, megakernel_for  # noqa: E402
from mgraph.runtime.megakernel.encode import kind_id  # noqa: E402
from mgraph.runtime.megakernel.hostfifo import push  # noqa: E402
from mgraph.runtime.megakernel.sync import load_uniform, now_uniform  # noqa: E402
from mgraph.settings import Settings  # noqa: E402


def gpu_launch_args(graph, workers: dict[str, int], **settings):
    """(kernel, the arguments rank 0 launches it with on a GPU): rank 0's own tables and
    programs (not the interpreter's one program), USE_TIMER on, the watchdog in ns."""
    sched = mg.schedule(graph, workers=workers)
    rt = megaruntime.TritonRuntime(
        sched,
        rank=0,
        interpret=True,
        interpret_roles=True,  # one program per worker: rank 0's tables as a GPU encodes them
        shared=megaruntime._SharedMemory(graph, torch.device("cpu")),
        settings=Settings(**settings),
    )
    try:
        rt.interpret = False
        args = rt._kernel_args()
    finally:
        rt.close()
    kinds = {k: kind_id(k) for k in rt.tables.kinds}
    args["NEED_AB"] = any(p in ("ad0", "bd0") for k in kinds for p in body_params(k))
    return megakernel_for(kinds), args


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "static"])
def test_allgather_gemm_megakernel_branches_are_warp_uniform(adaptive):
    g = mg.ops.allgather_gemm(
        M=512,
        N=512,
        K=256,
        topology="1x2",
        dtype=torch.bfloat16,
        tile=[128, 256],
        chunk_bytes=128 * 256 * 2,
    )
    fn, args = gpu_launch_args(g, {"compute": 6, "nvlink": 2}, adaptive=adaptive)
    assert args["ADAPTIVE"] == adaptive and args["SEG_WAITS"] and args["pool"] == 8, args
    module, _ = compile_for_sm90(fn, args, "ttir")
    found = divergent_branches(str(module))
    assert found == [], "branches on per-warp values (file:line <- caller):\n" + "\n".join(found)


@triton.jit
def _volatile_branch(flag, out):
    if tl.load(flag, volatile=True) > 0:  # each warp's own read
        tl.atomic_add(out, 1)


@triton.jit
def _timer_loop(out, limit):
    start = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
    elapsed = tl.zeros((), dtype=tl.int64)
    while elapsed < limit:
        tl.atomic_add(out, 1)
        elapsed = (
            tl.inline_asm_elementwise(
                "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
            )
            - start
        )


@triton.jit
def _small_block_branch(flag, out):
    # 32 lanes in 8 warps: each warp holds its own copy of the block and reduces its own reads
    if tl.max(tl.load(flag + tl.zeros([32], dtype=tl.int32), volatile=True), axis=0) > 0:
        tl.atomic_add(out, 1)


@triton.jit
def _uniform_branches(flag, out, limit):
    if load_uniform(flag) > 0:
        tl.atomic_add(out, 1)
    start = now_uniform(True)
    while now_uniform(True) - start < limit:
        v = tl.atomic_add(out, 1)  # an atomic's result is broadcast: uniform
        if v > 3:
            tl.atomic_add(out, 1)


def test_the_check_finds_branches_on_volatile_loads_and_the_clock():
    """The analysis can fail: a branch on a volatile load, a loop on the timer (through a
    loop-carried value), a branch on the reduction of a block too small to span the warps; the
    same shapes through load_uniform / now_uniform pass."""
    p = torch.zeros(4, dtype=torch.int64)
    bad = divergent_branches(
        str(compile_for_sm90(_volatile_branch, dict(flag=p, out=p), "ttir")[0])
    )
    assert len(bad) == 1 and "test_adaptive_uniform.py" in bad[0], bad
    bad = divergent_branches(
        str(compile_for_sm90(_timer_loop, dict(out=p, limit=2**40), "ttir")[0])
    )
    assert len(bad) == 1, bad
    small = dict(flag=p, out=p, num_warps=8)
    bad = divergent_branches(str(compile_for_sm90(_small_block_branch, small, "ttir")[0]))
    assert len(bad) == 1, bad
    good = compile_for_sm90(_uniform_branches, dict(flag=p, out=p, limit=2**40), "ttir")[0]
    assert divergent_branches(str(good)) == []


@triton.jit
def _push_then_branch(ring, dhead, tail, row, abort, out, capacity, epoch, limit):
    ticket, seen = push(ring, dhead, tail, capacity, row, epoch, limit, abort, True)
    if ticket - seen >= capacity:  # as kernel.push_commands records a full FIFO
        tl.atomic_add(out, 1)


def test_the_rdma_push_branches_on_one_tail_read_per_program():
    """``hostfifo.push`` waits for FIFO space on the proxy's tail, the abort flag and the clock:
    its loop, its branches and its caller's test of the result are uniform. The tail's
    ``ld.acquire.sys`` is issued by one lane only (one PCIe read per poll, its value handed to
    every warp by the reduction), and the PTX assembles (ptxas, sm_90): the check above stops
    at TTIR, where inline asm is still a string."""
    import re

    p = torch.zeros(64, dtype=torch.int64)
    args = dict(
        ring=p,
        dhead=p,
        tail=p,
        row=p,
        abort=torch.zeros(4, dtype=torch.int32),
        out=p,
        capacity=64,
        epoch=3,
        limit=10**9,
        num_warps=8,
    )
    texts: dict[str, str] = {}
    cubin, _ = compile_for_sm90(_push_then_branch, args, "cubin", texts)
    assert divergent_branches(texts["ttir"]) == []
    assert isinstance(cubin, bytes) and len(cubin) > 0
    loads = re.findall(r"(\S+)\s+ld\.acquire\.sys\.global\.b64", texts["ptx"])
    # before the loop and in it, each of a thread's elements of the lane block, all predicated
    assert loads and set(loads) == {"@p"}, loads


@pytest.mark.parametrize("op", ["gemm", "gemm_allreduce", "gemm_reduce_scatter"])
def test_a_rank_with_nothing_to_split_runs_without_the_controller(op):
    """Settings(adaptive=True) on a rank with no NVLink task and no NVLink program (GEMM alone;
    GEMM+AR and GEMM+RS on 2 GPUs, whose epilogues reduce-add into the peers) builds the kernel
    without the controller: its rule could only keep every program on compute, and v15 measured
    the idle controller 1.4-4.6% slower than the static split. AG+GEMM's ranks, which have NVLink
    copies, keep it (test_allgather_gemm_megakernel_branches_are_warp_uniform asserts ADAPTIVE)."""
    if op == "gemm":
        g = mg.ops.gemm(M=512, N=512, K=256, topology="1x1", dtype=torch.bfloat16)
    else:
        g = getattr(mg.ops, op)(M=512, N=512, K=256, topology="1x2", dtype=torch.bfloat16)
    assert not any(t.role == "nvlink" for t in g.tasks), "the default lowering changed"
    _fn, args = gpu_launch_args(g, {"compute": 8, "nvlink": 0}, adaptive=True)
    assert args["ADAPTIVE"] is False, args["ADAPTIVE"]
