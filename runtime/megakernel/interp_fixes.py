"""Fixes to Triton's interpreter (TRITON_INTERPRET=1, the CPU backend of the tests), applied by
:func:`fix_interpreter` when a runtime interprets; nothing here touches what runs on a GPU.

bfloat16 ``tl.dot``: the interpreter holds a bf16 tensor as a numpy ``uint16`` array of its bit
patterns, and ``InterpreterBuilder.create_dot`` decodes only 8-bit float operands before
``np.matmul(a, b, dtype=acc.dtype)``, so a bf16 dot multiplies the bit patterns as integers
(relative error ~1e10; triton-lang/triton#11584, a fix declined upstream as "not supported
yet"). Loads (pointer, device or host TMA descriptor), ``tl.where`` and casts handle the bits
right: only the dot is wrong (benchmarks/interp_bf16_repro.py shows each path). The fix widens
bf16 operands to float32 before the product: exact (float32 holds every bf16 value, and a bit
shift decodes it, NaN, Inf and subnormals included), and the GPU's arithmetic (exact products
summed in the float32 accumulator). Without it every bf16 GEMM of the megakernel, the static
prefix's (kernel.py) and the dynamic body's (tiles.gemm_tile, gemm_glu's too), is garbage under
the interpreter. attention_tiles._operand and moe_bodies._dot widen their operands in the body
instead (an interpreter-only constexpr branch); with this fix they need not.

Other bf16 arithmetic (``+``, ``*`` of two bf16 tensors) is still computed on the bits by
Triton 3.9's interpreter (triton-lang/triton#10945); the bodies compute in float32.
"""

from __future__ import annotations

import numpy as np

__all__ = ["fix_interpreter", "widen_bf16"]

_FIXED = "_mgraph_bf16_dot"  # marks the patched create_dot (idempotence)


def widen_bf16(bits: np.ndarray) -> np.ndarray:
    """float32 values of bf16 bit patterns (the interpreter's uint16 storage), same shape:
    bf16 is float32's top half, so the shift is exact for every value."""
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def fix_interpreter() -> None:
    """Make the interpreter's ``tl.dot`` compute bf16 operands by value (see the module
    docstring). Idempotent; patches the class, so every interpreted kernel of the process gets
    it (kernels running on a GPU never use the interpreter's builder)."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    if getattr(original, _FIXED, False):
        return

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16:
            a = interpreter.TensorHandle(widen_bf16(a.data), tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = interpreter.TensorHandle(widen_bf16(b.data), tl.float32)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    setattr(create_dot, _FIXED, True)
    builder.create_dot = create_dot
