"""Triton's interpreter multiplies the raw bits of bfloat16 ``tl.dot`` operands: a standalone
reproducer (no mgraph), the evidence behind runtime/megakernel/interp_fixes.py.

    python benchmarks/interp_bf16_repro.py           # Triton as installed
    python benchmarks/interp_bf16_repro.py --fixed   # with mgraph's interpreter fix applied

Under ``TRITON_INTERPRET=1`` a bf16 tensor is a numpy ``uint16`` array of its bit patterns
(``interpreter._get_np_dtype``). Loads, stores, ``tl.where`` and casts to float32 handle that
(``cast_impl`` decodes the bits), but ``InterpreterBuilder.create_dot`` decodes only 8-bit float
operands before ``np.matmul(a, b, dtype=acc.dtype)``: a bf16 x bf16 dot with a float32
accumulator multiplies the bit patterns as integers (relative error ~1e9-1e11). How the operands
are loaded does not matter: pointer loads, a device-side ``tl.make_tensor_descriptor`` and a host
``TensorDescriptor`` all give the same bits; widening the operands to float32 before the dot
gives the right product. On a GPU the same kernels are right. Upstream: triton-lang/triton#11584
(closed; the fix, #11585, was declined: bf16 is "not supported yet" by the interpreter).

Each line: how the operands are loaded, whether they are widened before the dot, and the
relative error against float32 torch of bf16-rounded inputs (~1e-7 is right).
"""

from __future__ import annotations

import argparse
import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

N = 32


@triton.jit
def _dot(x, y, WIDEN: tl.constexpr):
    acc = tl.zeros((x.shape[0], y.shape[1]), dtype=tl.float32)
    if WIDEN:
        return tl.dot(x.to(tl.float32), y.to(tl.float32), acc)
    return tl.dot(x, y, acc)


@triton.jit
def pointer_kernel(a, b, c, N: tl.constexpr, WIDEN: tl.constexpr):
    i = tl.arange(0, N)
    x = tl.load(a + i[:, None] * N + i[None, :])
    y = tl.load(b + i[:, None] * N + i[None, :])
    tl.store(c + i[:, None] * N + i[None, :], _dot(x, y, WIDEN))


@triton.jit
def device_desc_kernel(a, b, c, N: tl.constexpr, WIDEN: tl.constexpr):
    ad = tl.make_tensor_descriptor(a, [N, N], [N, 1], [N, N])
    bd = tl.make_tensor_descriptor(b, [N, N], [N, 1], [N, N])
    i = tl.arange(0, N)
    tl.store(c + i[:, None] * N + i[None, :], _dot(ad.load([0, 0]), bd.load([0, 0]), WIDEN))


@triton.jit
def host_desc_kernel(ad, bd, c, N: tl.constexpr, WIDEN: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(c + i[:, None] * N + i[None, :], _dot(ad.load([0, 0]), bd.load([0, 0]), WIDEN))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixed", action="store_true",
                        help="apply runtime/megakernel/interp_fixes.py's fix first")
    args = parser.parse_args()
    if args.fixed:
        from mgraph.runtime.megakernel.interp_fixes import fix_interpreter

        fix_interpreter()
    gen = torch.Generator().manual_seed(0)
    print(f"triton {triton.__version__}, interpreter{' + mgraph fix' if args.fixed else ''}")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        a = torch.randn(N, N, generator=gen).to(dtype)
        b = torch.randn(N, N, generator=gen).to(dtype)
        want = a.float() @ b.float()
        for path in ("pointer", "device descriptor", "host descriptor"):
            for widen in (False, True):
                c = torch.zeros(N, N)
                if path == "pointer":
                    pointer_kernel[(1,)](a, b, c, N, widen)
                elif path == "device descriptor":
                    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
                    device_desc_kernel[(1,)](a, b, c, N, widen)
                else:
                    host_desc_kernel[(1,)](TensorDescriptor.from_tensor(a, [N, N]),
                                           TensorDescriptor.from_tensor(b, [N, N]), c, N, widen)
                err = ((c - want).norm() / want.norm()).item()
                how = "widened to fp32" if widen else "as loaded"
                print(f"{str(dtype):15s} {path:18s} {how:16s} rel err {err:.3g}")


if __name__ == "__main__":
    main()
