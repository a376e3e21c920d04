"""The README's Python snippets run as written. Each ```python block starts with a marker:
``# CPU snippet`` blocks are executed here (each in a fresh namespace); ``# GPU snippet`` blocks
need CUDA (and torchrun for several GPUs), so here they are only parsed and checked to import
the mgraph names they use (in that block or an earlier GPU block: they read as one session). A block with neither marker fails: every snippet is one or the other.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
CPU = [b for b in BLOCKS if b.startswith("# CPU snippet")]
GPU = [b for b in BLOCKS if b.startswith("# GPU snippet")]
# Names a GPU snippet may only use after importing them (the rest are the reader's variables).
LIBRARY_NAMES = {"Settings", "TritonRuntime", "local_shards", "run_in_process"}


def test_every_python_block_is_marked():
    assert BLOCKS and len(CPU) + len(GPU) == len(BLOCKS), [
        b.splitlines()[0] for b in BLOCKS if b not in CPU and b not in GPU
    ]
    assert len(CPU) >= 3


@pytest.mark.parametrize("index", range(len(CPU)))
def test_cpu_snippet_runs(index, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # snippets may write files (timeline.json)
    code = compile(CPU[index], f"README.md cpu snippet {index}", "exec")
    exec(code, {"__name__": f"readme_snippet_{index}"})


@pytest.mark.parametrize("index", range(len(GPU)))
def test_gpu_snippet_parses_and_imports_what_it_uses(index):
    tree = ast.parse(GPU[index])
    imported = {a.asname or a.name for block in GPU[: index + 1] for n in ast.walk(ast.parse(block))
                if isinstance(n, ast.ImportFrom | ast.Import) for a in n.names}
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    missing = (used & LIBRARY_NAMES) - imported
    assert not missing, f"GPU snippet {index} uses {sorted(missing)} without importing them"
