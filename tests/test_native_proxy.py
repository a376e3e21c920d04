"""The native drain loop: layout agreement, data and events, batching and coalescing, FIFO
wrap-around and back-pressure, epochs, rejected commands, pacing, and the runtime on top."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

import mgraph as mg
from helpers import rel_err
from mgraph.errors import ProxyError
from mgraph.runtime.proxy import Command, CommandFifo, InProcessTransport, Opcode, Rect, Word, wire
from mgraph.runtime.proxy.command import encode
from mgraph.runtime.proxy.native import NativeProxy, load
from mgraph.runtime.reference import ReferenceRuntime
from mgraph.scheduler import schedule
from mgraph.settings import Settings
from mgraph.topology import Topology

native = load()
ROWS, COLS, EVENTS = 32, 64, 64


class World:
    """Ranks with random buffers on one InProcessTransport, an int64 counter array per rank."""

    def __init__(self, topology: str = "2x2", seed: int = 0) -> None:
        self.topology = Topology.parse(topology)
        gen = torch.Generator().manual_seed(seed)
        self.mem = {
            r: {b: torch.randn(ROWS, COLS, generator=gen) for b in range(2)}
            for r in self.topology.ranks
        }
        self.counters = {r: torch.zeros(EVENTS, dtype=torch.int64) for r in self.topology.ranks}
        self.transport = InProcessTransport(lambda *_: None, self.topology)
        for rank, bufs in self.mem.items():
            self.transport.register(rank, bufs)
        for a in self.topology.ranks:
            for b in self.topology.ranks:
                if a < b:
                    self.transport.connect(a, b)

    def proxy(self, fifo: CommandFifo, rank: int, **kw) -> NativeProxy:
        return NativeProxy(
            fifo, self.transport, kw.pop("batch", 8), rank=rank, counters=self.counters, **kw
        )

    def region(self, rank: int, rect: Rect) -> torch.Tensor:
        return self.mem[rank][rect.buffer][rect.row0 : rect.row1, rect.col0 : rect.col1]


def write(src_rank: int, src: Rect, dst_rank: int, dst: Rect, **kw: int) -> Command:
    return Command.write(src_rank, src, dst_rank, dst, bytes=Rect(*src).numel * 4, **kw)


def rows(n: int, height: int = 2, buffer: int = 0) -> list[Rect]:
    return [Rect(buffer, i * height, (i + 1) * height, 0, COLS) for i in range(n)]


def test_layout_constants_match_the_python_side() -> None:
    assert native.WORDS == 16
    assert native.WORD_INDEX == {w.name: int(w) for w in Word}
    assert native.OPCODES == {o.name: int(o) for o in Opcode}
    assert native.FRAME == {
        "HEADER_WORDS": wire.HEADER.size // 8,
        "MAGIC": wire.MAGIC,
        "MAX_EVENTS": wire.MAX_EVENTS,
        "WRITE": wire.WRITE,
        "SIGNAL": wire.SIGNAL,
        "FENCE": wire.FENCE,
        "BYE": wire.BYE,
    }


def test_scattered_tiles_land_and_every_event_is_raised() -> None:
    w = World()
    fifo = CommandFifo(16)
    tiles = [Rect(0, r, r + 4, c, c + 8) for r in range(0, ROWS, 4) for c in range(0, COLS, 8)]
    order = torch.randperm(len(tiles), generator=torch.Generator().manual_seed(2)).tolist()
    with w.proxy(fifo, 1) as proxy:
        for i in order:  # random order: no two neighbours are adjacent
            fifo.push(
                write(
                    1,
                    tiles[i],
                    3,
                    tiles[i]._replace(buffer=1),
                    event=i % EVENTS,
                    done_event=1,
                    epoch=2,
                    task=i,
                )
            )
    assert torch.equal(w.mem[3][1], w.mem[1][0])
    assert w.counters[3].tolist() == [1] * EVENTS
    assert w.counters[1][1] == len(tiles)  # done events on the source
    assert proxy.stats.commands == len(tiles) and proxy.stats.bytes == ROWS * COLS * 4
    assert w.transport.bytes_by_nodes[(0, 1)] == ROWS * COLS * 4


@pytest.mark.parametrize("way", ["rows", "cols"])
def test_adjacent_tiles_coalesce_up_to_the_batch(way: str) -> None:
    w = World()
    fifo = CommandFifo(32)
    tiles = rows(16) if way == "rows" else [Rect(0, 0, ROWS, 4 * i, 4 * i + 4) for i in range(16)]
    for e, t in enumerate(tiles):  # queued before the loop starts: full batches of 8
        fifo.push(write(0, t, 2, t._replace(buffer=1), event=e))
    proxy = w.proxy(fifo, 0)
    proxy.stop()
    assert torch.equal(w.mem[2][1], w.mem[0][0])
    assert (proxy.stats.batches, proxy.stats.max_batch) == (2, 8)
    assert (proxy.stats.writes, proxy.stats.coalesced) == (2, 14)
    assert w.counters[2][:16].tolist() == [1] * 16


def test_tiles_continuing_differently_in_source_and_destination_stay_apart() -> None:
    w = World()
    fifo = CommandFifo(8)
    fifo.push(write(0, Rect(0, 0, 2, 0, 8), 1, Rect(0, 0, 2, 0, 8)))
    fifo.push(write(0, Rect(0, 2, 4, 0, 8), 1, Rect(0, 0, 2, 8, 16)))  # rows -> cols
    fifo.push(write(0, Rect(0, 4, 6, 0, 8), 1, Rect(0, 0, 2, 16, 24), epoch=5))  # other epoch
    proxy = w.proxy(fifo, 0)
    proxy.stop()
    assert (proxy.stats.writes, proxy.stats.coalesced) == (3, 0)
    assert torch.equal(w.mem[1][0][0:2, 8:16], w.mem[0][0][2:4, 0:8])


def test_wraparound_under_concurrent_python_producers() -> None:
    w = World("2x1")
    fifo = CommandFifo(4)  # tiny ring: every slot is reused many times

    def produce(start: int) -> None:
        for i in range(start, 64, 4):
            t = Rect(0, i % ROWS, i % ROWS + 1, 0, COLS)
            fifo.push(write(0, t, 1, t._replace(buffer=1), event=i % EVENTS))

    with w.proxy(fifo, 0, batch=3):
        threads = [threading.Thread(target=produce, args=(s,)) for s in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    assert fifo.head_value == fifo.tail_value == 64
    assert w.counters[1].tolist() == [1] * 64
    assert torch.equal(w.mem[1][1], w.mem[0][0])
    assert not fifo.ring.any()  # every consumed slot was cleared


def test_back_pressure_and_native_producers() -> None:
    """The GPU's protocol (CAS claim, release-publish) from two native threads at once."""
    w = World("2x1")
    fifo = CommandFifo(8)
    ptrs = (fifo.ring.data_ptr(), fifo.head.data_ptr(), fifo.tail.data_ptr(), fifo.capacity)
    signal = [encode(Command.signal(0, 1, e), 1) for e in (3, 4)]
    # Nobody drains yet: a producer fills the ring and then waits for space (back-pressure).
    assert native.produce(*ptrs, [signal[0]], 20, timeout_s=0.2) == 8
    proxy = w.proxy(fifo, 0).start()
    threads = [threading.Thread(target=native.produce, args=(*ptrs, [s], 5000)) for s in signal]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    proxy.stop()
    assert (w.counters[1][3], w.counters[1][4]) == (5008, 5000)
    assert fifo.head_value == fifo.tail_value == 10008
    assert proxy.stats.signals == 10008


