"""The tcp transport: frames between two transports on loopback (one process, then two), the
native and Python proxies on it, rejected regions, lost peers, and the reference runtime's
GEMM+AllReduce on topology 2x1 with one process per node."""

from __future__ import annotations

import queue
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import mgraph as mg
from helpers import node_processes
from mgraph.errors import ProxyError
from mgraph.runtime.proxy import Command, CommandFifo, NativeProxy, Proxy, Rect, TcpTransport
from mgraph.runtime.proxy.wire import WRITE
from mgraph.topology import Topology

ROWS, COLS, EVENTS = 32, 64, 16
WATCHDOG_S = 10.0


def eventually(check, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.002)


class Pair:
    """Ranks 0 and 1 of topology 2x1, each behind its own TcpTransport on loopback, as two
    processes would be; ``raised[r]`` records events arriving on rank r."""

    def __init__(self, seed: int = 0) -> None:
        self.store = dist.HashStore()
        gen = torch.Generator().manual_seed(seed)
        self.mem = {
            r: {b: torch.randn(ROWS, COLS, generator=gen) for b in range(2)} for r in (0, 1)
        }
        self.raised: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
        self.errors: list[ProxyError] = []
        topo = Topology.parse("2x1")
        self.t = {
            r: TcpTransport(
                self.store, self._raise, topo, [r], timeout=5.0, on_error=self.errors.append
            )
            for r in (0, 1)
        }
        for r in (0, 1):
            self.t[r].register(r, self.mem[r], n_events=EVENTS)
        dial = threading.Thread(target=self.t[0].connect, args=(0, 1))
        dial.start()
        self.t[1].connect(1, 0)
        dial.join()

    def _raise(self, rank: int, event: int, epoch: int) -> None:
        self.raised[rank].append((event, epoch))

    def close(self) -> None:
        for t in self.t.values():
            t.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def test_writes_and_signals_cross_and_raise_after_the_data(pair: Pair) -> None:
    src = pair.mem[0][0][4:8, 8:24]  # not contiguous: the payload is gathered
    pair.t[0].write(0, src, 1, Rect(1, 10, 14, 0, 16), events=[3, 4], epoch=2)
    pair.t[0].signal(0, 1, 5, epoch=2)
    pair.t[1].write(1, pair.mem[1][1][0:2], 0, Rect(0, 30, 32, 0, COLS), events=[6], epoch=2)
    many = list(range(EVENTS)) * 20  # more than one frame carries: the rest go as SIGNALs
    pair.t[0].signal(0, 0, 9, epoch=2)  # local: no socket
    pair.t[0].write(0, pair.mem[0][1][:1], 1, Rect(0, 0, 1, 0, COLS), events=many, epoch=2)
    eventually(lambda: len(pair.raised[1]) == 3 + len(many) and len(pair.raised[0]) == 2)
    assert torch.equal(pair.mem[1][1][10:14, 0:16], src)
    assert torch.equal(pair.mem[0][0][30:32], pair.mem[1][1][0:2])
    assert pair.raised[1][:3] == [(3, 2), (4, 2), (5, 2)]  # one connection: in order
    assert sorted(pair.raised[0]) == [(6, 2), (9, 2)]  # a local signal and a remote write
    assert sorted(e for e, _ in pair.raised[1][3:]) == sorted(many)
    assert pair.t[0].bytes_by_nodes[(0, 1)] == (4 * 16 + COLS) * 4
    assert len(pair.t[0].poll(0)) == 4 and not pair.errors
    done = threading.Thread(target=pair.t[1].fence, args=(2,))
    done.start()
    pair.t[0].fence(2)
    done.join()


@pytest.mark.parametrize("kind", ["native", "python"])
def test_proxies_drain_into_the_peer(pair: Pair, kind: str) -> None:
    fifo = CommandFifo(8)
    counters = {0: torch.zeros(EVENTS, dtype=torch.int64)}
    tiles = [Rect(0, 2 * i, 2 * i + 2, 0, COLS) for i in range(12)]
    if kind == "native":
        proxy = NativeProxy(fifo, pair.t[0], 8, rank=0, counters=counters)
    else:
        proxy = Proxy(fifo, pair.t[0], 8)
    with proxy:
        for i, t in enumerate(tiles):  # adjacent rows: coalesced into few frames
            fifo.push(
                Command.write(
                    0, t, 1, t._replace(buffer=1), bytes=2 * COLS * 4, event=i % EVENTS, epoch=1
                )
            )
        fifo.push(Command.signal(0, 1, 15, epoch=1))
    eventually(lambda: len(pair.raised[1]) == 13)
    assert torch.equal(pair.mem[1][1][:24], pair.mem[0][0][:24])
    assert sorted(pair.raised[1]) == sorted([(i, 1) for i in range(12)] + [(15, 1)])
    assert proxy.stats.coalesced > 0 and not pair.errors


@pytest.mark.parametrize("kind", ["native", "python"])
def test_sender_rejects_regions_outside_the_peer_buffer(pair: Pair, kind: str) -> None:
    before = pair.mem[1][0].clone()
    fifo = CommandFifo(8)
    fifo.push(Command.write(0, Rect(0, 0, 4, 0, 8), 1, Rect(0, 30, 34, 0, 8), bytes=128))
    if kind == "native":
        proxy = NativeProxy(fifo, pair.t[0], 8, rank=0, counters={})
    else:
        proxy = Proxy(fifo, pair.t[0], 8)
    with pytest.raises(ProxyError, match=r"outside rank 1 buffer 0 of shape \(32, 64\)"):
        proxy.stop()
    time.sleep(0.05)
    assert torch.equal(pair.mem[1][0], before) and not pair.raised[1]


