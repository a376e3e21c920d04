"""A plain persistent Triton GEMM with TMA descriptors: the in-run ceiling for the megakernel's
GEMM prefix (same block shape, stages and warps, same grouped tile order), timed beside cuBLAS
in bench_tp.py's ``gemm`` rows as impl ``triton_persistent``. Not part of the library."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _persistent_gemm(a, b, c, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     GROUP: tl.constexpr, NPROG: tl.constexpr):
    pid = tl.program_id(0)
    ad = tl.make_tensor_descriptor(a, [M, K], [K, 1], [BM, BK])
    bd = tl.make_tensor_descriptor(b, [K, N], [N, 1], [BK, BN])
    cd = tl.make_tensor_descriptor(c, [M, N], [N, 1], [BM, BN])
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for t in tl.range(pid, tiles_m * tiles_n, NPROG, flatten=True):
        band = t // (GROUP * tiles_n)
        first = band * GROUP
        rows = min(tiles_m - first, GROUP)
        pm = first + t % rows  # down a band of GROUP tile rows, then the next column
        pn = (t % (GROUP * tiles_n)) // rows
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in tl.range(0, K, BK):
            acc = tl.dot(ad.load([pm * BM, k]), bd.load([k, pn * BN]), acc)
        cd.store([pm * BM, pn * BN], acc.to(c.dtype.element_ty))


def persistent_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    M, K = a.shape
    N = b.shape[1]
    nprog = torch.cuda.get_device_properties(a.device).multi_processor_count
    # device-side tensor descriptors live in a scratch block the launcher asks for
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8,
                                                                 device=a.device))
    _persistent_gemm[(nprog,)](a, b, out, M, N, K, 128, 256, 64, 8, nprog, num_stages=3,
                               num_warps=8)
