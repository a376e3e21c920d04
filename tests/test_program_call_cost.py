"""A Program call's host work is worked out once and kept, without giving up a check.

A Program on backend="triton" finds, at its first call, where each module tensor it builds
parameters from lives (program._Sources) and each input's checks; the runtime keeps each
input's buffer views and the outputs' (runtime._CallPlan). These tests show that what is kept
never hides a change or a bad input:

- under TRITON_INTERPRET=1 (this file run as a subprocess: ``main``): a Program called while
  its module's tensors are replaced (a new Parameter, a new buffer tensor, a new submodule, a
  submodule removed and put back) or written in place, each call against eager torch, and a
  bad input between good calls;
- on any CPU, no launch: _Sources against named_parameters/named_buffers after each kind of
  change; TritonRuntime.load_inputs' named errors for every bad input (its fast path accepts
  only what check_inputs accepts); the watchdog record read from the host copy ``run`` waits
  for;
- on a GPU (``test_gpu_calls_match_eager_and_a_timed_out_launch_raises``): calls that replay
  the CUDA graph against eager torch, waiting and not (runtime/megakernel/inflight.py), and a
  launch that times out raising through those copies.

How to measure the host time of a call (not a test; numbers in the commit that added this):
``TRITON_INTERPRET=1 python tests/test_program_call_cost.py --time``: prog(x) of the
bench_layer.py Llama layer at its smoke size, the kernel launch stubbed out after the first
call, microseconds per call.
"""

from __future__ import annotations

import json
import os
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import mgraph as mg
from helpers import interpreter_rows
from mgraph.builder import GraphBuilder, piece
from mgraph.kinds import Role
from mgraph.program import _Sources

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "examples"))

from tp_mlp import LlamaMLP  # noqa: E402


class Net(nn.Module):
    """A pre-norm residual MLP with a scale buffer: parameters read transposed (the linears)
    and as stored (the norm), and a buffer."""

    def __init__(self, hidden: int = 64, ffn: int = 128) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-5)
        self.mlp = LlamaMLP(hidden, ffn)
        self.register_buffer("scale", torch.rand(hidden) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x)) * self.scale


