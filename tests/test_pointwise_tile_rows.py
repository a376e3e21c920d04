"""A traced pointwise chain tiles by the columns ONE rank holds (mgraph/trace/pointwise.py
``_tile_rows``): SwiGLU over columns sharded past the ranks made tasks of a quarter of the
elements a task is meant to cover (benchmarks/NOTES.md v22: 2x8 Llama layer, 41,421 -> 38,349
tasks). Its rows and its result, against eager torch on the reference backend."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import torch

import mgraph as mg
from mgraph.ops.elementwise import traced_tile_rows

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize(("topology", "ffn"), [("1x1", 2048), ("1x2", 2048), ("2x4", 2048)])
def test_swiglu_tiles_by_its_local_columns(topology, ffn):
    ns = runpy.run_path(str(EXAMPLES / "tp_mlp.py"), run_name="tile_rows")
    torch.manual_seed(0)
    model = ns["LlamaMLP"](hidden=64, ffn=ffn).eval()
    x = torch.randn(1, 256, 64)
    prog = mg.compile(model, (x,), plan=ns["PLAN"], topology=topology)
    world = prog.graph.topology.world_size
    chains = [t for t in prog.graph.tasks if t.kind == "ewise" and "silu" in t.name]
    assert chains
    rows = {t.writes[0].shape[0] for t in chains}
    cols = {t.writes[0].shape[1] for t in chains}
    assert cols == {ffn // world}
    # 2048 global columns would give 32-row tiles; a rank's 256 (at 8 ranks) give 256
    assert rows == {traced_tile_rows(ffn // world)}, (rows, world)
    with torch.no_grad():
        want = model(x)
    got = prog(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
