"""`mgraph view` without a browser: the data the page draws (stages, edges by link class, critical
path, bandwidth), the page is self-contained, a 40k-task graph stays under 20 MB, and the CLI.
The browser test is tests/test_viz_browser.py."""

from __future__ import annotations

import json
import re

import pytest
import torch

import mgraph as mg
from mgraph.cli import main
from mgraph.errors import InputError
from mgraph.runtime.trace import TaskRecord, Trace
from mgraph.viz import view
from mgraph.viz.data import critical_path, graph_data, stage_of, task_edges, trace_data
from mgraph.viz.html import MAX_BYTES, build_html, load_chrome_trace


@pytest.fixture(scope="module")
def small():
    g = mg.ops.gemm_allreduce(M=256, N=256, K=128, topology="2x2", dtype=torch.float32,
                              tile=[64, 64])
    sched = mg.schedule(g)
    return g, sched, mg.run(sched)


def page_data(text: str) -> dict:
    block = re.search(r'<script type="application/json" id="mgraph-data">(.*?)</script>', text,
                      re.S)
    return json.loads(block.group(1))


def queue_trace(sched) -> Trace:
    """A trace with a record per task: each role queue run in order on its workers, one after
    another at the cost model's times (a 40k-task run without the simulator's seconds)."""
    from mgraph.scheduler.costmodel import task_costs

    g = sched.graph
    costs = task_costs(g, sched.hardware)
    records = []
    for rs in sched.ranks:
        for role, queue in rs.queues.items():
            free = [0.0] * max(1, rs.workers.get(role, 1))
            for tid in queue:
                w = min(range(len(free)), key=free.__getitem__)
                t = g.tasks[tid]
                records.append(TaskRecord(tid, t.name, t.kind, t.rank, role, w, free[w],
                                          free[w] + costs[tid]))
                free[w] += costs[tid]
    return Trace(records=records, backend="queues")


def test_stages_are_name_stems():
    assert stage_of("gemm r0 [1024:1152,0:256]") == "gemm"
    assert stage_of("rail-send r3->r1 [0:64,0:64]") == "rail-send"
    assert stage_of("down_proj/gemm r1 [0:32,0:64]") == "down_proj/gemm"
    assert stage_of("output copy out r0") == "output copy out"


def test_edges_follow_events_and_are_classed_by_link(small):
    g, _, _ = small
    edges = task_edges(g)
    signalers = g.signalers()
    want = sum(len(set(signalers[e])) for t in g.tasks for e, _ in t.waits)
    assert len(edges) == want
    topo = g.topology
    by_link = {link: [e for e in edges if e[2] == link] for link in ("local", "nvlink", "rdma")}
    assert all(by_link.values()), "a hierarchical all-reduce on 2x2 uses every link class"
    for src, dst, _, nbytes in by_link["rdma"]:
        # an rdma dependency crosses nodes: the sender is an rdma task, or the ranks differ by node
        s, d = g.tasks[src], g.tasks[dst]
        assert s.role == "rdma" or topo.node_of(s.rank) != topo.node_of(d.rank)
        assert nbytes == sum(g.region_bytes(r) for r in s.writes) > 0
    for src, dst, _, _ in by_link["local"]:
        assert g.tasks[src].rank == g.tasks[dst].rank


def test_critical_path_is_a_chain_ending_last(small):
    g, _, result = small
    recs = result.trace.records
    path = critical_path(g, recs)
    assert recs[path[-1]].end == max(r.end for r in recs)
    for a, b in zip(path, path[1:], strict=False):
        assert recs[a].end <= recs[b].start + 1e-12
        dep = {s for e, _ in g.tasks[recs[b].task].waits for s in g.signalers()[e]}
        same_worker = (recs[a].rank, recs[a].role, recs[a].worker) == (
            recs[b].rank, recs[b].role, recs[b].worker)
        assert recs[a].task in dep or same_worker


