"""Shared checks for op tests: validate, run on the CPU oracle, compare with torch, round-trip."""

from __future__ import annotations

import torch

import mgraph as mg
from mgraph.graph import TaskGraph
from mgraph.runtime import run_sequential

TOPOLOGIES = ["1x2", "2x1", "2x4", "4x2"]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def check_graph(graph: TaskGraph, *, seed: int = 0, tol: float = 1e-4) -> dict[str, float]:
    """The graph validates, equals its JSON round trip, and its CPU execution matches torch."""
    graph.validate()
    again = TaskGraph.from_json(graph.to_json())
    assert again.to_text() == graph.to_text()
    assert again.tasks == graph.tasks and again.buffers == graph.buffers
    op = mg.ops.get_op(graph.op)
    inputs = op.random_inputs(graph, seed=seed)
    for name, t in inputs.items():
        assert t.float().abs().sum() > 0, f"input {name} is all zeros"
    got = run_sequential(graph, inputs)
    want = op.run_reference(inputs, graph.params)
    errs = {}
    for name in graph.outputs:
        errs[name] = rel_err(got[name], want[name])
        assert errs[name] < tol, f"{graph.op} {graph.topology} output {name}: rel err {errs[name]}"
    return errs


def written_once(graph: TaskGraph, buffer_name: str) -> None:
    """Every element of every ``buffer_name`` buffer is written by exactly one task, or, in a
    zeroed buffer that tasks accumulate into, receives the same number of adds (one per
    contributing rank) and no plain write."""
    counts = {
        b.id: torch.zeros(b.shape, dtype=torch.int32)
        for b in graph.buffers.values()
        if b.name == buffer_name
    }
    adds = {bid: torch.zeros_like(c) for bid, c in counts.items()}
    assert counts, buffer_name
    for t in graph.tasks:
        for w in t.writes:
            if w.buffer in counts:
                into = adds if t.params.get("accumulate") else counts
                into[w.buffer][w.row0 : w.row1, w.col0 : w.col1] += 1
    for bid, c in counts.items():
        a = adds[bid]
        if int(a.max()) > 0:
            assert graph.buffers[bid].zeroed, bid
            assert int(c.max()) == 0 and int(a.min()) == int(a.max()), (
                f"{bid}: plain writes {c.min()}..{c.max()}, adds {a.min()}..{a.max()}")
            continue
        assert int(c.min()) == 1 and int(c.max()) == 1, f"{bid}: writes per element {c.min()}..{c.max()}"


def interpreter_rows(script: str, timeout: int = 300) -> dict[str, dict]:
    """Run ``tests/<script>`` under TRITON_INTERPRET=1 in a process of its own (the flag must be
    set before triton is imported: run_interpreted) and return its JSON lines by their "case"."""
    import json
    import os
    from pathlib import Path

    here = Path(__file__).parent
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(here))
    proc = run_interpreted([str(here / script)], env, timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {r["case"]: r for r in out}


def node_processes():
    """A multiprocessing context for the CPU tests' process-per-node runs: "forkserver", whose
    server imports torch and mgraph once per pytest process and forks each node's process from
    there (clean: the server runs no threads), where "spawn" had every child import them anew
    (~3 s each on CI's two cores). A child sees the environment the server started with: pass
    what a node needs as arguments, not through os.environ."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "mgraph", "helpers"])
    return ctx


def run_interpreted(args: list[str], env: dict[str, str], timeout: float,
                    input: str | None = None):
    """``subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
    timeout=timeout, input=input)`` for a script run under TRITON_INTERPRET=1 (``env`` must set
    it): a fresh process forked from a server that imported torch, triton and mgraph once per
    pytest process (tests/interp_server.py: the script sees what a new interpreter would give
    it), not a new interpreter importing them again."""
    from interp_server import run_script

    return run_script(args, env, timeout, input=input)


def row_vec(graph: TaskGraph, region, dtype: torch.dtype) -> bool:
    """tilewise.row_operand's ``vec`` on the host (buffers 256-byte aligned, small): the region's
    corner, pitch and width are whole 16-byte vectors."""
    vec = 16 // torch.empty((), dtype=dtype).element_size()
    cols = graph.buffers[region.buffer].cols
    width = region.col1 - region.col0
    pitch = cols if region.row1 - region.row0 > 1 else 0
    return width > 1 and all(w % vec == 0 for w in (region.row0 * cols + region.col0, pitch, width))


def check_interpreter_cases(script: str, cases: dict[str, bool]) -> None:
    """Run ``script``'s megakernel cases under the interpreter (interpreter_rows): exactly
    ``cases`` ran, each within its dtype's tolerance (one bf16 ulp, as test_triton_bodies.py), and
    the fast path took every ewise task of a case marked True and none of one marked False."""
    rows = interpreter_rows(script)
    tol = {"float32": 2e-6, "bfloat16": 1e-2}
    assert sorted(rows) == sorted(cases), sorted(rows)
    for case, r in rows.items():
        assert r["error"] < tol[r["dtype"]], r
        assert r["fast"] == (r["tasks"] if cases[case] else 0), r
