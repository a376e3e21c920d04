"""Every example runs on the CPU reference backend at 2x2 and matches eager torch (fp32)."""

from __future__ import annotations

import pytest
from test_trace import EXAMPLES, _load

NAMES = sorted(p.stem for p in EXAMPLES.glob("*.py") if not p.stem.startswith("_"))


def test_the_examples_exist():
    assert {
        "tp_mlp", "transformer_block", "ring_attention", "moe_layer", "custom_op", "llama_block"
    } <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_example_matches_eager_torch(name, capsys):
    module = _load(name)
    assert module.__doc__, f"examples/{name}.py needs a docstring"
    err = module.main(topology="2x2", backend="reference")
    assert err < 1e-4
    assert "relative error" in capsys.readouterr().out
