"""Fused pointwise chains and Programs on backend="triton".

On any CPU: random chains through the elementwise op's bytecode (CPU runtime against the op's
reference) and through mg.compile (against eager torch); the traced SwiGLU MLP's structure (ONE
ewise task per tile); the named error for a kind without a Triton body; the SPMD convention's
input and output conversions on 2 gloo ranks. Under TRITON_INTERPRET=1 (a subprocess:
tests/program_triton_interp.py) the same Programs run in the megakernel on 1 and 2 ranks.
On 2 GPUs: tests/gpu_programs.py under torchrun (test_gpu_programs_under_torchrun).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter
from functools import cache
from pathlib import Path

import pytest
import rank_reports
import torch
import torch.nn as nn
import torch.nn.functional as F

import mgraph as mg
from helpers import check_graph, interpreter_rows, rel_err

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "examples"))

# -- random pointwise chains -------------------------------------------------------------------
SAFE_UNARY = ["neg", "silu", "gelu", "relu", "sigmoid", "tanh", "abs", "gelu_tanh"]
POSITIVE_UNARY = ["sqrt", "rsqrt", "log", "exp"]  # fed |v| + 0.5 (exp: tanh(v) first)
BINARY = ["add", "sub", "mul", "div", "maximum", "minimum"]


def random_steps(seed: int, length: int = 5) -> list[tuple]:
    """A random chain in the vocabulary of RandomChain (every step keeps the shape)."""
    rng = random.Random(seed)
    steps: list[tuple] = []
    while len(steps) < length:
        kind = rng.choice(["unary", "positive", "tensor", "row", "scalar"])
        if kind == "unary":
            steps.append(("unary", rng.choice(SAFE_UNARY)))
        elif kind == "positive":
            steps.append(("positive", rng.choice(POSITIVE_UNARY)))
        elif kind in ("tensor", "row"):
            steps.append((kind, rng.choice(BINARY), rng.random() < 0.5))
        else:
            fn = rng.choice(["add", "sub", "mul", "pow"])
            s = round(rng.uniform(0.5, 2.0), 3) if fn != "pow" else 2.0
            steps.append(("scalar", fn, s, fn in ("add", "sub", "mul") and rng.random() < 0.5))
    return steps


class RandomChain(nn.Module):
    """``a`` through a chain of pointwise ops with ``b`` (full), ``w`` (a positive row vector)
    and scalars: what fuse_pointwise must turn into ONE elementwise node."""

    def __init__(self, steps: list[tuple], hidden: int) -> None:
        super().__init__()
        self.steps = steps
        self.w = nn.Parameter(torch.rand(hidden) + 0.5)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        v = a
        for step in self.steps:
            if step[0] == "unary":
                v = {"gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}.get(
                    step[1], getattr(torch, step[1], None) or getattr(F, step[1])
                )(v)
            elif step[0] == "positive":
                v = torch.tanh(v) if step[1] == "exp" else v.abs() + 0.5
                v = getattr(torch, step[1])(v)
            elif step[0] in ("tensor", "row"):
                other = b if step[0] == "tensor" else self.w
                if step[1] == "div":  # a divisor far from 0
                    other = other.abs() + 0.5 if step[0] == "tensor" else other
                x, y = (other, v) if step[2] and step[1] != "div" else (v, other)
                v = getattr(torch, step[1])(x, y)
            else:
                _, fn, s, swap = step
                if fn == "pow":
                    v = v.pow(s)
                elif fn == "add":
                    v = s + v if swap else v + s
                elif fn == "sub":
                    v = s - v if swap else v - s
                else:
                    v = s * v if swap else v * s
        return v


def chain_case(seed: int, shape=(2, 8, 48)) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(seed)
    model = RandomChain(random_steps(seed), shape[-1]).eval()
    return model, (torch.randn(*shape), torch.randn(*shape))


def ewise_tasks_per_tile(prog: mg.Program) -> float:
    tasks = [t for t in prog.graph.tasks if t.kind == "ewise"]
    tiles = {(t.rank, t.writes[0].row0, t.writes[0].row1) for t in tasks}
    return len(tasks) / len(tiles)


@pytest.mark.parametrize("seed", range(6))
def test_random_chains_fuse_into_one_task_per_tile_and_match_eager(seed):
    model, args = chain_case(seed)
    prog = mg.compile(model, args, topology="1x2")
    nodes = Counter(n.op for n in prog.lowered.nodes)
    # one node, or two where a divisor's own chain (|b| + 0.5) would push the fused chain past
    # MAX_OPS instructions; every node is one task per tile
    divs = sum(1 for s in model.steps if s[0] == "tensor" and s[1] == "div")
    assert nodes["elementwise"] <= 1 + divs, (model.steps, prog.lowered.to_text())
    assert ewise_tasks_per_tile(prog) == nodes["elementwise"]
    with torch.no_grad():
        want = model(*args)
    assert rel_err(prog(*args), want) < 1e-5, model.steps
    unfused = mg.compile(model, args, topology="1x2", fuse=False)
    assert len(unfused.graph.tasks) > len(prog.graph.tasks)
    assert rel_err(unfused(*args), want) < 1e-5


@pytest.mark.parametrize("topology", ["1x1", "2x2"])
def test_random_chains_through_the_op_builder(topology):
    """The bytecode (CPU body) against the op's reference, every operand form and scalars on
    either side, on column-sharded and replicated layouts."""
    chain = [
        ["silu", 0, -1, 0.0],  # 4: silu(x)
        ["mul", 4, 1, 0.0],  # 5: * y
        ["add", 5, 2, 0.0],  # 6: + row
        ["sub", -1, 6, 1.5],  # 7: 1.5 - .
        ["maximum", 7, 3, 0.0],  # 8: max(., col)
        ["mul", 8, 0, 0.0],  # 9: * x again (x stays live)
        ["pow", 9, -1, 2.0],
    ]
    for layout in (None, ["shard", 1, False]):
        g = mg.ops.elementwise(
            topology=topology, rows=32, cols=64, chain=chain, operands=["full", "row", "col"],
            layout=layout, tile_rows=8,
        )
        assert {t.kind for t in g.tasks} == {"ewise"}
        check_graph(g, tol=1e-5)


def test_chains_that_do_not_fit_are_refused_or_split():
    long = [["neg", 0, -1, 0.0]] + [["add", 1 + j, -1, 1.0] for j in range(8)]  # 17 instructions
    with pytest.raises(mg.OptionError, match="more than 16"):
        mg.ops.elementwise(topology="1x1", rows=8, cols=8, chain=long)
    with pytest.raises(mg.OptionError, match="reads value 5"):
        mg.ops.elementwise(topology="1x1", rows=8, cols=8, chain=[["add", 0, 5, 0.0]])

    class Long(nn.Module):
        def forward(self, x):
            for _ in range(12):
                x = x * 1.01 + 0.5
            return x

    # 24 steps of (CONST, op): a fused node holds a LOAD and 7 steps (15 instructions)
    x = torch.randn(4, 32)
    prog = mg.compile(Long(), (x,))
    assert Counter(n.op for n in prog.lowered.nodes)["elementwise"] == 4
    assert rel_err(prog(x), Long()(x)) < 1e-5


def test_traced_swiglu_mlp_runs_one_ewise_task_per_tile():
    from tp_mlp import PLAN, LlamaMLP

    torch.manual_seed(0)
    model = LlamaMLP(hidden=64, ffn=128).eval()
    x = torch.randn(2, 32, 64)
    fused = mg.compile(model, (x,), plan=PLAN, topology="1x2")
    unfused = mg.compile(model, (x,), plan=PLAN, topology="1x2", fuse=False)
    # silu and the product: one elementwise node, 64 rows per rank in 64-row tiles
    (node,) = [n for n in fused.lowered.nodes if n.op == "elementwise"]
    assert [s[0] for s in node.params["chain"]] == ["silu", "mul"]
    assert Counter(t.kind for t in fused.graph.tasks)["ewise"] == 2  # 1 tile x 2 ranks
    assert Counter(t.kind for t in unfused.graph.tasks)["ewise"] == 4
    assert ewise_tasks_per_tile(fused) == 1 and ewise_tasks_per_tile(unfused) == 2
    with torch.no_grad():
        want = model(x)
    assert rel_err(fused(x), want) < 1e-5
    assert [n.op for n in fused.opgraph.nodes].count("elementwise") == 2  # as traced


def test_kind_without_a_triton_body_is_named_at_compile():
    @mg.register_op("no_body_test", whole_rows=False)
    def no_body(x: torch.Tensor, scale: float = 2.0) -> torch.Tensor:
        return x * scale

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(64, 64, bias=False)

        def forward(self, x):
            return self.lin(no_body(x))

    x = torch.randn(2, 8, 64)
    with pytest.raises(mg.RegistrationError) as info:
        mg.compile(M().eval(), (x,), backend="triton")
    text = str(info.value)
    assert "'no_body_test'" in text and "no Triton tile body" in text and "node" in text
    assert "triton=body" in text  # how to register one
    mg.compile(M().eval(), (x,), backend="reference")  # the reference backend runs it


@cache
def interp_rows() -> dict[str, dict]:
    return interpreter_rows("program_triton_interp.py")


@pytest.mark.parametrize("prefix", ["mlp-1x1", "mlp-1x2", "chain-1x1", "chain-1x2", "custom-1x1"])
def test_programs_on_backend_triton_in_the_interpreter(prefix):
    """mg.compile(..., backend="triton", backend_options={"interpret": True}): the Program runs
    in the megakernel (1 rank: its own runtime; 2 ranks: every rank in one interpreter
    program) and matches eager torch."""
    rows = [r for k, r in interp_rows().items() if k.startswith(prefix)]
    assert rows, sorted(interp_rows())
    for r in rows:
        assert r["error"] < 1e-5, r
        assert r["ewise_per_tile"] in (None, 1), r


# -- the SPMD convention, on 2 gloo processes (the conversions only: no kernel) ----------------
def _spmd_worker(rank: int, world: int, port: int, queue) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, spmd_conversions(rank, world)))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        queue.put((rank, repr(exc)))
    finally:
        dist.destroy_process_group()


def spmd_conversions(rank: int, world: int) -> dict[str, float]:
    """What every rank's buffers would receive and return, for inputs passed whole and as
    chunks (with and without a gather), against the same cuts of the global tensors."""
    import transformer_block as tb
    from tp_mlp import PLAN, LlamaMLP

    from mgraph.runtime.megakernel import local_shards

    errors = {}
    torch.manual_seed(0)
    cases = {
        "mlp": (LlamaMLP(64, 128).eval(), PLAN, 1),  # x replicated: a chunk must be gathered
        "sp-block": (tb.Block(hidden=64, heads=4, ffn=128).eval(), tb.block_plan(), 1),
    }
    for name, (model, plan, dim) in cases.items():
        # batch 1 for the block: its token rows are then exactly the sequence chunks
        x = torch.randn(2 if name == "mlp" else 1, 16, 64)
        prog = mg.compile(model, (x,), plan=plan, topology=f"1x{world}")
        value = prog.opgraph.inputs[0]
        inputs = prog.inputs(x)
        want = local_shards(prog.graph, rank, inputs)["x"]
        for how, arg in (("whole", x), ("chunk", x.chunk(world, dim)[rank])):
            passed = dict(inputs, x=prog._spmd_input(value, arg, rank, world))
            got = local_shards(prog.graph, rank, passed)["x"]
            errors[f"{name}-input-{how}"] = (got - want).abs().max().item()
        # outputs: this rank's output buffer as the kernel leaves it, then the eager form
        with torch.no_grad():
            out = model(x)
        flat = out.reshape(-1, out.shape[-1])
        held = torch.cat([flat[r0:r1, c0:c1] for r0, r1, c0, c1 in prog._output_runs("out", rank)])
        got = prog._spmd_output("out", prog.opgraph.outputs[0], held, rank, world)
        lay = prog.opgraph.outputs[0].layout
        eager = out if lay.kind == "replicate" else out.chunk(world, 1)[rank]
        errors[f"{name}-output-{lay.kind}"] = (
            (got - eager).abs().max().item() if got.shape == eager.shape else float("inf")
        )
        errors[f"{name}-gathered-{name}"] = float(prog._chunk_ok.get(("x", rank, dim), True))
    return errors


def test_spmd_convention_conversions_on_two_gloo_ranks():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_spmd_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    reports = rank_reports.collect(queue, procs, timeout=120)
    failed = rank_reports.failures(
        reports, failed=lambda r: not isinstance(r[1], dict), text=lambda r: str(r[-1])
    )
    assert not failed, failed
    results = dict(r[:2] for r in reports)
    for rank, errors in results.items():
        gathered = {k: v for k, v in errors.items() if "-gathered-" in k}
        # the MLP reads x whole on each rank (a chunk is gathered), the SP block reads only
        # the rank's tokens (the chunk suffices)
        assert gathered == {"mlp-gathered-mlp": 0.0, "sp-block-gathered-sp-block": 1.0}, errors
        assert errors["mlp-output-replicate"] == 0.0 and errors["sp-block-output-rows"] == 0.0
        assert all(v == 0.0 for k, v in errors.items() if "-input-" in k), (rank, errors)


@pytest.mark.multi_gpu(2)
def test_gpu_programs_under_torchrun(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         str(HERE / "gpu_programs.py")],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL" not in proc.stdout, proc.stdout[-3000:]
