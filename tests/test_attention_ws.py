"""Why the attention tile is not warp-specialised: the rule Triton's Hopper warp-specialisation
pass applies, by benchmarks/ws_rule_probe.py's minimal kernels compiled to TTGIR for sm_90 on
the CPU (no GPU), under the installed Triton.

attention_tiles.py's "Warp specialisation" paragraph rests on it: the pass leaves a loop plain
unless the function runs exactly 4 warps (the megakernel runs 8) and no ``scf.if`` in it has an
else block holding an op besides its yield; past those checks it fails the compilation on an
``scf.while`` (the megakernel's scheduler loop and spin waits). The cases below were measured
under Triton 3.6 (the GPU's) with the probe and give the same under this machine's; if a Triton
upgrade relaxes the rule, this fails and the megakernel's attention loop is worth another try.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import ws_rule_probe as probe  # noqa: E402

# (case, warps): the flat loop alone at 4 warps (specialised) and at the megakernel's 8 (not);
# an else block with ops (a store each side) anywhere in the function; one whose branches only
# pick values (folded to a select: accepted); an scf.while beside the loop (the pass aborts)
RULE = [(0, 4), (0, 8), (2, 4), (5, 4), (12, 4)]


@pytest.mark.parametrize("case,warps", RULE)
def test_hopper_warp_specialisation_rule(case, warps):
    got = probe.compile_case(case, warps)
    assert got == probe.CASES[(case, warps)], (case, warps, got)


def test_else_blocks_with_ops_counts_only_ops():
    ttir = """
    %0 = scf.if %c -> (i32) {
      scf.yield %a : i32
    } else {
      scf.yield %b : i32
    }
    scf.if %c {
      tt.store %p, %v : !tt.ptr<f32>
    } else {
      tt.store %p, %w : !tt.ptr<f32>
    }
    """
    assert probe.else_blocks_with_ops(ttir) == 1