def built(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    net = Net().eval()
    with torch.no_grad():
        net.norm.weight.uniform_(0.5, 1.5)
    return net


# -- under the interpreter (a subprocess) ---------------------------------------------------------
# case -> whether the call raises (the exception's class name) instead of returning a result
CASES = {
    "first": None,
    "new-parameter": None,  # mlp.up_proj.weight = nn.Parameter(...)
    "in-place": None,  # norm.weight.mul_()
    "new-buffer": None,  # net.scale = tensor
    "new-submodule": None,  # mlp.down_proj = nn.Linear(...)
    "new-parent-module": None,  # net.mlp = LlamaMLP(...)
    "wrong-shape": "InputError",
    "wrong-dtype": "DTypeError",
    "wrong-count": "InputError",
    "after-errors": None,
}


def main() -> None:
    """Under TRITON_INTERPRET=1: one JSON line per case, {"case", "error" (relative, against
    eager torch), "raised" (an exception's class name, or None)}; then "outputs-kept": how far
    the first call's result moved while the others ran (0: it is the caller's own copy)."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 first"
    torch.set_num_threads(1)
    net = built()
    x = torch.randn(1, 32, 64)
    prog = mg.compile(net, (x,), backend="triton", backend_options={"interpret": True})

    def call(case: str, *args: object) -> torch.Tensor | None:
        row: dict = {"case": case, "error": None, "raised": None}
        try:
            got = prog(*args)
        except mg.MgraphError as exc:
            row["raised"] = type(exc).__name__
            print(json.dumps(row), flush=True)
            return None
        with torch.no_grad():
            want = net(*args)
        row["error"] = ((got - want).norm() / want.norm()).item()
        print(json.dumps(row), flush=True)
        return got

    first = call("first", x)
    kept = first.clone()
    net.mlp.up_proj.weight = nn.Parameter(torch.randn(128, 64) / 8)
    call("new-parameter", x)
    with torch.no_grad():
        net.norm.weight.mul_(-0.5)
    call("in-place", x)
    net.scale = torch.rand(64) + 1.0  # a registered buffer's name: a new buffer tensor
    call("new-buffer", x)
    net.mlp.down_proj = nn.Linear(128, 64, bias=False)
    call("new-submodule", x)
    other = LlamaMLP(64, 128)
    net.mlp = other
    call("new-parent-module", x)
    call("wrong-shape", torch.randn(1, 16, 64))
    call("wrong-dtype", x.double())
    call("wrong-count", x, x)
    call("after-errors", torch.randn(1, 32, 64))
    print(json.dumps({"case": "outputs-kept", "error": (first - kept).abs().max().item()}))


@cache
def rows() -> dict[str, dict]:
    return interpreter_rows(Path(__file__).name)


def test_program_calls_see_every_change_and_check_every_input():
    got = dict(rows())
    assert got.pop("outputs-kept")["error"] == 0.0
    assert list(got) == list(CASES), list(got)
    for case, raised in CASES.items():
        r = got[case]
        assert r["raised"] == raised, r
        if raised is None:
            assert r["error"] < 1e-5, r


# -- _Sources on any CPU ----------------------------------------------------------------------------
FQNS = ["mlp.gate_proj.weight", "norm.weight", "scale", "mlp.down_proj.weight"]


def by_name(net: nn.Module) -> list[torch.Tensor]:
    """What the Program's full lookup reads: named_parameters, named_buffers over them."""
    tensors = dict(net.named_parameters(remove_duplicate=False))
    tensors.update(net.named_buffers(remove_duplicate=False))
    return [tensors[f] for f in FQNS]


def same(a: list[torch.Tensor] | None, b: list[torch.Tensor]) -> bool:
    return a is not None and len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def changes() -> dict:
    """Each way a module's tensors can change place; True where _Sources must follow the new
    tensor (no full lookup), False where it must give up (resolve None: the Program looks
    every name up again)."""

    def new_parameter(n: Net) -> None:
        n.norm.weight = nn.Parameter(torch.rand(64))

    def new_buffer(n: Net) -> None:
        n.scale = torch.rand(64)

    def parameter_data(n: Net) -> None:
        n.mlp.gate_proj.weight.data = torch.randn(128, 64)  # same object: _Seen's business

    def new_submodule(n: Net) -> None:
        n.mlp.down_proj = nn.Linear(128, 64, bias=False)

    def new_parent(n: Net) -> None:
        n.mlp = LlamaMLP(64, 128)

    def removed_and_back(n: Net) -> None:
        mlp = n.mlp
        del n.mlp
        n.mlp = mlp

    def shadowed(n: Net) -> None:
        # a buffer of a parameter's name wins in the full lookup (named_buffers last)
        n.norm._buffers["weight"] = torch.rand(64)

    def buffer_gone(n: Net) -> None:
        n.scale = None

    def submodule_gone(n: Net) -> None:
        del n.mlp.down_proj

    return {
        "new-parameter": (new_parameter, True),
        "new-buffer": (new_buffer, True),
        "parameter-data": (parameter_data, True),
        "new-submodule": (new_submodule, True),
        "new-parent-module": (new_parent, True),
        "removed-and-back": (removed_and_back, True),
        "shadowed": (shadowed, False),
        "buffer-gone": (buffer_gone, False),
        "submodule-gone": (submodule_gone, False),
    }


@pytest.mark.parametrize("change", list(changes()))
def test_sources_follow_new_tensors_and_give_up_on_moved_names(change):
    net = built()
    sources = _Sources.find(net, FQNS, {}, by_name(net))
    assert sources is not None and same(sources.resolve(), by_name(net))
    apply, followed = changes()[change]
    apply(net)
    got = sources.resolve()
    if followed:
        assert same(got, by_name(net))
    else:
        assert got is None


def test_sources_refuse_a_module_whose_names_lead_elsewhere():
    """A module whose named_parameters reports another tensor than its tables hold: no
    kept paths (looked up by name at every call)."""
    net = built()
    found = by_name(net)
    found[1] = torch.rand(64)  # what an overriding named_parameters might report
    assert _Sources.find(net, FQNS, {}, found) is None
    constant = torch.rand(3)
    kept = _Sources.find(net, ["c", *FQNS], {"c": constant}, [constant, *by_name(net)])
    assert kept is not None and kept.resolve()[0] is constant


# -- TritonRuntime's per-call checks, no launch ---------------------------------------------------
def copy_graph():
    b = GraphBuilder("two", mg.Topology.parse("1x1"), "float32", {})
    b.global_input("x", (32, 16))
    b.global_input("w", (32, 16))
    b.global_output("out", (32, 16))
    x = b.bound_buffer("x", 0, "x", [piece((32, 16))])
    b.bound_buffer("w", 0, "w", [piece((32, 16))])
    out = b.bound_buffer("out", 0, "out", [piece((32, 16))], role="output")
    b.task(0, Role.COMPUTE, "copy", [x.region()], [out.region()], name="x0")
    return b.finish()


@pytest.fixture(scope="module")
def runtime():
    from mgraph.runtime.megakernel import TritonRuntime

    return TritonRuntime(mg.schedule(copy_graph()), interpret=True)


BAD = {  # inputs, resident -> the named error load_inputs raises
    "missing": (lambda x, w: {"x": x}, (), mg.InputError),
    "unexpected": (lambda x, w: {"x": x, "w": w, "v": w}, (), mg.InputError),
    "extra-for-resident": (lambda x, w: {"x": x, "v": w}, ("w",), mg.InputError),
    "shape": (lambda x, w: {"x": x[:16], "w": w}, (), mg.InputError),
    "shape-resident": (lambda x, w: {"x": x.view(16, 32)}, ("w",), mg.InputError),
    "dtype": (lambda x, w: {"x": x, "w": w.double()}, (), mg.DTypeError),
    "not-a-tensor": (lambda x, w: {"x": x, "w": w.tolist()}, (), mg.InputError),
    # one name twice counts once: x is still missing
    "resident-twice": (lambda x, w: {}, ("w", "w"), mg.InputError),
}


@pytest.mark.parametrize("case", list(BAD))
def test_load_inputs_names_every_bad_input(runtime, case):
    x, w = torch.randn(32, 16), torch.randn(32, 16)
    runtime.load_inputs({"x": x, "w": w})
    make, resident, error = BAD[case]
    with pytest.raises(error):
        runtime.load_inputs(make(x, w), resident=resident)
    x2 = torch.randn(32, 16)
    runtime.load_inputs({"x": x2}, resident=("w", "w"))  # a name twice is still one input
    assert torch.equal(runtime.views["x@0"], x2) and torch.equal(runtime.views["w@0"], w)


def test_the_watchdog_record_is_read_from_the_copy_run_waited_for(runtime):
    record = torch.zeros(8, dtype=torch.int64)
    runtime.check(record)  # a clear record: nothing raised
    record[:] = torch.tensor([1, 0, 0, -1, 0, 7, 9, 3])  # the entry barrier
    with pytest.raises(mg.WatchdogTimeout, match="value 7, target 9, epoch 3"):
        runtime.check(record)
    runtime.failed = None  # only this test's record: the runtime itself never timed out


@pytest.mark.gpu
@pytest.mark.parametrize("wait", [False, True])
def test_gpu_calls_match_eager_and_a_timed_out_launch_raises(wait):
    """On a GPU the watchdog record comes back through pinned host copies queued behind the
    kernel: good calls (the third on replays the CUDA graph) match eager torch, also issued
    back to back without a wait; then a wait raised past what the graph signals times out
    inside the replayed kernel. A call that does not wait (the default) returns NaN for it
    and the timeout is raised by ``synchronize()`` and by every later call; with
    ``backend_options={"wait": True}`` the call itself raises, as does the next (the runtime
    stays failed)."""
    from mgraph.settings import Settings

    torch.manual_seed(0)
    net = Net(1024, 4096).to("cuda", torch.bfloat16).eval()
    x = torch.randn(2, 256, 1024, device="cuda", dtype=torch.bfloat16)
    prog = mg.compile(net, (x,), backend="triton", backend_options={"wait": True} if wait else None)
    for call in range(3):
        x = torch.randn_like(x)
        # the settings are read when the runtime is built, at the first call
        got = prog.run(x, settings=Settings(watchdog_s=1.0) if call == 0 else None)
        with torch.no_grad():
            want = net(x).float()
        error = ((got.outputs["out"].float() - want).norm() / want.norm()).item()
        assert error < 2e-2, (call, error)
    xs = [torch.randn_like(x) for _ in range(6)]
    outs = [prog(v) for v in xs]  # issued back to back: at most InFlight.limit in flight
    prog.synchronize()
    for v, out in zip(xs, outs, strict=True):
        with torch.no_grad():
            want = net(v).float()
        assert ((out.float() - want).norm() / want.norm()).item() < 2e-2
    runtime = prog._runtime
    assert runtime._graph is not None and runtime.tables.waits.shape[0] > 0
    runtime.d["waits"][0, 1] += 1  # one more signal than the graph ever sends
    if wait:
        with pytest.raises(mg.WatchdogTimeout):
            prog(x)
    else:
        assert prog(x).isnan().all()  # reading it waits for the kernel: NaN, not stale
        with pytest.raises(mg.WatchdogTimeout):
            prog.synchronize()
    with pytest.raises(mg.WatchdogTimeout):
        prog(x)


# -- the host time of a call (a measurement, not a test) ------------------------------------------
def time_calls(reps: int = 100, rounds: int = 15) -> None:
    """prog(x) of bench_layer.py's Llama layer at its smoke size in microseconds per call, the
    kernel launch stubbed out after a first (also stubbed) call; min and median of rounds."""
    import time

    sys.path.insert(0, str(HERE.parent / "benchmarks"))
    from bench_layer import SMOKE
    from llama_layer import DecoderLayer

    from mgraph.runtime.megakernel.runtime import TritonRuntime

    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = DecoderLayer(SMOKE["hidden"], SMOKE["heads"], SMOKE["kv_heads"], SMOKE["ffn"])
    x = torch.randn(SMOKE["batch"], SMOKE["seq"], SMOKE["hidden"])
    prog = mg.compile(layer.eval(), (x,), backend="triton", backend_options={"interpret": True})
    TritonRuntime._zero_and_launch = lambda self: None  # the host's work only
    times = []
    with torch.no_grad():
        for _ in range(20):
            prog(x)
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(reps):
                prog(x)
            times.append((time.perf_counter() - start) / reps * 1e6)
    times.sort()
    print(
        json.dumps(
            {
                "us_per_call_min": round(times[0], 1),
                "us_per_call_median": round(times[len(times) // 2], 1),
                "graph_inputs": len(prog.graph.inputs),
            }
        )
    )


if __name__ == "__main__":
    if "--time" in sys.argv:
        time_calls()
    else:
        main()
