"""MGRAPH_NET_REPORT (runtime/megakernel/net_report.py): a multi-node watchdog error names every
net word short of its count, the proxy that owes it, and what that proxy issued, so the two
ranks' errors of a cross-rank hang say which side stopped. Words of a 2x1 GEMM+AllReduce's plan
(the graph of the emulated test that hung on one shared GPU, scaled down), and the report read
from a runtime under the interpreter."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import mgraph as mg
from helpers import run_interpreted
from mgraph.runtime.megakernel.net_report import short_words, writer_of
from mgraph.runtime.megakernel.netplan import net_plan

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def graph_plan():
    graph = mg.ops.gemm_allreduce(M=256, N=128, K=64, topology="2x1", tile=[8, 8],
                                  chunk_bytes=8 * 128 * 4)  # fmt: skip
    return graph, net_plan(graph)


def _full(plan, rank, epoch):
    return [epoch * n for n in plan.per_launch[rank]]


def test_the_writer_of_each_word_kind(graph_plan) -> None:
    graph, plan = graph_plan
    for rank in (0, 1):
        for key in plan.words[rank]:
            writer = writer_of(graph, rank, key)
            if key[0] in ("task", "arrive", "start"):
                assert writer == 1 - rank, key  # the peer's proxy delivers into this rank
            else:
                assert writer == rank, key  # "sent" (and "event"): the source's own proxy


def test_a_missing_chunk_is_named_with_its_proxy(graph_plan) -> None:
    graph, plan = graph_plan
    send = [t for t in graph.tasks if t.name.startswith("rail-send r1->r0")][7]
    word = plan.words[0][("task", send.id)]
    epoch = 2
    values = _full(plan, 0, epoch)
    values[word] -= 1
    assert short_words(graph, plan, 0, epoch, _full(plan, 0, epoch)) == []
    # rank 0's own view: the word, its task and rank 1's proxy; no "issued" (not its proxy)
    (line,) = short_words(graph, plan, 0, epoch, values, values, [0] * len(values), here={0})
    assert f"word {word} [task {send.id} ({send.name})]" in line
    assert "raised by rank 1's proxy: 1 of 2" in line and "issued" not in line
    # rank 1's view of rank 0's words: only those its proxy raises, with what it issued
    later = list(values)
    later[word] += 1
    (line,) = short_words(graph, plan, 0, epoch, values, later, _full(plan, 0, epoch), here={1})
    assert "1 of 2 (2 after the settle), issued 2" in line
    sent = plan.words[0][("sent", 0)]
    values[sent] -= 1
    lines = short_words(graph, plan, 0, epoch, values, values, None, here={1})
    assert len(lines) == 1 and "sent" not in lines[0]  # rank 0's own proxy's word: not rank 1's


def test_net_report_on_an_interpreted_runtime() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = run_interpreted([str(HERE / "net_report_interp.py")], env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "every net word read here is at its count" in row["whole"], row["whole"]
    assert "FIFO:" in row["whole"] and "proxy interpreter (running): commands" in row["whole"]
    assert f"word {row['word']} [task" in row["short"] and row["send"] in row["short"], row
    assert "raised by rank 1's proxy: 0 of 1, chunk landed" in row["short"], row["short"]
    # the proxy stopped before the launch: nothing it owes landed, its commands are queued
    timeout = row["timeout"]
    assert timeout.startswith("watchdog (triton)") and "network at epoch 1" in timeout, timeout
    assert "commands finished by the proxy" in timeout and "(stopped)" in timeout, timeout
    assert "raised by rank 1's proxy: 0 of 1, chunk NOT in its destination" in timeout, timeout
