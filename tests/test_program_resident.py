"""A Program on backend="triton" keeps its weights in the kernel's buffers between calls.

Under TRITON_INTERPRET=1 (a subprocess: tests/program_resident_interp.py) one Program is called
while its input and its module's weights change between calls, each call against eager torch:
what each call copies, which launch poisons, and that every change torch can see is seen. On
any CPU (no launch): TritonRuntime.load_inputs' ``resident`` inputs on one rank and on a rank of
an SPMD graph, and the named errors for inputs that cannot be resident.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch

import mgraph as mg
from helpers import interpreter_rows
from mgraph.builder import GraphBuilder, piece
from mgraph.kinds import Role
from mgraph.runtime.megakernel import TritonRuntime, local_shards
from mgraph.runtime.megakernel.runtime import _SharedMemory

WEIGHTS = {"norm.weight", "mlp.gate_proj.weight.T", "mlp.up_proj.weight.T",
           "mlp.down_proj.weight.T"}


@cache
def rows() -> dict[str, dict]:
    return interpreter_rows("program_resident_interp.py")


# case -> (the weights that call must copy besides x, whether its result matches eager)
CASES = {
    "first": (WEIGHTS, True),
    "new-input": (set(), True),  # the input is copied at every call, weights are not
    "in-place-linear": ({"mlp.up_proj.weight.T"}, True),
    "in-place-norm": ({"norm.weight"}, True),
    "new-parameter": ({"mlp.down_proj.weight.T"}, True),
    "data-assigned": ({"mlp.gate_proj.weight.T"}, True),
    # the documented limitation (mgraph/program.py): a write through .data is not counted...
    "data-write-unseen": (set(), False),
    "reloaded": (WEIGHTS, True),  # ...until prog.reload_parameters()
    "poisoned-again": (set(), True),
    "inference-tensor": ({"mlp.up_proj.weight.T"}, True),
    "inference-tensor-written": ({"mlp.up_proj.weight.T"}, True),  # no version: every call
    "stale-buffer": ({"mlp.up_proj.weight.T"}, False),  # proof that down_proj was not copied
    "stale-buffer-refreshed": ({"mlp.up_proj.weight.T", "mlp.down_proj.weight.T"}, True),
}


def test_program_copies_only_changed_weights_and_sees_every_counted_change():
    got = dict(rows())
    # the first call's result, held by the caller, after every other call
    assert got.pop("outputs-are-copies")["error"] == 0.0
    assert list(got) == list(CASES), list(got)
    for case, (weights, matches) in CASES.items():
        r = got[case]
        assert r["copies"] == {"x": 1, **dict.fromkeys(weights, 1)}, r
        if matches:
            assert r["error"] < 1e-5, r
        else:
            assert r["error"] > 1e-2, r
        # the first launch of the Program's kernel poisons, later ones only when asked
        assert r["poisoned"] == (case in ("first", "poisoned-again")), r


# -- TritonRuntime.load_inputs(resident=...), no launch --------------------------------------------
def two_inputs(topology: str = "1x1", clobber: bool = False):
    """x copied to ``out`` on every rank, which also holds 8 rows of w (tasks; never launched
    here); ``clobber``: a task also writes w's buffer, so w can never stay resident."""
    world = mg.Topology.parse(topology).world_size
    b = GraphBuilder("two", mg.Topology.parse(topology), "float32", {})
    b.global_input("x", (32, 16))
    b.global_input("w", (32, 16))
    b.global_output("out", (32, 16 * world))
    for r in range(world):
        x = b.bound_buffer("x", r, "x", [piece((32, 16))])
        w = b.bound_buffer("w", r, "w", [piece((32, 16), d0=(8 * r, 8 * r + 8))])
        out = b.bound_buffer(
            "out", r, "out", [piece((32, 16 * world), d1=(16 * r, 16 * r + 16))], role="output"
        )
        b.task(r, Role.COMPUTE, "copy", [x.region()], [out.region()], name=f"x{r}")
        if clobber:
            b.task(r, Role.COMPUTE, "copy", [x.region((0, 8))], [w.region()], name=f"w{r}")
    return b.finish()


def test_resident_inputs_are_not_copied_and_must_have_been_loaded():
    g = two_inputs()
    rt = TritonRuntime(mg.schedule(g), interpret=True)
    x, w = torch.randn(32, 16), torch.randn(32, 16)
    with pytest.raises(mg.InputError, match="never loaded"):
        rt.load_inputs({"x": x}, resident=["w"])
    rt.load_inputs({"x": x, "w": w})
    assert rt.loaded_inputs() == {"x", "w"}
    x2 = torch.randn(32, 16)
    rt.load_inputs({"x": x2}, resident=["w"])
    assert torch.equal(rt.views["x@0"], x2) and torch.equal(rt.views["w@0"], w[:8])
    with pytest.raises(mg.InputError, match="missing"):
        rt.load_inputs({"x": x2})  # left out without being resident
    with pytest.raises(mg.DTypeError):  # a passed input is still checked
        rt.load_inputs({"x": x2.double()}, resident=["w"])


def test_an_input_a_task_writes_is_never_resident():
    g = two_inputs(clobber=True)
    rt = TritonRuntime(mg.schedule(g), interpret=True)
    x, w = torch.randn(32, 16), torch.randn(32, 16)
    rt.load_inputs({"x": x, "w": w})
    assert rt.loaded_inputs() == {"x"}
    with pytest.raises(mg.InputError, match="graph writes those buffers"):
        rt.load_inputs({"x": x}, resident=["w"])


