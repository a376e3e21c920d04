"""Bodies without a dot are functions of their own in the megakernel (dispatch.called_apart).

Inlined, every body's memory accesses were connected through the task row, and Triton's layout
pass (TritonGPUCoalesce) recomputes, per access, the set of accesses connected to it: the Llama
layer's kernel spent most of its build there (benchmarks/build_time.py, benchmarks/NOTES.md).
A noinline call ends that set. Bodies with a dot (gemm's and attention's wgmma loops) stay
inlined: a wgmma in a noinline callee serialises the caller's (ptxas C7510). The generated
ewise chains are each a function too, share one copy of the general path and, when they cover
every chain of the kernel's tasks, compile no fallback.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")

from mgraph.kinds import KINDS  # noqa: E402
from mgraph.runtime.megakernel.dispatch import (  # noqa: E402
    PUSH_KIND,
    called_apart,
    dispatch_source,
    has_body,
)
from mgraph.runtime.megakernel.encode import PUSH_ID, kind_id  # noqa: E402


def test_bodies_with_a_dot_stay_inlined_the_others_are_called():
    shipped = {k for k in KINDS if has_body(k)}
    inlined = {k for k in shipped if not called_apart(k)}
    assert inlined == {"gemm", "gemm_glu", "attn_block", "moe_expert"}, inlined
    assert called_apart(PUSH_KIND)
    kinds = {k: kind_id(k) for k in ("gemm", "attn_block", "ewise", "rms_norm")}
    block, text = dispatch_source(kinds, "")
    for kind, kid in kinds.items():
        apart = kind in ("ewise", "rms_norm")
        assert (f"    _body_{kid}_call(" in block) is apart, block
        assert (f"@triton.jit(noinline=True)\ndef _body_{kid}_call(" in text) is apart, text
        if not apart:
            assert f"    _body_{kid}(" in block, block
    # the wrapper keeps the body's constexprs constexpr (Triton specialises the callee on them)
    assert re.search(rf"def _body_{kinds['rms_norm']}_call\(.*DT: tl\.constexpr", text), text


def test_generated_chains_are_functions_and_the_fallback_is_compiled_only_when_needed():
    from mgraph.ops.elementwise_special import special_source

    key = (1, 1, 20, 1, 0, 0, 0)  # LOAD r1 <- input 0, maps 0
    for fallback in (True, False):
        text = special_source([(key, (64, 128))], 16, "_entry", fallback=fallback)
        assert "@triton.jit(noinline=True)\ndef _ewise_chain_0(" in text
        entry = text[text.index("def _entry") :]
        assert ("ewise_other(" in entry) is fallback, entry


@pytest.mark.slow
def test_called_bodies_are_functions_of_their_own_in_the_ttir():
    """The every-kind megakernel of tests/test_gpu_compile.py through Triton's inliner: each
    body called apart is one function with one call site, every other body is inlined."""
    from test_gpu_compile import compile_for_sm90, dispatch_args, every_kind_megakernel

    fn, kinds = every_kind_megakernel()
    module, _seconds = compile_for_sm90(fn, dispatch_args("block-sp-1x2-bf16", kinds), "ttir")
    text = str(module)
    funcs = re.findall(r'tt\.func (?:public |private )?@"?([^"(\s]+)', text)
    for kind in kinds:
        kid = PUSH_ID if kind == PUSH_KIND else kind_id(kind)
        wrapper = [f for f in funcs if f"._body_{kid}_call__" in f]
        if called_apart(kind):
            assert len(wrapper) == 1, (kind, funcs)
            assert len(re.findall(rf'tt\.call @"?{re.escape(wrapper[0])}', text)) == 1, kind
        else:
            assert not wrapper, (kind, funcs)
