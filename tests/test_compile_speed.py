"""`mgraph compile --profile`: the time of each stage of mg.compile, cold and warm. Speed itself
is measured, not asserted (benchmarks, not tests): these tests check the report is there, names
every stage and adds up."""

from __future__ import annotations

import json
from pathlib import Path

import mgraph.program
from mgraph.cli import main
from mgraph.graph import TaskGraph

EXAMPLE = str(Path(__file__).parent.parent / "examples" / "llama_block.py")


def test_compile_profile_reports_every_stage_and_adds_up(tmp_path, capsys):
    out = tmp_path / "times.json"
    before = (mgraph.program.lower, mgraph.program.trace, TaskGraph.validate)
    argv = ["compile", f"{EXAMPLE}:DecoderBlock", "--set", "hidden=64", "--set", "ffn=128",
            "--input", "1,32,64", "--plan", "block_plan", "--topology", "1x2", "--repeat", "2",
            "--profile", "--json", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for stage in ("trace", "lower", "validate", "schedule", "total"):
        assert stage in printed, printed
    report = json.loads(out.read_text())
    assert [r["run"] for r in report["runs"]] == ["cold", "warm"]
    for run in report["runs"]:
        stages = run["stages"]
        assert {"trace", "lower", "validate", "schedule"} <= set(stages), stages
        assert run["tasks"] > 0
        assert all(v["wall_s"] >= 0 and v["cpu_s"] >= 0 for v in stages.values())
        # the stages run one after another inside the compile: together no longer than it
        assert sum(v["wall_s"] for v in stages.values()) <= run["wall_s"] + 1e-6
        assert sum(v["cpu_s"] for v in stages.values()) <= run["cpu_s"] + 1e-3
    # the timing wrappers are gone afterwards
    assert (mgraph.program.lower, mgraph.program.trace, TaskGraph.validate) == before
