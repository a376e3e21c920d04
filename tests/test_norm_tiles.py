"""Row tiles of traced norms (ops/tilewise.traced_norm_rows): 32 rows a task where rows have 4096
columns or more, 64 below, on the CPU reference backend against torch on random inputs. The
Llama layer's 4096-row norms made 64 tasks for 132 programs at 64 rows (benchmarks/NOTES.md
v17)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import mgraph as mg
from mgraph.ops.tilewise import traced_norm_rows


class Norms(nn.Module):
    def __init__(self, cols: int) -> None:
        super().__init__()
        self.rms = nn.RMSNorm(cols, eps=1e-6)
        self.ln = nn.LayerNorm(cols)
        with torch.no_grad():  # not the ones and zeros they start with
            for p in self.parameters():
                p.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.rms(x))


@pytest.mark.parametrize("cols,rows,want", [(4096, 80, 32), (2048, 80, 64), (8192, 40, 32)])
def test_traced_norms_tile_by_width_and_match_torch(cols, rows, want):
    assert traced_norm_rows(cols) == want
    torch.manual_seed(cols)
    model = Norms(cols).eval()
    x = torch.randn(1, rows, cols)
    prog = mg.compile(model, (x,), topology="1x1")
    norms = [t for t in prog.graph.tasks if t.kind in ("rms_norm", "layer_norm")]
    assert {t.kind for t in norms} == {"rms_norm", "layer_norm"}
    # every task a whole-row tile of `want` rows but the last, which ends at `rows`
    for kind in ("rms_norm", "layer_norm"):
        spans = sorted((r.row0, r.row1) for t in norms if t.kind == kind
                       for r in t.writes[:1])
        assert spans == [(r0, min(r0 + want, rows)) for r0 in range(0, rows, want)], kind
    with torch.no_grad():
        expect = model(x)
    got = prog(x)
    assert ((got - expect).norm() / expect.norm()).item() < 1e-5