def test_receiver_rejects_a_frame_outside_its_buffer(pair: Pair) -> None:
    """A misbehaving sender (bypassing the checks) cannot make the receiver write outside."""
    before = pair.mem[1][0].clone()
    conn = pair.t[0].conns[(0, 1)]
    pair.t[0]._send(conn, WRITE, 1, Rect(0, 31, 33, 0, COLS), [1], 1, torch.ones(2, COLS))
    eventually(lambda: bool(pair.errors))
    assert "rejected" in str(pair.errors[0]) and "outside rank 1 buffer 0" in str(pair.errors[0])
    assert torch.equal(pair.mem[1][0], before) and not pair.raised[1]


def test_a_lost_connection_is_reported_on_both_sides(pair: Pair) -> None:
    pair.t[1].conns[(1, 0)].sock.shutdown(socket.SHUT_RDWR)  # rank 1's network dies
    eventually(lambda: len(pair.errors) == 2)
    assert all("was lost" in str(e) for e in pair.errors)
    with pytest.raises(ProxyError, match="was lost"):
        pair.t[0].write(0, pair.mem[0][0][:1], 1, Rect(0, 0, 1, 0, COLS))


# -- two processes: the reference runtime, one process per node ------------------------------
def _node(node: int, port: int, proxy: str, fault: str, results) -> None:
    torch.set_num_threads(1)
    from helpers import rel_err
    from mgraph.runtime.reference import ReferenceRuntime
    from mgraph.scheduler import schedule
    from mgraph.settings import Settings

    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=30))
    graph = mg.ops.gemm_allreduce(M=64, N=96, K=32, topology="2x1", tile=[16, 32], chunk_bytes=2048)
    op = mg.ops.get_op(graph.op)
    rt = ReferenceRuntime(
        schedule(graph),
        Settings(proxy=proxy, watchdog_s=WATCHDOG_S),
        ranks=[node],
        store=store,
        tag=f"{proxy}-{fault}",
    )
    execute = rt.execute

    def faulty(task):  # node 1 fails in the middle of launch 2, before sending its partials
        if node == 1 and rt.epoch == 2 and task.kind == "gemm":
            if fault == "disconnect":  # its network goes away; the process lives on
                for conn in rt.network.transport.conns.values():
                    try:
                        conn.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:  # the peer already severed it (ENOTCONN): the same fault
                        pass
            elif fault == "crash":
                import os

                os._exit(3)
            elif fault == "tile":  # a tile body fails: the launch aborts on both sides
                raise RuntimeError("injected tile failure")
        execute(task)

    rt.execute = faulty
    report = []
    for seed in range(3):
        inputs = op.random_inputs(graph, seed=seed)
        start = time.monotonic()
        try:
            out = rt.run(inputs).outputs["out"]
            report.append(("ok", rel_err(out, op.run_reference(inputs, graph.params)["out"])))
        except Exception as err:  # what a launch raises is the test's subject
            report.append((type(err).__name__, str(err), time.monotonic() - start))
            break
    rt.close()
    results.put((node, report))


def _run_nodes(proxy: str, fault: str) -> dict[int, list]:
    store = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=30), wait_for_workers=False
    )
    ctx = node_processes()  # ten children in this file: torch and mgraph imported once
    results = ctx.Queue()
    procs = [ctx.Process(target=_node, args=(n, store.port, proxy, fault, results)) for n in (0, 1)]
    for p in procs:
        p.start()
    out: dict[int, list] = {}
    expected = 2 if fault != "crash" else 1
    deadline = time.monotonic() + 60
    try:
        while len(out) < expected and time.monotonic() < deadline:
            try:
                node, report = results.get(timeout=0.5)
                out[node] = report
            except queue.Empty:
                if not any(p.is_alive() for p in procs):  # nobody left to report
                    break
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():  # never leave a hung child behind
                p.kill()
    return out


@pytest.mark.parametrize("proxy", ["native", "python"])
def test_gemm_allreduce_2x1_across_two_processes(proxy: str) -> None:
    out = _run_nodes(proxy, "none")
    for node in (0, 1):
        assert [r[0] for r in out[node]] == ["ok"] * 3, out[node]
        assert all(r[1] < 1e-4 for r in out[node])


@pytest.mark.parametrize("fault", ["disconnect", "crash", "tile"])
def test_a_peer_lost_mid_run_is_a_named_error_not_a_hang(fault: str) -> None:
    out = _run_nodes("native", fault)
    for node in (0, 1) if fault != "crash" else (0,):
        first, second = out[node]
        assert first[0] == "ok"
        kind, message, seconds = second
        assert seconds < WATCHDOG_S, second  # well within the watchdog bound
        if fault == "tile" and node == 1:
            assert kind == "RuntimeError" and "injected tile failure" in message, second
        else:
            assert kind == "ProxyError", second
            assert "was lost" in message or "the peer disconnected" in message, second
