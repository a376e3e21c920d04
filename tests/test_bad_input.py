"""Bad input at every entry point -> a named error from mgraph.errors (what, where, how to fix),
raised before anything is allocated or launched. docs/errors.md is the same table in prose.

Each table row is (id, call, error class, a regex the message must match). "Before allocation"
is checked by making the runtime's allocator fail the test if it is reached.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import mgraph as mg
from mgraph import errors as E
from mgraph.cli import main
from mgraph.settings import ENV_VARS, Settings

GA = mg.ops.gemm_allreduce


def small(**kw):
    args = dict(M=64, N=64, K=64, topology="2x2", dtype=torch.float32, tile=[32, 32])
    args.update(kw)
    return GA(**args)


class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return self.fc(x)


# -- Python API ----------------------------------------------------------------------------------
API = [
    ("unknown op", lambda: mg.ops.get_op("gemm_allreduse"), E.UnknownNameError, "registered ops"),
    ("bad topology text", lambda: small(topology="2by2"), E.TopologyError, "NODESxGPUS"),
    ("zero topology", lambda: small(topology="0x2"), E.TopologyError, "nodes=0"),
    ("bad dtype", lambda: small(dtype="int4"), E.DTypeError, "int4"),
    ("zero size", lambda: small(M=0), E.ShapeError, "M=0"),
    ("bool size", lambda: small(M=True), E.ShapeError, "positive integer"),
    ("float size", lambda: small(M=64.0), E.ShapeError, "positive integer"),
    ("K not divisible", lambda: small(K=66), E.ShapeError, "divisible"),
    ("missing size", lambda: GA(M=64, N=64, topology="1x2"), E.ShapeError, "missing size"),
    ("unknown option", lambda: small(tiles=[32, 32]), E.UnknownNameError, "tiles"),
    ("tile int", lambda: small(tile=64), E.OptionError, "tile=64.*list\\[int\\]"),
    ("tile one entry", lambda: small(tile=[64]), E.OptionError, "two positive ints"),
    ("tile zero", lambda: small(tile=[0, 64]), E.OptionError, "two positive ints"),
    ("tile negative", lambda: small(tile=[-64, 64]), E.OptionError, "two positive ints"),
    ("tile three", lambda: small(tile=[32, 32, 32]), E.OptionError, "two positive ints"),
    ("tile floats", lambda: small(tile=[32.0, 32]), E.OptionError, "tile"),
    ("bool option 'no'", lambda: small(hierarchical="no"), E.OptionError, "hierarchical='no'"),
    ("bool option 'False'", lambda: small(hierarchical="False"), E.OptionError, "bool"),
    ("bool option 0", lambda: small(hierarchical=0), E.OptionError, "bool"),
    ("int option bool", lambda: small(chunk_bytes=True), E.OptionError, "chunk_bytes"),
    ("int option negative", lambda: small(chunk_bytes=-1), E.OptionError, "positive"),
    ("float option nan", lambda: mg.ops.rms_norm(rows=8, cols=8, topology="1x2",
                                                 eps=float("nan")), E.OptionError, "finite"),
    ("causal 'True'", lambda: mg.ops.ring_attention(B=1, H=2, S=64, D=16, topology="1x2",
                                                    causal="True"), E.OptionError, "causal"),
    ("too many bytes", lambda: small(M=1 << 20, N=1 << 20, K=1 << 20), E.SizeLimitError,
     "MGRAPH_MAX_BYTES"),
    ("too many tasks", lambda: small(settings=Settings(max_tasks=10)), E.SizeLimitError,
     "MGRAPH_MAX_TASKS"),
    # the same guard on tasks emitted in bulk (GraphBuilder.tasks_alike)
    ("too many relayout tiles", lambda: mg.ops.relayout(
        rows=32, cols=8, in_shape=[1, 2, 16, 8], steps=[["permute", [0, 2, 1, 3]]], tile_rows=8,
        topology="1x2", settings=Settings(max_tasks=3)), E.SizeLimitError, "MGRAPH_MAX_TASKS"),
    # refused from the op's lower bound, before any rank's buffers are made (a 10^6-rank
    # topology is instant, not a minute of building)
    ("huge topology", lambda: mg.ops.gemm_allreduce(M=128, N=128, K=1_000_000, tile=[64, 64],
                                                    topology="1000x1000"),
     E.SizeLimitError, "at least 4,000,000 tasks"),
    ("bytes limit of buffers", lambda: small(settings=Settings(max_bytes=40_000)),
     E.SizeLimitError, "MGRAPH_MAX_BYTES"),
    ("unknown policy", lambda: mg.schedule(small(), policy="fastest"), E.UnknownNameError,
     "critical_path"),
    ("unknown backend", lambda: mg.run(small(), backend="tpu"), E.UnknownNameError, "reference"),
    ("missing input", lambda: mg.run(small(), {"a": torch.randn(64, 64)}), E.InputError,
     "missing \\['b'\\]"),
    ("wrong shape input", lambda: mg.run(small(), {"a": torch.randn(64, 32),
                                                   "b": torch.randn(64, 64)}), E.InputError,
     "shape"),
    ("wrong dtype input", lambda: mg.run(small(), {"a": torch.randn(64, 64).double(),
                                                   "b": torch.randn(64, 64)}), E.DTypeError,
     "float64"),
    ("not a tensor", lambda: mg.run(small(), {"a": [[1.0]], "b": torch.randn(64, 64)}),
     E.InputError, "not a tensor"),
    ("triton without CUDA", lambda: mg.run(mg.ops.gemm(M=64, N=64, K=64, topology="1x1"),
                                           backend="triton"), E.BackendUnavailableError, "CUDA"),
    ("ContextParallel on a Linear", lambda: mg.compile(
        Lin().eval(), (torch.randn(4, 8),), plan={"fc": mg.ContextParallel()}, topology="1x2"),
     E.PlanError, "nn.Linear"),
    ("plan path missing", lambda: mg.compile(
        Lin().eval(), (torch.randn(4, 8),), plan={"fc2": mg.ColwiseParallel()}, topology="1x2"),
     E.PlanError, "did you mean 'fc'"),
    ("settings watchdog 0", lambda: Settings(watchdog_s=0), E.SettingsError, "watchdog_s"),
]


@pytest.fixture
def no_allocation(monkeypatch):
    """Fail the test if a runtime allocates buffers: errors must come before that."""
    import mgraph.runtime.reference as reference

    def refuse(*a, **k):
        raise AssertionError("buffers were allocated before the bad input was reported")

    monkeypatch.setattr(reference, "allocate", refuse)


@pytest.mark.parametrize("call,error,match", [r[1:] for r in API], ids=[r[0] for r in API])
def test_python_api(call, error, match, no_allocation):
    if error is E.BackendUnavailableError and torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the triton backend is available")
    with pytest.raises(error, match=match) as info:
        call()
    assert isinstance(info.value, E.MgraphError)
    assert info.value.hint or "hint" in str(info.value) or error in (E.UnknownNameError,)


# -- environment settings --------------------------------------------------------------------
ENV = [
    ("MGRAPH_WATCHDOG_S", "0"), ("MGRAPH_WATCHDOG_S", "-1"), ("MGRAPH_WATCHDOG_S", "abc"),
    ("MGRAPH_WATCHDOG_S", "inf"), ("MGRAPH_WATCHDOG_S", "nan"), ("MGRAPH_PROXY", "bogus"),
    ("MGRAPH_TRANSPORT", "udp"), ("MGRAPH_THREADS_PER_ROLE", "0"),
    ("MGRAPH_THREADS_PER_ROLE", "2.5"), ("MGRAPH_PROXY_BATCH", "x"), ("MGRAPH_FIFO_SLOTS", "1"),
    ("MGRAPH_NIC_GBPS", "-5"), ("MGRAPH_GPU_FLAGS", "dma"), ("MGRAPH_MAX_TASKS", "1e6"),
    ("MGRAPH_MAX_BYTES", "0"), ("MGRAPH_PROXY_STREAMS", "0"), ("MGRAPH_PROXY_STREAMS", "9"),
    ("MGRAPH_EWISE_CHAINS", "-1"), ("MGRAPH_EWISE_CHAINS", "33"),
    ("MGRAPH_PROXY_COPY_KERNEL_BYTES", "-1"), ("MGRAPH_NET_REPORT", "maybe"),
]


@pytest.mark.parametrize("var,value", ENV, ids=[f"{v}={x}" for v, x in ENV])
def test_env_settings_name_the_variable(var, value, monkeypatch):
    monkeypatch.setenv(var, value)
    with pytest.raises(E.SettingsError) as info:
        Settings.from_env()
    assert f"{var}={value}" in str(info.value) and "hint" in str(info.value)
    # Every entry point reads settings before doing work: building an op refuses too.
    with pytest.raises(E.SettingsError, match=var):
        small()


def test_every_env_var_is_in_the_table():
    assert {v for v, _ in ENV} == set(ENV_VARS.values()) - {"MGRAPH_TCP_HOST"}


# -- JSON loading -----------------------------------------------------------------------------
def _doc():
    return json.loads(small().to_json())


JSON_CASES = [
    ("dtype int4", lambda d: d["buffers"][0].update(dtype="int4"), E.GraphFileError,
     "buffers\\[0\\].dtype"),
    ("10^12 rows", lambda d: d["buffers"][0].update(rows=10**12), E.SizeLimitError, "GiB"),
    ("zero rows", lambda d: d["buffers"][0].update(rows=0), E.GraphFileError,
     "buffers\\[0\\].rows"),
    ("no tasks", lambda d: d.update(tasks=[]), E.GraphFileError, "no tasks"),
    ("duplicate buffer", lambda d: d["buffers"].append(d["buffers"][0]), E.GraphFileError,
     "defined twice"),
    ("unknown top field", lambda d: d.update(comment="x"), E.GraphFileError, "comment"),
    ("unknown task field", lambda d: d["tasks"][2].update(prio=1), E.GraphFileError,
     "tasks\\[2\\].prio"),
    ("string rank", lambda d: d["tasks"][2].update(rank="0"), E.GraphFileError,
     "tasks\\[2\\].rank"),
    ("rank outside", lambda d: d["tasks"][2].update(rank=9), E.GraphFileError, "outside"),
    ("unknown kind", lambda d: d["tasks"][2].update(kind="fft"), E.GraphFileError, "fft"),
    ("unknown buffer", lambda d: d["tasks"][2]["reads"][0].__setitem__(0, "zz@0"),
     E.GraphFileError, "unknown buffer"),
    ("region outside", lambda d: d["tasks"][2]["writes"][0].__setitem__(2, 10**6),
     E.GraphFileError, "outside buffer"),
    ("missing event", lambda d: d["tasks"][2].update(signals=[10**6]), E.GraphFileError,
     "does not exist"),
    ("wrong format", lambda d: d.update(format="other/9"), E.GraphFileError, "format"),
    ("bad topology", lambda d: d.update(topology="0x2"), E.GraphFileError, "topology"),
    ("negative flops", lambda d: d["tasks"][0].update(flops=-1.0), E.GraphFileError, "flops"),
]


@pytest.mark.parametrize("mutate,error,match", [c[1:] for c in JSON_CASES],
                         ids=[c[0] for c in JSON_CASES])
def test_graph_json_is_checked_strictly(mutate, error, match, tmp_path, capsys):
    doc = _doc()
    mutate(doc)
    with pytest.raises(error, match=match):
        mg.TaskGraph.from_json(json.dumps(doc))
    path = tmp_path / "g.json"
    path.write_text(json.dumps(doc))
    assert main(["inspect", str(path)]) == 2
    assert error.__name__ in capsys.readouterr().out


def test_graph_files_that_are_not_graphs(tmp_path, capsys):
    (tmp_path / "junk.bin").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "half.json").write_text('{"format": ')
    (tmp_path / "list.json").write_text("[1, 2]")
    cases = {
        str(tmp_path / "missing.json"): "does not exist",
        str(tmp_path): "is a directory",
        str(tmp_path / "junk.bin"): "not text",
        str(tmp_path / "half.json"): "not JSON",
        str(tmp_path / "list.json"): "format",
    }
    for path, why in cases.items():
        assert main(["inspect", path]) == 2, path
        out = capsys.readouterr().out
        assert "GraphFileError" in out and why in out, (path, out)


def test_a_valid_graph_round_trips(tmp_path):
    g = small()
    assert mg.TaskGraph.from_json(g.to_json()).to_text() == g.to_text()


# -- every CLI subcommand -----------------------------------------------------------------------
OP = ["--op", "gemm_allreduce", "--shape", "64,64,64", "--topology", "2x2", "--dtype", "float32"]
EXAMPLE = str(Path(__file__).parent.parent / "examples" / "llama_block.py")
CLI = [
    ("inspect unknown op", ["inspect", "--op", "gemm_allreduse", "--shape", "1,1,1"],
     "UnknownNameError"),
    ("inspect nothing", ["inspect"], "MgraphError"),
    ("inspect shape count", ["inspect", "--op", "gemm", "--shape", "64,64"], "MgraphError"),
    ("inspect shape text", ["inspect", "--op", "gemm", "--shape", "64,x,64"], "ShapeError"),
    ("inspect bool no", ["inspect", *OP, "--set", "hierarchical=no"], "OptionError"),
    ("inspect bool 1", ["inspect", *OP, "--set", "hierarchical=1"], "OptionError"),
    ("inspect tile 64", ["inspect", *OP, "--set", "tile=64"], "SizeOptionError"),
    ("inspect tile text", ["inspect", *OP, "--set", "tile=a,b"], "OptionError"),
    ("inspect int text", ["inspect", *OP, "--set", "chunk_bytes=1.5"], "OptionError"),
    ("inspect not k=v", ["inspect", *OP, "--set", "hierarchical"], "OptionError"),
    ("inspect unknown option", ["inspect", *OP, "--set", "tiles=32,32"], "UnknownNameError"),
    ("inspect json folder", ["inspect", *OP, "--json", "/nonexistent-dir/g.json"],
     "OutputPathError"),
    ("inspect huge", ["inspect", "--op", "gemm_allreduce", "--shape", "1048576,1048576,1048576"],
     "SizeLimitError"),
    ("schedule bad policy", ["schedule", *OP, "--policy", "fastest"], "UnknownNameError"),
    ("schedule json folder", ["schedule", *OP, "--json", "/nonexistent-dir/s.json"],
     "OutputPathError"),
    ("schedule bad topology", ["schedule", "--op", "gemm", "--shape", "64,64,64",
                               "--topology", "0x2"], "TopologyError"),
    ("run bad backend", ["run", *OP, "--backend", "tpu"], "UnknownNameError"),
    ("run trace folder", ["run", *OP, "--trace", "/nonexistent-dir/t.json"], "OutputPathError"),
    ("run check on sim", ["run", *OP, "--backend", "sim", "--check"], "OptionError"),
    ("run causal text", ["run", "--op", "ring_attention", "--shape", "1,2,64,16", "--topology",
                         "1x2", "--set", "causal=yes"], "OptionError"),
    ("run bad dtype", ["run", "--op", "gemm", "--shape", "64,64,64", "--dtype", "int8"],
     "DTypeError"),
    ("simulate trace folder", ["simulate", *OP, "--trace", "/nonexistent-dir/t.json"],
     "OutputPathError"),
    ("simulate hardware file", ["simulate", *OP, "--hardware", "/nonexistent.json"],
     "SettingsError"),
    ("simulate unknown op", ["simulate", "--op", "nope", "--shape", "1"], "UnknownNameError"),
    ("demo bad topology", ["demo", "--topology", "2by2"], "TopologyError"),
    ("compile not FILE:NAME", ["compile", "nofile", "--input", "1,8"], "OptionError"),
    ("compile missing file", ["compile", "/nonexistent-dir/m.py:M", "--input", "1,8"],
     "OptionError"),
    ("compile unknown name", ["compile", f"{EXAMPLE}:NoSuchModule", "--input", "1,8"],
     "UnknownNameError"),
    ("compile input text", ["compile", f"{EXAMPLE}:DecoderBlock", "--input", "1,x"], "ShapeError"),
    ("compile unknown plan", ["compile", f"{EXAMPLE}:DecoderBlock", "--input", "1,8", "--plan",
                              "nope"], "UnknownNameError"),
    ("compile json folder", ["compile", f"{EXAMPLE}:DecoderBlock", "--input", "1,8", "--json",
                             "/nonexistent-dir/t.json"], "OutputPathError"),
]
if not torch.cuda.is_available():
    CLI.append(("run triton without CUDA", ["run", *OP, "--backend", "triton"],
                "BackendUnavailableError"))


@pytest.mark.parametrize("argv,error", [c[1:] for c in CLI], ids=[c[0] for c in CLI])
def test_cli(argv, error, capsys, monkeypatch, no_allocation):
    import mgraph.api

    started = []
    monkeypatch.setitem(mgraph.api.BACKENDS, "reference",
                        lambda *a, **k: started.append(1))  # would be "the work"
    assert main(argv) == 2
    out = capsys.readouterr().out
    line = next((x for x in out.splitlines() if x.startswith("error: ")), "")
    assert line.startswith(f"error: {error}") or (error == "MgraphError" and line), out
    assert error == "MgraphError" or isinstance(getattr(E, line.split()[1].rstrip(":")), type)
    assert "Traceback" not in out and not started


def test_cli_env_error_names_the_variable(capsys, monkeypatch):
    monkeypatch.setenv("MGRAPH_WATCHDOG_S", "abc")
    assert main(["run", *OP]) == 2
    assert "MGRAPH_WATCHDOG_S=abc" in capsys.readouterr().out


@pytest.mark.parametrize("text,value", [("false", False), ("False", False), ("FALSE", False),
                                        ("true", True)])
def test_cli_bools_parse_by_type(text, value, capsys):
    """`--set hierarchical=False` builds the FLAT graph (it used to build the hierarchical one)."""
    from mgraph.cli import build_from_args, make_parser

    args = make_parser().parse_args(["inspect", *OP, "--set", f"hierarchical={text}"])
    graph, _ = build_from_args(args)
    assert graph.params["hierarchical"] is value


def test_cli_sim_prints_the_prediction(capsys, tmp_path):
    trace = tmp_path / "sim.json"
    assert main(["run", *OP, "--backend", "sim", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "predicted" in out and "ms on H200" in out and "sequential" in out
    assert json.loads(trace.read_text())["traceEvents"]
