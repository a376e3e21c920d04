"""Faults end a launch cleanly within the watchdog bound: a wait nobody will satisfy, a failing
proxy transport, and a peer process that freezes mid-run (alive, its sockets open, silent).
(A peer killed or disconnected mid-run: tests/test_tcp_transport.py.)"""

from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import mgraph as mg
from helpers import node_processes
from mgraph.builder import GraphBuilder
from mgraph.errors import MgraphError, WatchdogTimeout
from mgraph.kinds import Role
from mgraph.runtime.reference import ReferenceRuntime
from mgraph.settings import Settings

WATCHDOG_S = 1.0


def test_a_stuck_producer_expires_the_watchdog_and_releases_every_thread():
    b = GraphBuilder("stuck", mg.Topology.parse("1x2"), "float32", {})
    b.global_input("x", (2, 4))
    b.global_output("out", (2, 4))
    xs = [b.bound_buffer("x", r, "x", [((r, r + 1), (0, 4))]) for r in (0, 1)]
    outs = [b.bound_buffer("out", r, "out", [((r, r + 1), (0, 4))], role="output") for r in (0, 1)]
    never = b.event(1, "never")  # its only signaller gets stuck in its tile body
    b.task(0, Role.COMPUTE, "copy", [xs[0].region()], [outs[0].region()], signals=[never],
           name="stuck")
    b.task(1, Role.COMPUTE, "copy", [xs[1].region()], [outs[1].region()], waits=[(never, 1)])
    graph = b.finish()
    before = threading.active_count()
    with ReferenceRuntime(mg.schedule(graph), Settings(watchdog_s=WATCHDOG_S)) as rt:
        execute = rt.execute

        def stuck(task):
            if task.name == "stuck":
                time.sleep(1.5 * WATCHDOG_S)
            execute(task)

        rt.execute = stuck
        start = time.monotonic()
        try:
            rt.run({"x": torch.randn(2, 4)})
            raise AssertionError("the launch finished although a wait can never be met")
        except WatchdogTimeout as exc:
            assert "'never'" in str(exc) and "rank 1" in str(exc)
        assert time.monotonic() - start < WATCHDOG_S + 2.0
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before, "worker or proxy threads outlived the runtime"


def test_a_failing_transport_aborts_the_launch(monkeypatch):
    graph = mg.ops.gemm_allreduce(M=64, N=64, K=64, topology="2x1", tile=[32, 32])
    settings = Settings(watchdog_s=WATCHDOG_S, proxy="python")
    with ReferenceRuntime(mg.schedule(graph), settings) as rt:
        transport = rt.network.transport

        def broken(*args, **kwargs):
            raise OSError("injected: the NIC went away")

        for name in ("write", "execute", "submit", "send"):
            if hasattr(transport, name):
                monkeypatch.setattr(transport, name, broken)
        start = time.monotonic()
        try:
            rt.run(mg.ops.get_op(graph.op).random_inputs(graph))
            raise AssertionError("the launch finished although the transport fails")
        except MgraphError as exc:
            assert "injected" in str(exc) or isinstance(exc, WatchdogTimeout), exc
        assert time.monotonic() - start < WATCHDOG_S + 2.0


def _node(node: int, port: int, results) -> None:
    from mgraph.scheduler import schedule

    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
    graph = mg.ops.gemm_allreduce(M=64, N=96, K=32, topology="2x1", tile=[16, 32],
                                  chunk_bytes=2048)
    rt = ReferenceRuntime(schedule(graph), Settings(watchdog_s=WATCHDOG_S), ranks=[node],
                          store=store, tag="freeze")
    execute = rt.execute

    def frozen(task):  # node 1 stops dead in launch 2, holding its sockets open
        if node == 1 and rt.epoch == 2 and task.kind == "gemm":
            time.sleep(4 * WATCHDOG_S)
        execute(task)

    rt.execute = frozen
    report = []
    op = mg.ops.get_op(graph.op)
    for seed in range(2):
        start = time.monotonic()
        try:
            rt.run(op.random_inputs(graph, seed=seed))
            report.append(("ok", time.monotonic() - start))
        except Exception as err:  # what the launch raises is the test's subject
            report.append((type(err).__name__, time.monotonic() - start))
            break
    rt.close()
    results.put((node, report))


def test_a_frozen_peer_is_a_named_error_within_the_watchdog():
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    ctx = node_processes()
    results = ctx.Queue()
    procs = [ctx.Process(target=_node, args=(n, store.port, results)) for n in (0, 1)]
    for p in procs:
        p.start()
    out: dict[int, list] = {}
    deadline = time.monotonic() + 90
    try:
        while len(out) < 2 and time.monotonic() < deadline:
            try:
                node, report = results.get(timeout=0.5)
                out[node] = report
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    assert 0 in out, out
    first, second = out[0]
    assert first[0] == "ok"
    kind, seconds = second
    assert kind in ("WatchdogTimeout", "ProxyError"), second
    assert seconds < WATCHDOG_S + 2.0, second  # the watchdog bound, not the peer's 4 s freeze
