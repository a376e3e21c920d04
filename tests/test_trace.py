"""mg.compile: tracing modules with plans, pattern fusion, resharding, the Program, custom ops,
and the named errors for what cannot be traced."""

from __future__ import annotations

import importlib.util
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mgraph as mg
from helpers import rel_err
from mgraph.graph import TaskGraph
from mgraph.runtime import run_sequential

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _load(name: str):
    """An example module, loaded once per process (test_examples.py shares the cache)."""
    key = f"mgraph_example_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, EXAMPLES / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


tb = _load("transformer_block")


def ops_of(prog: mg.Program) -> Counter:
    return Counter(n.op for n in prog.opgraph.nodes)


def randomized(model: nn.Module, std: float = 0.2) -> nn.Module:
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    return model.eval()


# -- pattern fusion and layouts --------------------------------------------------------------
def test_tensor_parallel_block_fuses_allreduce():
    model = randomized(tb.Block(hidden=64, heads=4, ffn=128))
    x = torch.randn(1, 16, 64)
    prog = mg.compile(model, (x,), plan=tb.block_plan(sequence_parallel=False), topology="2x2")
    assert ops_of(prog) == Counter(
        matmul=5, gemm_allreduce=2, relayout=4, attention=1, rms_norm=2, elementwise=4
    )
    # Column-parallel outputs feed the head split, the MLP product and the row-parallel inputs
    # in place: the only communication is inside the two fused all-reduces.
    assert not [t for t in prog.graph.tasks if "reshard" in t.name]
    assert rel_err(prog(x), model(x).detach()) < 1e-5


def test_sequence_parallel_block_fuses_gather_and_reduce_scatter():
    model = randomized(tb.Block(hidden=64, heads=4, ffn=128))
    x = torch.randn(1, 16, 64)
    prog = mg.compile(model, (x,), plan=tb.block_plan(), topology="2x2")
    assert ops_of(prog) == Counter(
        allgather_gemm=5,
        gemm_reduce_scatter=2,
        relayout=4,
        attention=1,
        rms_norm=2,
        elementwise=4,
    )
    assert not [t for t in prog.graph.tasks if "reshard" in t.name]
    out = prog.opgraph.outputs[0]
    assert out.layout == mg.layout.ROWS  # the residual stream stays token-sharded
    assert rel_err(prog(x), model(x).detach()) < 1e-5


def test_program_graph_round_trips_and_matches_the_oracle():
    model = randomized(tb.Block(hidden=32, heads=4, ffn=64))
    x = torch.randn(1, 8, 32)
    prog = mg.compile(model, (x,), plan=tb.block_plan(), topology="1x4")
    g = prog.graph
    again = TaskGraph.from_json(g.to_json())
    assert again.tasks == g.tasks and again.buffers == g.buffers
    got = run_sequential(again, prog.inputs(x))["out"].reshape(x.shape)
    assert rel_err(got, model(x).detach()) < 1e-5
    result = prog.run(x)  # mg.run on the schedule, with a trace
    assert result.trace is not None and result.outputs["out"].shape == x.shape