def test_resident_inputs_on_a_rank_of_an_spmd_graph():
    """A rank that takes its local shards (SPMD) keeps a resident shard too; local_shards
    leaves a name out when the global inputs do."""
    g = two_inputs("1x2")
    shared = _SharedMemory(g, torch.device("cpu"))
    rt = TritonRuntime(mg.schedule(g), rank=1, interpret=True, shared=shared)
    x, w = torch.randn(32, 16), torch.randn(32, 16)
    with pytest.raises(mg.InputError, match="never loaded"):
        rt.load_inputs(local_shards(g, 1, {"x": x}), resident=["w"])
    rt.load_inputs(local_shards(g, 1, {"x": x, "w": w}))
    assert torch.equal(rt.views["w@1"], w[8:16])
    x2 = torch.randn(32, 16)
    mine = local_shards(g, 1, {"x": x2})
    assert sorted(mine) == ["x"]
    rt.load_inputs(mine, resident=["w"])
    assert torch.equal(rt.views["x@1"], x2) and torch.equal(rt.views["w@1"], w[8:16])
    with pytest.raises(mg.InputError, match="got no local input 'w'"):
        rt.load_inputs(mine)


def test_an_spmd_rank_holding_an_input_in_two_buffers_gets_each_its_part():
    """A rank may bind one input twice with different parts (a folded RoPE table read whole by
    one op and by rows by another): local_shards gives its parts per buffer when asked
    (``per_buffer``, what a Program passes), load_inputs fills each buffer with its own, and
    without it the caller gets the named error."""
    from mgraph.runtime.megakernel.calls import BufferShards

    b = GraphBuilder("twice", mg.Topology.parse("1x2"), "float32", {})
    b.global_input("x", (32, 16))
    b.global_output("out", (48, 32))
    for r in range(2):
        part = b.bound_buffer("x_rows", r, "x", [piece((32, 16), d0=(16 * r, 16 * r + 16))])
        whole = b.bound_buffer("x_all", r, "x", [piece((32, 16))])
        out = b.bound_buffer("out", r, "out", [piece((48, 32), d1=(16 * r, 16 * r + 16))],
                             role="output")  # fmt: skip
        b.task(r, Role.COMPUTE, "copy", [part.region()], [out.region((0, 16))], name=f"p{r}")
        b.task(r, Role.COMPUTE, "copy", [whole.region()], [out.region((16, 48))], name=f"w{r}")
    g = b.finish()
    g.validate()
    x = torch.randn(32, 16)
    with pytest.raises(mg.InputError, match="two buffers"):
        local_shards(g, 1, {"x": x})
    mine = local_shards(g, 1, {"x": x}, per_buffer=True)
    assert isinstance(mine["x"], BufferShards) and sorted(mine["x"]) == ["x_all@1", "x_rows@1"]
    shared = _SharedMemory(g, torch.device("cpu"))
    rt = TritonRuntime(mg.schedule(g), rank=1, interpret=True, shared=shared)
    rt.load_inputs(mine)
    assert torch.equal(rt.views["x_rows@1"], x[16:32])
    assert torch.equal(rt.views["x_all@1"], x)
    with pytest.raises(mg.InputError, match="no part of input 'x' for its buffer x_all@1"):
        rt.load_inputs({"x": BufferShards({"x_rows@1": x[16:32]})})


def test_a_traced_llama_block_binds_a_rope_table_twice_and_spmd_loads_get_every_part():
    """Where it happens (found on one H200, two ranks sharing it): a Llama block with one KV head
    over 2 ranks binds the folded cos table twice on a rank, whole and by rows. The parts a
    Program hands each rank's load (per buffer) are exactly what the single-process load cuts
    for each buffer from the global tensor."""
    import sys
    from pathlib import Path

    from mgraph.runtime.megakernel.calls import BufferShards, buffer_shard

    sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
    import llama_block as lb

    torch.manual_seed(0)
    model = lb.DecoderBlock(hidden=256, heads=2, kv_heads=1, ffn=512).eval()
    x = torch.randn(1, 64, 256)
    prog = mg.compile(model, (x,), plan=lb.block_plan(), topology="1x2")
    inputs = prog.inputs(x)
    twice = False
    for rank in range(2):
        mine = local_shards(prog.graph, rank, inputs, per_buffer=True)
        for name, given in mine.items():
            bufs = [b for b in prog.graph.buffers.values() if b.rank == rank
                    and b.role == "input" and b.binding.tensor == name]  # fmt: skip
            for buf in bufs:
                part = given[buf.id] if isinstance(given, BufferShards) else given
                assert torch.equal(part, buffer_shard(buf, inputs)), (rank, buf.id)
            twice |= isinstance(given, BufferShards)
    assert twice  # else this test no longer covers the case
    with pytest.raises(mg.InputError, match="two buffers"):
        local_shards(prog.graph, 0, inputs)


@pytest.mark.multi_gpu(2)
def test_gpu_program_weights_under_torchrun(tmp_path):
    """The same on 2 H200 (tests/gpu_program_weights.py): 1 GPU and SPMD on 2."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, OUT=str(tmp_path), PYTHONUNBUFFERED="1")
    script = Path(__file__).parent / "gpu_program_weights.py"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", str(script)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL" not in proc.stdout, proc.stdout[-3000:]
