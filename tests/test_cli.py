"""The `mgraph` command: every subcommand runs, writes what it says, and bad input exits 2 with
a named error instead of a traceback."""

from __future__ import annotations

import json

import mgraph as mg
from mgraph.cli import main


def test_demo_runs_all_five_ops_and_writes_timelines(tmp_path, capsys):
    assert main(["demo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for op in ("gemm_allreduce", "gemm_reduce_scatter", "allgather_gemm", "ring_attention",
               "moe_dispatch_combine"):
        assert op in out
        doc = json.loads((tmp_path / f"{op}.trace.json").read_text())
        assert any(e["ph"] == "X" for e in doc["traceEvents"])
    assert "FAILED" not in out


def test_inspect_writes_and_reads_back(tmp_path, capsys):
    path = tmp_path / "g.json"
    args = ["inspect", "--op", "gemm_allreduce", "--shape", "64,64,64", "--topology", "2x2",
            "--set", "tile=[32,32]", "--json", str(path)]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "valid" in first and "rdma" in first
    assert mg.TaskGraph.load(path).op == "gemm_allreduce"
    assert main(["inspect", str(path)]) == 0


def test_inspect_network_counts_the_proxy_commands(capsys):
    args = ["inspect", "--op", "gemm_allreduce", "--shape", "128,64,64", "--topology", "2x1",
            "--set", "tile=[32,32]", "--network"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "network per launch" in out and "WRITEs" in out
    import torch

    from mgraph.cli import human_bytes
    from mgraph.runtime.megakernel.netplan import net_plan

    g = mg.ops.gemm_allreduce(M=128, N=64, K=64, topology="2x1", tile=[32, 32],
                              dtype=torch.bfloat16)
    plan = net_plan(g)
    sent = sum(c.bytes for t, cs in plan.commands.items() if g.tasks[t].rank == 0 for c in cs)
    assert human_bytes(sent) in out
    assert "flag words" in out and str(len(plan.words[0])) in out
    assert main(["inspect", "--op", "gemm", "--shape", "64,64,64", "--topology", "1x1",
                 "--network"]) == 0
    assert "no rdma tasks" in capsys.readouterr().out


def test_schedule_and_run_with_check_and_trace(tmp_path, capsys):
    sched = tmp_path / "s.json"
    assert main(["schedule", "--op", "allgather_gemm", "--shape", "64,64,32", "--topology", "1x2",
                 "--dtype", "float32", "--json", str(sched)]) == 0
    assert sched.exists()
    trace = tmp_path / "t.json"
    assert main(["run", "--op", "ring_attention", "--shape", "1,2,64,16", "--set", "causal=true",
                 "--topology", "2x1", "--dtype", "float32", "--check", "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "ok" in out and trace.exists()


def test_ops_lists_every_op(capsys):
    assert main(["ops"]) == 0
    out = capsys.readouterr().out
    for name in mg.ops.op_names():
        assert name in out


def test_bad_input_exits_2_with_a_named_error(capsys):
    assert main(["inspect", "--op", "nope", "--shape", "1,2,3"]) == 2
    assert "UnknownNameError" in capsys.readouterr().out
    assert main(["inspect", "--op", "gemm_allreduce", "--shape", "64,64", "--topology", "1x2"]) == 2
    assert "takes 3" in capsys.readouterr().out
    assert main(["run", "--op", "gemm_allreduce", "--shape", "64,64,63", "--topology", "1x2"]) == 2
    assert "ShapeError" in capsys.readouterr().out
    assert main(["inspect", "--op", "gemm_allreduce", "--shape", "64,64,64", "--topology", "0x2"]) == 2
    assert "TopologyError" in capsys.readouterr().out
