"""Attention on H200s: mgraph's attn_block / attn_finalize tile against SDPA, and the ring over
2 GPUs against SDPA + NCCL P2P rings, on the same inputs in the same run (bf16, B4 H16 D128).

    python3 benchmarks/bench_attention.py tile [mega] [--out DIR]           # one GPU
    torchrun --nproc_per_node=2 benchmarks/bench_attention.py ring [--out DIR]

tile: the Triton bodies alone (no megakernel queues or waits: attention_tiles.chains_kernel,
one program per q-block chain, tables built here as the attention lowering would) at the task
shapes (q rows x keys per attn_block task) 128x128 (the lowering's default before v9), 128x1024
(its default from v9 to v12), 128x8192 where S is longer (the default since: at most 8192 keys,
``ring_attention.default_kv_block``), 128xS (one task per q block: the plain flash tile) and
4096x4096, against
``F.scaled_dot_product_attention`` with the cuDNN and the flash (FA2) backends, S = 8192..32768,
causal and not. TF/s count the unmasked work (causal: half). ``--variants NAME... | all`` also
times other shapes of the fast path (``attention_tiles.TILE_VARIANTS``: the pipelined plain
loop, 64-row sub-blocks at 4 warps, 64-key chunks, stages) on the schedule's task shape
(128 x the lowering's keys, finalised inline); every row names its ``variant`` and whether it
is the ``default`` (the megakernel's); each variant's first row holds its kernel's registers,
spills, shared memory and ``programs_per_sm``. ``--tile-shapes schedule`` keeps the default
variant to that shape too (a shorter run). ``--flat`` adds part "flat": a flash kernel that is
not mgraph's (no task tables: the probe's loop) with and without Triton's warp specialisation,
non-causal, against cuDNN: what warp specialisation would buy a tile (``bench_flat``).

mega: the same attention through the megakernel on one GPU (TritonRuntime on the 1x1
ring_attention graph: the kernel the ring runs, with its queues, waits and copy branch),
S = 8192 and 16384 by default (``--mega-seqs``), causal and not, against cuDNN SDPA. Keys per
task: the op's default unless ``--mega-kv-block`` names them (S = 8192: 8192 keys, or the
zigzag chunk of 4096 when causal; 16384: 8192); each row's ``task`` says which.

tile and mega also record what the GPU's own Triton compiled: registers, spilled bytes and
ptxas's C75xx lines ("wgmma.mma_async instructions are serialized ...": every wgmma of the
kernel then waits for the previous one, whatever the loop), from ``ptxas -v`` on the kernel's
PTX with the ptxas Triton uses.

ring: S = 32768 and 65536 in total over 2 GPUs by default (``--ring-seqs 32768 65536 98304``
adds the longest: v8's run with it did not finish in 140 s while the tile ran at ~30 TF/s, 2.7 s
a launch at 65536), causal (zigzag: rank r holds chunks r and 2W-1-r, the layout mgraph uses)
and not. Baselines: cuDNN SDPA + NCCL P2P ring and FA2 SDPA +
NCCL ring, each step's KV send/receive overlapped with the step's attention (double-buffered,
batch_isend_irecv), partial outputs merged by their log-sum-exp in fp32; and each baseline's
compute bound (the same steps without communication). mgraph: the ring_attention graph on
backend triton (the megakernel); a configuration it cannot run is a row with its error.

Finalize: the lowerings' default (``inline_finalize=True``) has every q block's last attn_block
write the output, no attn_finalize task (rows ``task`` "...+inline"). tile times the hand-built
chains both ways (its plain rows end in attn_finalize tasks); mega and ring run the op's default;
``--finalize-tasks`` adds mega rows with attn_finalize tasks and runs the ring that way
instead.

CUDA-event medians (ring: the slowest rank's). Every output is checked first (NaN-poisoned,
relative error and worst 128-row tile against cuDNN SDPA). JSON rows go to DIR (default $OUT,
else /tmp/mgraph_out) and a compact table is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import struct
import sys
from pathlib import Path

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # GPU.md: lazy loading vs spinning kernels
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from mgraph.ops.abi import (  # noqa: E402
    F_KIND,
    F_NPARAM,
    F_NREAD,
    F_NWRITE,
    F_PARAM0,
    F_READ0,
    F_WRITE0,
    TASK_FIELDS,
)
from mgraph.ops.ring_attention import default_kv_block  # noqa: E402
from mgraph.runtime.memory import worst_tile_error  # noqa: E402

B, H, D = 4, 16, 128
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}


def event_times(fn, warmup: int, reps: int, barrier=None) -> list[float]:
    """CUDA-event times (ms) of ``reps`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if barrier is not None:
            barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def tile_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return worst_tile_error(got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1]))


def flops(S_q: int, S_k: int, causal: bool) -> float:
    """Unmasked q k^T and p v flops of B x H heads (causal: the lower triangle)."""
    return 4.0 * B * H * S_q * S_k * D * (0.5 if causal else 1.0)


def kernel_info(compiled) -> dict:
    """Registers and spills of a compiled Triton kernel, and ptxas's verdict on its wgmma
    pipeline (the C75xx lines of ``ptxas -v``: serialised wgmma), by the ptxas Triton uses."""
    import re
    import subprocess
    import tempfile

    info = dict(regs=getattr(compiled, "n_regs", None), spills=getattr(compiled, "n_spills", None),
                shared=compiled.metadata.shared)
    try:
        from triton.backends.nvidia import compiler as nv

        try:  # triton 3.9 picks the ptxas by arch; earlier ones take no argument
            ptxas = nv.get_ptxas(90).path
        except TypeError:
            ptxas = nv.get_ptxas().path
        with tempfile.TemporaryDirectory() as tmp:
            ptx = Path(tmp) / "k.ptx"
            ptx.write_text(compiled.asm["ptx"])
            proc = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(ptx) + ".o"],
                                  capture_output=True, text=True, timeout=300)
        text = proc.stdout + proc.stderr
        info["ptxas_serialized"] = sorted({m.group(0)[:200] for m in re.finditer(
            r"\(C75\d\d\)[^\n]*", text)})
        used = re.search(r"Used (\d+) registers", text)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
        info["ptxas"] = ((used.group(0) if used else "") + "; " +
                         (spill.group(0) if spill else ""))
    except Exception as exc:  # the numbers above stand without it
        info["ptxas_error"] = repr(exc)[:200]
    return info


# -- tile -------------------------------------------------------------------------------------
def chain_tables(S: int, qb: int, kvb: int, causal: bool, device: str,
                 inline: bool = False) -> dict:
    """The tables the attention lowering's tasks encode to, for one rank holding B x H heads of
    S rows (buffer slots 0..5: q, k, v, acc, ml, out), built vectorised: chain c = one q block,
    its attn_block tasks (kvb keys each; causal: none past the block's last query) then its
    attn_finalize, or with ``inline`` (the lowerings' ``inline_finalize``) no attn_finalize and
    the last attn_block ``final``, writing acc, ml and out. Each task has 8 regions: q, k, v,
    acc, ml (state read), acc, ml (writes), out; 7 params (ATTN_PARAMS' order)."""
    from mgraph.kinds import TaskKind
    from mgraph.runtime.megakernel.encode import kind_id

    dev = torch.device(device)
    nq = S // qb
    qi = torch.arange(nq, device=dev).repeat(B * H)
    bh = torch.arange(B * H, device=dev).repeat_interleave(nq)
    if causal:
        nkv = ((qi + 1) * qb + kvb - 1) // kvb
    else:
        nkv = torch.full_like(qi, S // kvb)
    counts = nkv + (0 if inline else 1)
    starts = torch.zeros(len(counts) + 1, dtype=torch.int64, device=dev)
    starts[1:] = counts.cumsum(0)
    T = int(starts[-1])
    chain = torch.arange(len(counts), device=dev).repeat_interleave(counts)
    pos = torch.arange(T, device=dev) - starts[chain]
    final = pos == nkv[chain]  # the attn_finalize task (none with inline)
    last = pos == nkv[chain] - 1  # the chain's last attn_block
    q0 = bh[chain] * S + qi[chain] * qb
    k0 = bh[chain] * S + pos * kvb
    t = torch.arange(T, device=dev)

    def region(slot: int, r0: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
        z = torch.zeros_like(r0)
        return torch.stack([z + slot, r0, r0 + rows, z, z + cols], dim=1)

    regions = torch.stack(
        [region(0, q0, qb, D), region(1, k0, kvb, D), region(2, k0, kvb, D),
         region(3, q0, qb, D), region(4, q0, qb, 2), region(3, q0, qb, D), region(4, q0, qb, 2),
         region(5, q0, qb, D)], dim=1).reshape(-1, 5)
    tasks = torch.zeros(T, TASK_FIELDS, dtype=torch.int64, device=dev)
    first = pos == 0
    tasks[:, F_KIND] = torch.where(final, kind_id(TaskKind.ATTN_FINALIZE.value),
                                   kind_id(TaskKind.ATTN_BLOCK.value))
    tasks[:, F_READ0] = 8 * t + torch.where(final, 3, 0)
    tasks[:, F_NREAD] = torch.where(final, 2, torch.where(first, 3, 5))
    tasks[:, F_WRITE0] = 8 * t + torch.where(final, 7, 5)
    tasks[:, F_NWRITE] = torch.where(final, 1, torch.where(last & inline, 3, 2))
    tasks[:, F_PARAM0] = 7 * t
    tasks[:, F_NPARAM] = 7
    q_start, k_start = qi[chain] * qb, pos * kvb
    scale_bits = struct.unpack("<i", struct.pack("<f", 1.0 / math.sqrt(D)))[0]
    params = torch.stack(
        [q_start, k_start, (causal & (k_start + kvb - 1 > q_start)).long(), first.long(),
         torch.full_like(t, scale_bits), torch.zeros_like(t), (last & inline).long()],
        dim=1).reshape(-1)
    return {
        "tasks": tasks.int(), "regions": regions.int(), "params": params.int(),
        "order": t.int(), "starts": starts.int(), "chains": len(counts), "tasks_n": T,
    }


def occupancy(info: dict, warps: int) -> int | None:
    """Programs of ``warps`` warps one H200 SM holds at once, by the kernel's registers and
    shared memory (228 KB an SM, 1 KB of it reserved per program; 64K registers, allocated per
    warp in units of 256): 2 lets one program's softmax overlap the other's wgmma."""
    if info.get("regs") is None or info.get("shared") is None:
        return None
    per_warp = -(-info["regs"] * 32 // 256) * 256
    return min(233472 // (info["shared"] + 1024), 65536 // (per_warp * warps), 64 // warps)


def bench_tile(args) -> list[dict]:
    from mgraph.kinds import TaskKind
    from mgraph.ops.attention_tiles import DEFAULT_VARIANT, TILE_VARIANTS, chains_kernel
    from mgraph.runtime.megakernel.encode import kind_id

    rows, infos = [], {}
    variants = list(TILE_VARIANTS) if args.variants == ["all"] else args.variants
    unknown = [v for v in variants if v not in TILE_VARIANTS]
    if unknown:
        sys.exit(f"unknown variants {unknown}: choose from {', '.join(TILE_VARIANTS)} or all")
    # the default first: its rows are the ones earlier runs have
    variants = sorted(set(variants), key=lambda v: (v != DEFAULT_VARIANT, variants.index(v)))
    torch.manual_seed(0)
    for S in args.tile_seqs:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            fl = flops(S, S, causal)
            ref = {}
            for name, backend in BACKENDS.items():
                with sdpa_kernel(backend):
                    ref[name] = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    ms = statistics.median(event_times(
                        lambda q=q, k=k, v=v, c=causal: F.scaled_dot_product_attention(
                            q, k, v, is_causal=c),
                        args.warmup, args.reps))
                rows.append(dict(part="tile", S=S, causal=causal, impl=f"sdpa_{name}",
                                 ms=round(ms, 4), tflops=round(fl / ms / 1e9, 1)))
                print(json.dumps(rows[-1]), flush=True)
            cudnn_ms = rows[-2]["ms"]
            acc = torch.empty(B * H * S, D, device="cuda", dtype=torch.float32)
            ml = torch.empty(B * H * S, 2, device="cuda", dtype=torch.float32)
            out = torch.empty(B * H * S, D, device="cuda", dtype=torch.bfloat16)
            bufs = [q.view(-1, D), k.view(-1, D), v.view(-1, D), acc, ml, out]
            addr = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64, device="cuda")
            cols = torch.tensor([b.shape[1] for b in bufs], dtype=torch.int32, device="cuda")
            default = default_kv_block(S, 128)  # the lowering's default
            # the schedule's shape: the lowering's keys per task, the chain's last task
            # finalising (the lowerings' default); every variant runs it
            shapes = [(128, default, True)]
            if args.tile_shapes == "all":  # and, for the default variant, the others
                shapes = [(128, 1024, False), (128, S, False), (4096, 4096, False)]
                if default not in (1024, S):
                    shapes.insert(1, (128, default, False))
                if S <= 16384:
                    shapes.insert(0, (128, 128, False))  # 1M tasks past that: 250 MB tables
                shapes += [(128, 1024, True), (128, default, True)]
            tables = {}
            for variant in variants:
                shape = TILE_VARIANTS[variant]
                mine = shapes if variant == DEFAULT_VARIANT else shapes[-1:]
                for qb, kvb, inline in mine:
                    key = (qb, kvb, inline)
                    tb = tables.get(key) or chain_tables(S, qb, kvb, causal, "cuda", inline)
                    if key == shapes[-1]:  # the one every variant runs: built once
                        tables[key] = tb
                    task = f"{qb}x{kvb}" + ("+inline" if inline else "")
                    base = dict(part="tile", S=S, causal=causal, impl="mgraph_tile",
                                variant=variant, default=variant == DEFAULT_VARIANT)

                    def launch(tb=tb, addr=addr, cols=cols, shape=shape):
                        return chains_kernel[(tb["chains"],)](
                            tb["tasks"], tb["order"], tb["starts"], tb["params"], tb["regions"],
                            addr, cols, BLOCK_ID=kind_id(TaskKind.ATTN_BLOCK.value),
                            DT=tl_bf16(), USE_TIMER=True, ATTN_D=D, PIPE=shape["PIPE"],
                            QB=shape["QB"], KB=shape["KB"], OUT=shape["OUT"],
                            num_warps=shape["num_warps"],
                            num_stages=shape["num_stages"])

                    out.fill_(float("nan"))
                    acc.fill_(float("nan"))
                    ml.fill_(float("nan"))
                    try:
                        compiled = launch()
                        torch.cuda.synchronize()
                        if variant not in infos:
                            infos[variant] = kernel_info(compiled)
                            rows.append(dict(base, kernel="chains_kernel", **infos[variant],
                                             programs_per_sm=occupancy(
                                                 infos[variant], shape["num_warps"]), **shape))
                            print(json.dumps(rows[-1]), flush=True)
                        got = out.view(B, H, S, D)
                        err, terr = rel(got, ref["cudnn"]), tile_err(got, ref["cudnn"])
                        ms = statistics.median(event_times(launch, args.warmup, args.reps))
                    except Exception as exc:  # a shape that cannot compile or run is reported
                        rows.append(dict(base, task=task, error=repr(exc)[:300]))
                        print(json.dumps(rows[-1]), flush=True)
                        continue
                    rows.append(dict(
                        base, task=task, tasks=tb["tasks_n"], warps=shape["num_warps"],
                        stages=shape["num_stages"], ms=round(ms, 4),
                        tflops=round(fl / ms / 1e9, 1), vs_cudnn=round(cudnn_ms / ms, 3),
                        rel_err=round(err, 5), worst_tile_err=round(terr, 5)))
                    print(json.dumps(rows[-1]), flush=True)
            del tables
            del acc, ml, out, bufs, ref
            torch.cuda.empty_cache()
    return rows


def tl_bf16():
    return tl.bfloat16


# -- flat -------------------------------------------------------------------------------------
_FLAT = tl.constexpr(128)  # q rows, keys a step and head size of the flat kernel


@triton.jit
def flat_attention(q, k, v, o, S, scale, ROWS, WS: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    qd = tl.make_tensor_descriptor(q, [ROWS, _FLAT], [_FLAT, 1], [_FLAT, _FLAT])
    kd = tl.make_tensor_descriptor(k, [ROWS, _FLAT], [_FLAT, 1], [_FLAT, _FLAT])
    vd = tl.make_tensor_descriptor(v, [ROWS, _FLAT], [_FLAT, 1], [_FLAT, _FLAT])
    od = tl.make_tensor_descriptor(o, [ROWS, _FLAT], [_FLAT, 1], [_FLAT, _FLAT])
    base = bh * S
    qb = qd.load([base + pid_m * _FLAT, 0])
    m_i = tl.full([_FLAT], float("-inf"), tl.float32)
    l_i = tl.full([_FLAT], 1.0, tl.float32)
    acc = tl.zeros([_FLAT, _FLAT], tl.float32)
    qk_scale = scale * 1.4426950408889634
    for n in tl.range(0, S, _FLAT, warp_specialize=WS):
        s = tl.dot(qb, kd.load([base + n, 0]).T)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(tl.bfloat16), vd.load([base + n, 0]), acc * alpha[:, None])
        m_i = m_new
    od.store([base + pid_m * _FLAT, 0], (acc / l_i[:, None]).to(tl.bfloat16))


def bench_flat(args) -> list[dict]:
    """Not mgraph's tile: a flat flash-attention kernel (../shared/probes/attn_tile.py's loop,
    one program per 128-row q block, no task tables, no state) with and without Triton's
    warp specialisation (``tl.range(..., warp_specialize=True)``, 4 warps: on sm_90, Triton 3.6
    splits it into a TMA producer and two consumer warpgroups of 64 rows). What warp
    specialisation would buy the tile, which cannot use it: compiled for sm_90, Triton 3.6
    specialises only at exactly 4 warps and only where no ``if`` of the function has an else
    block holding ops, and aborts on a ``while`` (benchmarks/ws_rule_probe.py); chains_kernel
    and the megakernel (8 warps, queue loop and spin waits) fail those. Non-causal rows only;
    S from ``--tile-seqs``."""
    rows = []
    torch.manual_seed(0)
    for S in args.tile_seqs:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        fl = flops(S, S, False)
        with sdpa_kernel(BACKENDS["cudnn"]):
            want = F.scaled_dot_product_attention(q, k, v)
            cudnn_ms = statistics.median(event_times(
                lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v), args.warmup,
                args.reps))
        rows.append(dict(part="flat", S=S, causal=False, impl="sdpa_cudnn", ms=round(cudnn_ms, 4),
                         tflops=round(fl / cudnn_ms / 1e9, 1)))
        print(json.dumps(rows[-1]), flush=True)
        o = torch.empty_like(q)
        for ws, warps, stages in ((False, 8, 3), (True, 4, 2)):
            impl = "triton_flat_ws" if ws else "triton_flat"

            def launch(ws=ws, warps=warps, stages=stages, q=q, k=k, v=v, o=o, S=S):
                return flat_attention[(S // 128, B * H)](
                    q, k, v, o, S, D ** -0.5, B * H * S, WS=ws, num_warps=warps,
                    num_stages=stages)

            o.fill_(float("nan"))
            try:
                compiled = launch()
                torch.cuda.synchronize()
                err, terr = rel(o, want), tile_err(o, want)
                ms = statistics.median(event_times(launch, args.warmup, args.reps))
            except Exception as exc:  # a configuration that cannot compile or run is reported
                rows.append(dict(part="flat", S=S, causal=False, impl=impl, error=repr(exc)[:300]))
                print(json.dumps(rows[-1]), flush=True)
                continue
            rows.append(dict(part="flat", S=S, causal=False, impl=impl, task=f"128xS w{warps}",
                             warps=warps, stages=stages, regs=getattr(compiled, "n_regs", None),
                             shared=compiled.metadata.shared, ms=round(ms, 4),
                             tflops=round(fl / ms / 1e9, 1), vs_cudnn=round(cudnn_ms / ms, 3),
                             rel_err=round(err, 5), worst_tile_err=round(terr, 5)))
            print(json.dumps(rows[-1]), flush=True)
        torch.cuda.empty_cache()
    return rows


# -- mega -------------------------------------------------------------------------------------
def mega_rows(args, graph, inputs: dict, want: torch.Tensor, base: dict, fl: float,
              cudnn_ms: float, inline: bool) -> list[dict]:
    """The megakernel's row of ``graph``: run once and checked against ``want``, then timed;
    before it, at the first S and non-causal, a row with the kernel's registers and spills."""
    import mgraph as mg
    from mgraph.runtime.megakernel import TritonRuntime

    S = base["S"]
    kvb = max(t.reads[1].row1 - t.reads[1].row0 for t in graph.tasks
              if t.kind == "attn_block")  # the option's value, or the op's default
    task = f"{args.mega_block}x{kvb}" + ("+inline" if inline else "")
    rows = []
    try:
        rt = TritonRuntime(mg.schedule(graph))
        got = rt.run(inputs).outputs["out"].reshape(B, H, S, D)
        err, terr = rel(got, want), tile_err(got, want)
        if S == args.mega_seqs[0] and not base["causal"]:
            rows.append(dict(base, impl="mgraph_mega", kernel="megakernel" + "+inline" * inline,
                             programs=int(rt.tables.programs), **kernel_info(rt.compiled)))
        ms = statistics.median(event_times(rt.launch, args.warmup, args.reps))
        rt.check()
        rows.append(dict(base, impl="mgraph_mega", task=task, tasks=len(graph.tasks),
                         ms=round(ms, 4), tflops=round(fl / ms / 1e9, 1),
                         vs_cudnn=round(cudnn_ms / ms, 3), rel_err=round(err, 5),
                         worst_tile_err=round(terr, 5)))
    except Exception as exc:  # not runnable: the row says why
        rows.append(dict(base, impl="mgraph_mega", task=task,
                         error=f"{type(exc).__name__}: {str(exc)[:300]}"))
    return rows


def bench_mega(args) -> list[dict]:
    """The attention graph through the megakernel on one GPU (topology 1x1: no copies, no
    peers), against cuDNN SDPA on the same inputs."""
    import mgraph as mg

    rows = []
    for S in args.mega_seqs:
        for causal in (False, True):
            graph = mg.ops.ring_attention(
                topology="1x1", B=B, H=H, S=S, D=D, causal=causal, block=args.mega_block,
                kv_block=args.mega_kv_block, inline_finalize=True, dtype=torch.bfloat16)
            gen = torch.Generator().manual_seed(S + causal)
            inputs = {n: torch.randn(s.shape, generator=gen).to(torch.bfloat16).cuda()
                      for n, s in graph.inputs.items()}
            q, k, v = (inputs[n].reshape(B, H, S, D) for n in "qkv")
            fl = flops(S, S, causal)
            with sdpa_kernel(BACKENDS["cudnn"]):
                want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                cudnn_ms = statistics.median(event_times(
                    lambda q=q, k=k, v=v, c=causal: F.scaled_dot_product_attention(
                        q, k, v, is_causal=c),
                    args.warmup, args.reps))
            base = dict(part="mega", S=S, causal=causal)
            rows.append(dict(base, impl="sdpa_cudnn", ms=round(cudnn_ms, 4),
                             tflops=round(fl / cudnn_ms / 1e9, 1)))
            print(json.dumps(rows[-1]), flush=True)
            for inline in (True, False) if args.finalize_tasks else (True,):
                if not inline:  # the same tasks plus an attn_finalize task per q block
                    graph = mg.ops.ring_attention(
                        topology="1x1", B=B, H=H, S=S, D=D, causal=causal, block=args.mega_block,
                        kv_block=args.mega_kv_block, inline_finalize=False, dtype=torch.bfloat16)
                for row in mega_rows(args, graph, inputs, want, base, fl, cudnn_ms, inline):
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            del inputs, q, k, v, want
            torch.cuda.empty_cache()
    return rows


# -- ring -------------------------------------------------------------------------------------
def _attn_lse(q, k, v, causal: bool, backend: str):
    """(out, lse [B, H, S_q] fp32) of one ring step by SDPA's cuDNN or flash kernel."""
    if backend == "cudnn":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False)
    else:
        res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False)
    out, lse = res[0], res[1]
    return out, lse.reshape(q.shape[0], q.shape[1], q.shape[2]).float()


def _merge(acc, lse_acc, out, lse, rows: slice) -> None:
    """Fold a step's (out, lse) into the fp32 accumulators on query rows ``rows``."""
    a, la = acc[:, :, rows], lse_acc[:, :, rows]
    new = torch.logaddexp(la, lse)
    a.mul_(torch.exp(la - new).unsqueeze(-1)).add_(out.float() * torch.exp(lse - new).unsqueeze(-1))
    la.copy_(new)


class Ring:
    """SDPA + NCCL P2P ring on ``world`` GPUs: at each step every rank sends the KV it holds to
    rank + 1 and receives rank - 1's while it attends to the KV it holds (two streams)."""

    def __init__(self, q, k, v, causal: bool, backend: str, comm: bool) -> None:
        import torch.distributed as dist

        self.dist, self.rank, self.world = dist, dist.get_rank(), dist.get_world_size()
        self.q, self.causal, self.backend, self.comm = q, causal, backend, comm
        self.own = torch.stack([k, v])
        # two receive buffers: a step receives into the one it does not read
        self.recv = [torch.empty_like(self.own), torch.empty_like(self.own)]
        self.stream = torch.cuda.Stream()
        half = q.shape[2] // 2
        self.first, self.second = slice(0, half), slice(half, None)

    def __call__(self) -> torch.Tensor:
        dist, rank, world = self.dist, self.rank, self.world
        q = self.q
        acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        lse = torch.full(q.shape[:3], float("-inf"), device=q.device, dtype=torch.float32)
        cur, nxt = self.own, self.recv[0]
        for step in range(world):
            reqs = []
            if self.comm and step < world - 1:
                self.stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.stream):
                    reqs = dist.batch_isend_irecv([
                        dist.P2POp(dist.isend, cur, (rank + 1) % world),
                        dist.P2POp(dist.irecv, nxt, (rank - 1) % world),
                    ])
            src = (rank - step) % world
            k, v = cur[0], cur[1]
            if not self.causal:
                out, l_ = _attn_lse(q, k, v, False, self.backend)
                _merge(acc, lse, out, l_, slice(None))
            elif src == rank:  # own zigzag chunks: plain causal in local order
                out, l_ = _attn_lse(q, k, v, True, self.backend)
                _merge(acc, lse, out, l_, slice(None))
            elif src < rank:  # its first chunk precedes both of ours, its second follows both
                h = k.shape[2] // 2
                out, l_ = _attn_lse(q, k[:, :, :h], v[:, :, :h], False, self.backend)
                _merge(acc, lse, out, l_, slice(None))
            else:  # both its chunks precede our second chunk and follow our first
                out, l_ = _attn_lse(q[:, :, self.second].contiguous(), k, v, False, self.backend)
                _merge(acc, lse, out, l_, self.second)
            for r in reqs:
                r.wait()
            if self.comm and step < world - 1:
                torch.cuda.current_stream().wait_stream(self.stream)
                cur, nxt = nxt, self.recv[(step + 1) % 2]
        return acc.to(q.dtype)


def bench_ring(args) -> list[dict]:
    import torch.distributed as dist

    import mgraph as mg
    from mgraph.runtime.megakernel import TritonRuntime, local_shards

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    rows = []

    def slowest(times: list[float]) -> float:
        med = torch.tensor([statistics.median(times)], device="cuda")
        dist.all_reduce(med, op=dist.ReduceOp.MAX)
        return med.item()

    def add(row: dict) -> None:
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)

    for S in args.ring_seqs:
        for causal in (False, True):
            graph = mg.ops.ring_attention(
                topology=f"1x{world}", B=B, H=H, S=S, D=D, causal=causal, block=args.block,
                kv_block=args.kv_block, inline_finalize=not args.finalize_tasks,
                dtype=torch.bfloat16)
            kvb = max(t.reads[1].row1 - t.reads[1].row0 for t in graph.tasks
                      if t.kind == "attn_block")  # the option's value, or the op's default
            gen = torch.Generator().manual_seed(S + causal)
            full = {n: torch.randn(s.shape, generator=gen).to(torch.bfloat16)
                    for n, s in graph.inputs.items()}
            local = {n: t.cuda() for n, t in local_shards(graph, rank, full).items()}
            del full
            q, k, v = (local[n].reshape(B, H, -1, D) for n in "qkv")
            S_l = q.shape[2]
            # this rank's queries against every key: the unmasked work of the slowest rank
            fl = flops(S_l, S, causal)
            base = dict(part="ring", S=S, causal=causal, world=world)
            want = None
            for backend in BACKENDS:
                for comm in (True, False):
                    ring = Ring(q, k, v, causal, backend, comm)
                    impl = f"{backend}+nccl" if comm else f"{backend}_compute_only"
                    got = ring()
                    torch.cuda.synchronize()
                    extra = {}
                    if comm:
                        if want is None:
                            want = got
                        extra = dict(rel_err=round(rel(got, want), 5),
                                     worst_tile_err=round(tile_err(got, want), 5))
                    ms = slowest(event_times(ring, args.warmup, args.reps, dist.barrier))
                    add(dict(base, impl=impl, ms=round(ms, 3), tflops=round(fl / ms / 1e9, 1),
                             **extra))
                    del ring, got
            try:
                rt = TritonRuntime(mg.schedule(graph))
                got = rt.run(local).outputs["out"].reshape(B, H, -1, D)
                err, terr = rel(got, want), tile_err(got, want)
                ms = slowest(event_times(rt.launch, args.warmup, args.reps, dist.barrier))
                rt.check()
                add(dict(base, impl="mgraph", block=args.block, kv_block=kvb,
                         inline_finalize=not args.finalize_tasks,
                         tasks=len(graph.tasks), ms=round(ms, 3), tflops=round(fl / ms / 1e9, 1),
                         rel_err=round(err, 5), worst_tile_err=round(terr, 5)))
                del rt
            except Exception as exc:  # not runnable yet: the row says why
                add(dict(base, impl="mgraph", block=args.block, kv_block=kvb,
                         inline_finalize=not args.finalize_tasks,
                         error=f"{type(exc).__name__}: {str(exc)[:300]}"))
            del local, q, k, v, want
            torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    return rows if rank == 0 else []


# -- report -----------------------------------------------------------------------------------
def table(rows: list[dict]) -> str:
    """One line per (part, S, causal): each implementation's ms (and TF/s), ratios to cuDNN."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["part"], r["S"], r["causal"]), []).append(r)
    lines = []
    for (part, S, causal), rs in groups.items():
        cudnn = next((r["ms"] for r in rs if r["impl"] in ("sdpa_cudnn", "cudnn+nccl")), None)
        rs = sorted(rs, key=lambda r: "kernel" not in r)
        cells = []
        for r in rs:
            # a tile variant other than the default is named in angle brackets
            variant = f"<{r['variant']}>" if r.get("default") is False else ""
            name = r["impl"] + variant + (f"[{r['task']}]" if "task" in r else "")
            if "error" in r:
                cells.append(f"{name}: ERROR")
                continue
            if "kernel" in r:  # the compiled kernel's registers, spills, ptxas's verdict
                serial = "wgmma SERIALIZED" if r.get("ptxas_serialized") else "wgmma pipelined"
                per_sm = (f", {r['programs_per_sm']}/SM" if r.get("programs_per_sm") is not None
                          else "")
                cells.append(f"{r['kernel']}{variant}: {r['regs']} regs, {r['spills']} B "
                             f"spilled, {r.get('shared')} B shared{per_sm}, "
                             f"{serial if 'ptxas_serialized' in r else 'ptxas ?'}")
                continue
            ratio = f" {cudnn / r['ms']:.2f}x" if cudnn else ""
            cells.append(f"{name} {r['ms']:.2f}ms {r['tflops']:.0f}TF/s{ratio}")
        lines.append(f"{part} S={S} {'causal' if causal else 'full'}: " + " | ".join(cells))
    errors = {r["error"] for r in rows if "error" in r}
    lines += [f"error: {e}" for e in sorted(errors)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", nargs="+", choices=("tile", "mega", "ring"),
                        help="ring runs alone, under torchrun")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/mgraph_out"))
    parser.add_argument("--tile-seqs", type=int, nargs="+", default=[8192, 16384, 32768])
    # two lengths, 1 warmup + 3 reps each: the default ring run stays within about 3 minutes
    parser.add_argument("--ring-seqs", type=int, nargs="+", default=[32768, 65536])
    parser.add_argument("--block", type=int, default=2048, help="ring: q rows per task")
    parser.add_argument("--kv-block", type=int, default=None,
                        help="ring: keys per task (default: the op's, 8192 at --block 2048)")
    parser.add_argument("--mega-seqs", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--mega-block", type=int, default=128, help="mega: q rows per task")
    parser.add_argument("--mega-kv-block", type=int, default=None,
                        help="mega: keys per task (default: the op's, up to 8192)")
    parser.add_argument("--finalize-tasks", action="store_true",
                        help="mega: also time the graphs with an attn_finalize task per q block "
                        "(inline_finalize=False); ring: only that way")
    parser.add_argument("--variants", nargs="+", default=["plain"],
                        help="tile: the fast path's shapes to time (attention_tiles."
                        "TILE_VARIANTS, or all); the default one on every task shape, the others "
                        "on the schedule's (128 x the lowering's keys, finalised inline)")
    parser.add_argument("--flat", action="store_true",
                        help="tile: also time a flat flash kernel (not mgraph's) with and without "
                        "Triton's warp specialisation, non-causal (part 'flat')")
    parser.add_argument("--tile-shapes", choices=("all", "schedule"), default="all",
                        help="tile: every task shape for the default variant, or only the "
                        "schedule's")
    parser.add_argument("--warmup", type=int, default=2, help="ring: at most 1")
    parser.add_argument("--reps", type=int, default=5, help="ring: at most 3")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_attention needs CUDA GPUs")
    if "ring" in args.part and len(args.part) > 1:
        sys.exit("ring runs alone (under torchrun)")
    rows = []
    path = Path(args.out) / f"bench_attention_{'_'.join(args.part)}.json"

    def save() -> None:
        """Write the rows so far: a later part that hangs or fails keeps the earlier ones."""
        if rows:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(rows, indent=1) + "\n")

    if "tile" in args.part:
        triton.set_allocator(
            lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        rows += bench_tile(args)
        save()
        if args.flat:
            rows += bench_flat(args)
            save()
    if "mega" in args.part:
        rows += bench_mega(args)
        save()
    if args.part == ["ring"]:
        # a ring step at S=98304 takes 0.1-0.3 s: keep the run within its few minutes
        args.warmup, args.reps = min(args.warmup, 1), min(args.reps, 3)
        rows = bench_ring(args)
        save()
    if rows:
        print(table(rows))
        print(f"rows: {path}")


if __name__ == "__main__":
    main()