class ColwiseThenRowOp(nn.Module):
    """A column-parallel linear whose output a whole-row op needs: gathered by resharding."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.out = nn.Linear(32, 16, bias=False)

    def forward(self, x):
        return self.out(torch.softmax(self.up(x), dim=-1) * 2.0 - x.mean(-1, keepdim=True))


@pytest.mark.parametrize("topology", ["2x2", "1x4"])
def test_layout_changes_become_resharding_tasks(topology):
    model = randomized(ColwiseThenRowOp(), std=0.5)
    x = torch.randn(2, 8, 16)
    prog = mg.compile(model, (x,), plan={"up": mg.ColwiseParallel()}, topology=topology)
    reshards = [t for t in prog.graph.tasks if t.name.startswith("reshard")]
    roles = Counter(t.role for t in reshards)
    if topology == "2x2":
        # other node, other GPU: to the rail peer over RDMA, then over NVLink (relay)
        assert roles["rdma"] and roles["nvlink"] and any("relay" in t.name for t in reshards)
    else:
        assert roles["nvlink"] and not roles["rdma"]
    assert rel_err(prog(x), model(x).detach()) < 1e-5


def test_views_that_keep_the_last_dim_move_no_data():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 16, bias=False)
            self.b = nn.Linear(16, 16, bias=False)

        def forward(self, x):
            h = self.a(x).reshape(-1, 16).unsqueeze(0)
            return F.relu(self.b(h)).reshape(x.shape)

    model = randomized(Flat())
    x = torch.randn(1, 16, 16)
    prog = mg.compile(model, (x,), plan={"": mg.SequenceParallel()}, topology="1x2")
    assert ops_of(prog) == Counter(matmul=2, elementwise=1)
    assert rel_err(prog(x), model(x).detach()) < 1e-5
    # With a batch of 2 the sequence shard is two row ranges per rank, not one token-row
    # shard of the flattened view: the reshape then gathers (a relayout from replicated).
    x = torch.randn(2, 8, 16)
    prog = mg.compile(model, (x,), plan={"": mg.SequenceParallel()}, topology="1x2")
    assert ops_of(prog)["relayout"] == 1
    assert rel_err(prog(x), model(x).detach()) < 1e-5


def test_module_with_biases_tuple_output_and_layer_norm():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = nn.LayerNorm(16)
            self.fc = nn.Linear(16, 32)
            self.proj = nn.Linear(32, 16)

        def forward(self, x, y):
            h = F.gelu(self.fc(self.ln(x)), approximate="tanh")
            return self.proj(h) + y, torch.sigmoid(h).sum(-1, keepdim=True)

    model = randomized(Two())
    x, y = torch.randn(4, 4, 16), torch.randn(4, 4, 16)
    plan = {"fc": mg.ColwiseParallel(), "proj": mg.RowwiseParallel()}
    prog = mg.compile(model, (x, y), plan=plan, topology="2x2")
    got = prog(x, y)
    want = model(x, y)
    assert isinstance(got, tuple) and len(got) == 2
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w.detach()) < 1e-5


# -- custom ops --------------------------------------------------------------------------------
@mg.register_op("test_trace_scaled_tanh", whole_rows=False)
def scaled_tanh(x: torch.Tensor, scale: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    return torch.tanh(x * alpha) * scale


def test_registered_op_in_a_traced_module():
    class UsesCustom(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.rand(32) + 0.5)
            self.up = nn.Linear(16, 32, bias=False)
            self.down = nn.Linear(32, 16, bias=False)

        def forward(self, x):
            return self.down(scaled_tanh(self.up(x), self.scale, 0.7))

    model = randomized(UsesCustom())
    x = torch.randn(8, 16)
    plan = {"up": mg.ColwiseParallel(), "down": mg.RowwiseParallel()}
    prog = mg.compile(model, (x,), plan=plan, topology="2x2")
    assert ops_of(prog)["test_trace_scaled_tanh"] == 1
    # whole_rows=False: it runs on the column shards, no gather in between
    assert not [t for t in prog.graph.tasks if "reshard" in t.name]
    assert rel_err(prog(x), model(x).detach()) < 1e-5
    assert "test_trace_scaled_tanh" in mg.kinds.KINDS


@mg.register_op("test_trace_with_squares", shape=lambda x: (*x[:-1], 2 * x[-1]))
def with_squares(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x * x], dim=-1)


def test_registered_op_with_a_shape_rule():
    class Widen(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, 8)

        def forward(self, x):
            return self.fc(with_squares(x)) * torch.tensor([0.5] * 8)

    model = randomized(Widen())
    x = torch.randn(4, 8, 8)
    prog = mg.compile(model, (x,), plan={"": mg.SequenceParallel()}, topology="2x2")
    assert prog.opgraph.nodes[0].outputs["out"].shape == (4, 8, 16)
    assert rel_err(prog(x), model(x).detach()) < 1e-5


def test_register_op_errors():
    with pytest.raises(mg.RegistrationError, match="already registered"):
        mg.register_op("test_trace_scaled_tanh")(scaled_tanh.reference)
    with pytest.raises(mg.RegistrationError, match="already registered"):
        mg.register_op("gemm")(scaled_tanh.reference)  # a builtin kind and op
    with pytest.raises(mg.RegistrationError, match="no torch reference"):
        mg.register_op("test_trace_no_reference")(None)

    def unannotated(x, w):
        return x * w

    with pytest.raises(mg.RegistrationError, match="annotate"):
        mg.register_op("test_trace_unannotated")(unannotated)


# -- named errors for what cannot be compiled --------------------------------------------------
class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return x


class Cumsum(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.cumsum(self.fc(x), dim=-1)


class Small(nn.Module):
    def __init__(self, out: int = 8):
        super().__init__()
        self.fc = nn.Linear(8, out)
        self.act = nn.SiLU()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return self.drop(self.act(self.fc(x)))


X = torch.randn(4, 8)


def test_data_dependent_control_flow():
    with pytest.raises(mg.TraceError, match="data-dependent control flow") as info:
        mg.compile(Branchy(), (X,), topology="1x2")
    assert "x.sum() > 0" in str(info.value) and "torch.cond" in str(info.value)


def test_aten_op_without_mgraph_op():
    with pytest.raises(mg.UnsupportedOpError, match="aten.cumsum") as info:
        mg.compile(Cumsum(), (X,), topology="1x2")
    assert "register_op" in str(info.value)


def test_plan_with_unknown_path():
    with pytest.raises(mg.PlanError, match="'fc1'") as info:
        mg.compile(Small(), (X,), plan={"fc1": mg.ColwiseParallel()}, topology="1x2")
    assert "did you mean 'fc'" in str(info.value)


def test_plan_with_indivisible_shard():
    with pytest.raises(mg.ShapeError, match="plan 'fc' ColwiseParallel: out_features=6"):
        mg.compile(Small(out=6).eval(), (X,), plan={"fc": mg.ColwiseParallel()}, topology="2x2")
    with pytest.raises(mg.ShapeError, match="plan 'act' SequenceParallel"):
        mg.compile(
            Small().eval(),
            (torch.randn(1, 6, 8),),
            plan={"act": mg.SequenceParallel()},
            topology="2x2",
        )


def test_plan_style_errors():
    with pytest.raises(mg.PlanError, match="not an nn.Linear"):
        mg.compile(Small(), (X,), plan={"act": mg.RowwiseParallel()}, topology="1x2")
    with pytest.raises(mg.PlanError, match="not a parallel style"):
        mg.compile(Small(), (X,), plan={"fc": "colwise"}, topology="1x2")
    with pytest.raises(mg.PlanError, match="no expert list"):
        mg.compile(Small(), (X,), plan={"": mg.ExpertParallel()}, topology="1x2")


def test_unsupported_arguments():
    with pytest.raises(mg.UnsupportedOpError, match="dropout in training mode"):
        mg.compile(Small().train(), (X,), topology="1x2")

    class Masked(nn.Module):
        def forward(self, q, mask):
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    with pytest.raises(mg.UnsupportedOpError, match="does not broadcast"):
        mg.compile(Masked(), (torch.randn(1, 2, 8, 4), torch.randn(8, 1)), topology="1x2")


def test_bad_inputs_and_backend():
    prog = mg.compile(Small().eval(), (X,), topology="1x2")
    with pytest.raises(mg.InputError, match="compiled for"):
        prog(torch.randn(5, 8))
    with pytest.raises(mg.InputError, match="1 input"):
        prog(X, X)
    with pytest.raises(mg.DTypeError):
        prog(X.double())
    with pytest.raises(mg.DTypeError, match="one dtype"):
        mg.compile(Small().eval(), (X.to(torch.bfloat16),), topology="1x2")
    with pytest.raises(mg.UnknownNameError, match="unknown backend 'tpu'.*reference"):
        mg.compile(Small().eval(), (X,), topology="1x2", backend="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_triton_backend_without_cuda_is_a_named_error():
    """The real triton backend (registered, not deleted): without CUDA it refuses by name
    before allocating anything, and says which backends do run here."""
    prog = mg.compile(Small().eval(), (X,), topology="1x1", backend="triton")
    with pytest.raises(mg.errors.BackendUnavailableError, match="needs a CUDA GPU") as info:
        prog(X)
    assert "backend='reference'" in str(info.value)


def test_fx_fallback_says_why():
    class PointerCache(nn.Module):
        """Remembers its input's address: fake tensors have none, so torch.export fails."""

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.last = None

        def forward(self, x):
            self.last = x.data_ptr()
            return F.relu(self.fc(x)) * 2.0

    model = PointerCache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prog = mg.compile(model, (X,), plan={"fc": mg.ColwiseParallel()}, topology="1x2")
    assert any("traced with torch.fx" in str(w.message) for w in caught)
    assert "data pointer" in prog.opgraph.note
    assert rel_err(prog(X), model(X).detach()) < 1e-5