def test_bandwidth_conserves_the_bytes_moved(small):
    g, _, result = small
    data = trace_data(result.trace, g)
    bw = data["bandwidth"]
    world = g.topology.world_size
    moved = {link: 0 for link in ("nvlink", "rdma")}
    links = graph_data(g)["tasks"]["link"]
    for r in result.trace.records:
        link = ("local", "nvlink", "rdma")[links[r.task]]
        if link != "local":
            moved[link] += sum(g.region_bytes(x) for x in g.tasks[r.task].writes)
    for i, link in enumerate(("local", "nvlink", "rdma")):
        total = sum(bw["gbps"][i]) * 1e9 * bw["bin_us"] * 1e-6 * world
        assert total == pytest.approx(moved.get(link, 0), rel=0.02, abs=1e4)


def test_page_is_self_contained_and_carries_every_view(small, tmp_path):
    g, sched, result = small
    path = view(result, tmp_path / "v.html", schedule=sched)
    text = path.read_text()
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text), "no network at view time"
    assert "<link" not in text and "import(" not in text
    data = page_data(text)
    assert len(data["graph"]["tasks"]["name"]) == len(g.tasks)
    assert data["schedule"]["ranks"][0]["queues"] == sched.ranks[0].queues
    assert len(data["trace"]["task"]) == len(result.trace.records)
    with pytest.raises(InputError, match="needs the schedule"):
        view(result, tmp_path / "x.html")
    with pytest.raises(InputError, match="cannot view"):
        view(42, tmp_path / "x.html")


def test_forty_thousand_tasks_stay_under_20_mb():
    g = mg.ops.gemm_allreduce(M=8192, N=8192, K=4096, topology="2x8", dtype=torch.bfloat16)
    assert len(g.tasks) >= 40_000
    sched = mg.schedule(g)
    text = build_html(sched, trace=queue_trace(sched))
    assert len(text) < MAX_BYTES
    data = page_data(text)
    assert len(data["trace"]["task"]) == len(g.tasks)
    assert set(data["graph"]["stages"]) == {"gemm", "node-reduce", "rail-reduce", "broadcast",
                                            "rail-send", "rail-gather"}


def test_chrome_trace_round_trip(small, tmp_path):
    _, _, result = small
    result.trace.save(tmp_path / "t.json")
    back = load_chrome_trace(tmp_path / "t.json")
    key = lambda r: (r.task, r.rank, r.role, r.worker)  # noqa: E731
    assert sorted(map(key, back.records)) == sorted(map(key, result.trace.records))
    first = min(result.trace.records, key=lambda r: r.task)
    again = next(r for r in back.records if r.task == first.task)
    assert again.start == pytest.approx(first.start) and again.end == pytest.approx(first.end)


def test_cli_view_from_an_op_a_graph_file_and_a_trace(tmp_path, capsys):
    out = tmp_path / "v.html"
    args = ["view", "--op", "gemm_allreduce", "--shape", "128,128,64", "--topology", "2x2",
            "--set", "tile=[64,64]", "-o", str(out)]
    assert main(args) == 0
    assert "wrote" in capsys.readouterr().out
    assert page_data(out.read_text())["trace"]["backend"] == "sim"
    graph_json, trace_json = tmp_path / "g.json", tmp_path / "t.json"
    assert main(["inspect", "--op", "gemm", "--shape", "128,128,64", "--topology", "1x2",
                 "--json", str(graph_json)]) == 0
    assert main(["run", "--op", "gemm", "--shape", "128,128,64", "--topology", "1x2",
                 "--dtype", "float32", "--trace", str(trace_json)]) == 0
    assert main(["view", str(graph_json), "--trace", str(trace_json), "-o", str(out)]) == 0
    data = page_data(out.read_text())
    assert data["graph"]["op"] == "gemm" and data["trace"]["backend"] == "reference"
    assert main(["view", "-o", str(out)]) == 2  # nothing to view: a named error, not a traceback