def test_epochs_never_reset_counters() -> None:
    w = World("2x1")
    tiles = rows(8)
    for epoch in (1, 2, 3):
        w.mem[0][0].normal_()
        fifo = CommandFifo(16)
        for e, t in enumerate(tiles):
            fifo.push(write(0, t, 1, t._replace(buffer=1), event=e, epoch=epoch))
        fifo.push(Command.signal(0, 1, 9, epoch=epoch))
        w.proxy(fifo, 0).stop()
        assert torch.equal(w.mem[1][1][:16], w.mem[0][0][:16])
        # A launch's consumer waits for epoch * count: no reset between launches.
        assert w.counters[1][:8].tolist() == [epoch] * 8 and w.counters[1][9] == epoch


def test_signal_nop_and_shutdown() -> None:
    w = World("2x1")
    fifo = CommandFifo(8)
    proxy = w.proxy(fifo, 0).start()
    fifo.push(Command.nop())
    fifo.push(Command.signal(0, 1, 7))
    fifo.push(Command.signal(0, 0, 8))  # a local event
    fifo.push(Command.shutdown())
    deadline = time.monotonic() + 5
    while proxy.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not proxy.running  # SHUTDOWN ended the loop by itself
    proxy.stop()
    assert (w.counters[1][7], w.counters[0][8]) == (1, 1)


