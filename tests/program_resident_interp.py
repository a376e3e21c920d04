"""Runs under TRITON_INTERPRET=1 in a subprocess (see test_program_resident.py): one Program on
backend="triton" (1 rank, the interpreted megakernel) called again and again while its inputs
and its module's weights change between calls, each call against eager torch. The weights stay
in the kernel's buffers between calls; every way a weight can change must still be seen.
Prints one JSON line per call: {"case", "error", "copies", "poisoned"} ("copies": the tensors
copied into the kernel's buffers by that call, by input name; "poisoned": whether its launch
NaN-filled the scratch and output buffers first)."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 before importing triton"

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from tp_mlp import LlamaMLP  # noqa: E402

import mgraph as mg  # noqa: E402
from mgraph.runtime.megakernel import runtime as rt_module  # noqa: E402


class Net(nn.Module):
    """A pre-norm residual MLP: weights read transposed (the linears) and as stored (the norm)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.mlp = LlamaMLP(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


COPIES: Counter = Counter()
POISONED: list[bool] = []


def count_copies() -> None:
    """Count load_inputs' copies by input name (buffer_shard is called once per copied buffer)
    and record each launch's ``poison``."""
    shard = rt_module.buffer_shard
    launch = rt_module.TritonRuntime.launch

    def counted(buf, inputs):
        COPIES[buf.binding.tensor] += 1
        return shard(buf, inputs)

    def recorded(self, poison: bool = False) -> None:
        POISONED.append(poison)
        launch(self, poison)

    rt_module.buffer_shard = counted
    rt_module.TritonRuntime.launch = recorded


def main() -> None:
    torch.manual_seed(0)
    model = Net(64, 128).eval()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(1, 32, 64)
    prog = mg.compile(model, (x,), backend="triton", backend_options={"interpret": True})
    count_copies()

    def call(case: str, x: torch.Tensor, **options) -> torch.Tensor:
        COPIES.clear()
        POISONED.clear()
        with torch.no_grad():
            want = model(x)
        got = prog.run(x, **options).outputs["out"]
        error = ((got - want).norm() / want.norm()).item()
        row = {"case": case, "error": error, "copies": dict(COPIES), "poisoned": POISONED == [True]}
        print(json.dumps(row), flush=True)
        return got

    first = call("first", x)
    kept = first.clone()
    call("new-input", torch.randn(1, 32, 64))
    with torch.no_grad():
        model.mlp.up_proj.weight.mul_(-0.5)  # in place: torch bumps its version
    call("in-place-linear", x)
    with torch.no_grad():
        model.norm.weight.copy_(torch.rand(64) + 0.5)  # read as stored (no transpose)
    call("in-place-norm", x)
    model.mlp.down_proj.weight = nn.Parameter(torch.randn(64, 128) / 8)
    call("new-parameter", x)
    model.mlp.gate_proj.weight.data = torch.randn(128, 64) / 8  # new storage, same object
    call("data-assigned", x)
    model.mlp.gate_proj.weight.data.mul_(2.0)  # through .data: torch does not count it
    call("data-write-unseen", x)
    prog.reload_parameters()
    call("reloaded", x)
    call("poisoned-again", torch.randn(1, 32, 64), poison=True)
    with torch.inference_mode():  # a tensor without a version counter: copied at every call
        frozen = torch.randn(128, 64) / 8
    model.mlp.up_proj.weight = nn.Parameter(frozen, requires_grad=False)
    call("inference-tensor", x)
    with torch.inference_mode():
        frozen.mul_(-1.0)
    call("inference-tensor-written", x)
    # the kernel's own weight buffer overwritten behind the Program's back: proof that an
    # unchanged weight is not copied again (the next call reads the bad values)...
    runtime = prog._runtime
    bid = next(b.id for b in prog.graph.buffers.values()
               if b.binding is not None and b.binding.tensor.startswith("mlp.down_proj"))
    runtime.views[bid].fill_(0.0)
    call("stale-buffer", x)
    # ...until a change of that weight copies it again
    with torch.no_grad():
        model.mlp.down_proj.weight.add_(0.0)
    call("stale-buffer-refreshed", x)
    # an output is the caller's own tensor: later launches never write into it
    changed = (first - kept).abs().max().item()
    print(json.dumps({"case": "outputs-are-copies", "error": changed}), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