# -- compile time ------------------------------------------------------------------------------
class Stack(nn.Module):
    def __init__(self, layers: int, **kw):
        super().__init__()
        self.layers = nn.ModuleList(tb.Block(**kw) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_compile_4_layer_stack_2x8():
    """A large program compiles with the right fused ops. Its time is printed, not asserted:
    speed belongs in benchmarks (a timed CPU test fails under load)."""
    mg.compile(Small().eval(), (X,), topology="1x2")  # torch.export's one-time imports
    model = Stack(4, hidden=512, heads=16, ffn=1024).eval()
    plan = {}
    for i in range(4):
        plan.update(tb.block_plan(f"layers.{i}."))
    x = torch.randn(1, 256, 512)
    start = time.perf_counter()
    prog = mg.compile(
        model, (x,), plan=plan, topology="2x8", validate=False
    )  # trace+lower+schedule
    compiled = time.perf_counter()
    prog.graph.validate()
    validated = time.perf_counter()
    print(
        f"\n4-layer stack on 2x8: {len(prog.graph.tasks)} tasks, compiled (trace + lower + "
        f"schedule) in {compiled - start:.3f} s; validation {validated - compiled:.3f} s more"
    )
    ops = ops_of(prog)
    assert ops["allgather_gemm"] == 4 * 5 and ops["gemm_reduce_scatter"] == 4 * 2