BAD = {
    "rows past the end": (
        Rect(0, 0, 2, 0, 8),
        1,
        Rect(0, 31, 33, 0, 8),
        {},
        r"region buf0\[31:33,0:8\] is outside rank 1 buffer 0 of shape \(32, 64\)",
    ),
    "cols past the end": (Rect(0, 0, 2, 60, 68), 1, Rect(0, 0, 2, 0, 8), {}, "outside rank 0"),
    "unknown buffer": (Rect(0, 0, 2, 0, 8), 1, Rect(7, 0, 2, 0, 8), {}, "rank 1 has no buffer 7"),
    "unknown rank": (Rect(0, 0, 2, 0, 8), 9, Rect(0, 0, 2, 0, 8), {}, "rank 9 has no registered"),
    "bytes": (Rect(0, 0, 2, 0, 8), 1, Rect(0, 0, 2, 0, 8), {"bytes": 60}, "bytes=60"),
    "event": (Rect(0, 0, 2, 0, 8), 1, Rect(0, 0, 2, 0, 8), {"event": EVENTS}, "outside rank 1's"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_commands_are_rejected_and_nothing_is_written(case: str) -> None:
    src, dst_rank, dst, kw, message = BAD[case]
    w = World("2x1")
    before = {r: {b: t.clone() for b, t in bufs.items()} for r, bufs in w.mem.items()}
    errors: list[ProxyError] = []
    fifo = CommandFifo(8)
    fifo.push(write(0, rows(1)[0], 1, rows(1, buffer=1)[0], event=0))  # a good one first
    fifo.push(
        Command.write(
            0,
            src,
            dst_rank,
            dst,
            bytes=kw.get("bytes", Rect(*src).numel * 4),
            event=kw.get("event", -1),
            task=42,
        )
    )
    proxy = w.proxy(fifo, 0, on_error=errors.append).start()
    deadline = time.monotonic() + 5
    while not errors and time.monotonic() < deadline:  # reported without waiting for stop()
        time.sleep(0.01)
    with pytest.raises(ProxyError, match=message) as info:
        proxy.stop()
    assert "command #1 (WRITE" in str(info.value) and "task 42" in str(info.value)
    assert info.value.ticket == 1 and fifo.tail_value == 1  # the bad command stays at the tail
    assert errors == [info.value]
    assert torch.equal(w.mem[1][1][:2], w.mem[0][0][:2]) and w.counters[1][0] == 1
    for r, bufs in w.mem.items():  # nothing else anywhere changed
        for b, t in bufs.items():
            if (r, b) != (1, 1):
                assert torch.equal(t, before[r][b])
    assert torch.equal(w.mem[1][1][2:], before[1][1][2:])


def test_raw_words_from_a_gpu_are_checked_too() -> None:
    """A GPU pushes raw words, not checked Commands: an inverted region must be refused."""
    w = World("2x1")
    fifo = CommandFifo(8)
    body = encode(write(0, Rect(0, 0, 2, 0, 8), 1, Rect(0, 0, 2, 0, 8)), 1)
    body[Word.SRC_ROWS] = 5 << 32 | 2  # rows 5..2
    native.produce(fifo.ring.data_ptr(), fifo.head.data_ptr(), fifo.tail.data_ptr(), 8, [body], 1)
    proxy = w.proxy(fifo, 0)
    with pytest.raises(ProxyError, match="empty or inverted"):
        proxy.stop()


def test_bandwidth_cap_paces_writes() -> None:
    w = World("2x1")
    fifo = CommandFifo(64)
    for t in rows(16):
        fifo.push(write(0, t, 1, t._replace(buffer=1)))
    nbytes = 16 * 2 * COLS * 4
    start = time.perf_counter()
    w.proxy(fifo, 0, bandwidth=nbytes / 0.05, coalesce=False).stop()  # 50 ms of "link"
    assert 0.045 < time.perf_counter() - start < 2.0


def test_cuda_path_reports_missing_libraries() -> None:
    fifo = CommandFifo(8)
    drain = native.Drain(
        fifo.ring.data_ptr(), fifo.head.data_ptr(), fifo.tail.data_ptr(), 8, 8, True, 1.0
    )
    failure = drain.use_cuda(0, ["libcudart-missing.so"], ["libcuda-missing.so"])
    assert "cannot load the CUDA runtime" in failure and "libcudart-missing.so" in failure


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_ipc_without_cuda_is_a_named_error() -> None:
    from mgraph.runtime.proxy import CudaIpcTransport

    with pytest.raises(ProxyError, match="CUDA is not available"):
        CudaIpcTransport(None, {0: 0})


def test_unbuilt_extension_is_a_named_error_and_python_stays_a_choice(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "mgraph.runtime.proxy.native._drain", None)
    with pytest.raises(ProxyError, match="not built") as info:
        load()
    assert "pip install -e ." in str(info.value) and "MGRAPH_PROXY=python" in str(info.value)
    graph = mg.ops.gemm_allreduce(M=32, N=32, K=32, topology="2x1", tile=[16, 16])
    with pytest.raises(ProxyError, match="not built"):
        ReferenceRuntime(schedule(graph), Settings(proxy="native"))
    with ReferenceRuntime(schedule(graph), Settings(proxy="python")) as rt:  # explicit: works
        rt.run(mg.ops.get_op(graph.op).random_inputs(graph))


@pytest.mark.parametrize("proxy", ["native", "python"])
def test_reference_runtime_on_either_proxy(proxy: str) -> None:
    graph = mg.ops.gemm_allreduce(M=64, N=96, K=32, topology="2x2", tile=[16, 32], chunk_bytes=2048)
    op = mg.ops.get_op(graph.op)
    with ReferenceRuntime(schedule(graph), Settings(proxy=proxy, watchdog_s=10)) as rt:
        for seed in range(3):
            inputs = op.random_inputs(graph, seed=seed)
            result = rt.run(inputs)
            assert (
                rel_err(result.outputs["out"], op.run_reference(inputs, graph.params)["out"]) < 1e-4
            )
            assert result.stats["rdma_bytes"] == graph.stats().bytes_by_link["rdma"]


def test_an_event_tagged_with_another_launch_is_refused() -> None:
    graph = mg.ops.gemm_allreduce(M=32, N=32, K=32, topology="2x1", tile=[16, 16])
    with ReferenceRuntime(schedule(graph), Settings(watchdog_s=10)) as rt:
        rt.run(mg.ops.get_op(graph.op).random_inputs(graph))
        with pytest.raises(ProxyError, match="tagged with launch 7 during launch 1"):
            rt.network._raise(1, 0, 7)  # what a transport calls for an arriving event
