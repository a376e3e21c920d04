"""The native drain loop: layout agreement, data and events, batching and coalescing, FIFO
wrap-around and back-pressure, epochs, rejected commands, pacing, and the runtime on top."""

from __future__ import annotations

import os
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


# -- int32 host flag words ---------------------------------------------------------------------
FLAGS = 16


def flag_world(topology: str = "2x1") -> tuple[World, dict[int, torch.Tensor]]:
    """A World whose ranks raise their events on int32 flag words instead of the counters."""
    w = World(topology)
    flags = {r: torch.zeros(FLAGS, dtype=torch.int32) for r in w.topology.ranks}
    for r, f in flags.items():
        w.transport.register_flags(r, f)
    return w, flags


def produce(fifo: CommandFifo, cmds: list[Command], count: int | None = None) -> int:
    """Push ``cmds`` through the native producer (the GPU's protocol), cycling to ``count``."""
    bodies = [encode(c, 1) for c in cmds]
    ptrs = (fifo.ring.data_ptr(), fifo.head.data_ptr(), fifo.tail.data_ptr(), fifo.capacity)
    return native.produce(*ptrs, bodies, len(cmds) if count is None else count)


def test_repeated_flag_words_are_raised_once_per_batch_with_exact_counts() -> None:
    w, flags = flag_world()
    tiles = rows(16)
    # One batch of 8, pushed twice: tiles 0, 2, 4, ... (never adjacent: no coalescing) raising
    # word 3 four times, 5 twice, 4 twice, and the source's done word 1 twice.
    batch = [
        write(0, tiles[0], 1, tiles[0]._replace(buffer=1), event=3, done_event=1),
        Command.signal(0, 1, 3),
        write(0, tiles[2], 1, tiles[2]._replace(buffer=1), event=3),
        Command.signal(0, 1, 5),
        write(0, tiles[4], 1, tiles[4]._replace(buffer=1), event=4),
        Command.signal(0, 1, 3),
        write(0, tiles[6], 1, tiles[6]._replace(buffer=1), event=4, done_event=1),
        Command.signal(0, 1, 5),
    ]
    fifo = CommandFifo(16)
    assert produce(fifo, batch, 16) == 16  # queued before the loop starts: two full batches
    proxy = w.proxy(fifo, 0, batch=8)
    proxy.stop()
    want = torch.zeros(FLAGS, dtype=torch.int32)
    want[3], want[4], want[5] = 8, 4, 4
    assert torch.equal(flags[1], want)
    assert flags[0].tolist() == [0, 4] + [0] * (FLAGS - 2)
    for t in tiles[0:8:2]:
        assert torch.equal(w.region(1, t._replace(buffer=1)), w.region(0, t))
    s = proxy.loop_stats()
    assert (s["commands"], s["batches"], s["writes"], s["signals"]) == (16, 2, 8, 8)
    assert s["events"] == 20 and s["raises"] == 8  # 4 distinct words a batch
    assert not any(c.any() for c in w.counters.values())  # flags replaced the counters


def test_a_word_goes_out_once_its_last_write_of_the_batch_landed_not_at_batch_end() -> None:
    w, flags = flag_world()
    tiles = rows(16)
    fifo = CommandFifo(16)
    # Two batches of 8 paced writes (10 ms each); each word counts 4 consecutive tiles.
    produce(fifo, [write(0, t, 1, t._replace(buffer=1), event=i // 4) for i, t in enumerate(tiles)])

    def landed(k: int) -> bool:
        return torch.equal(w.region(1, tiles[k]._replace(buffer=1)), w.region(0, tiles[k]))

    early: list[bool] = []  # word 0 complete while its batch's last tile was not yet written
    wrong: list[str] = []
    done = threading.Event()

    def watch() -> None:  # a consumer: a count c means the first c tiles of its word landed
        while not done.is_set():
            counts = flags[1][:4].tolist()
            early.append(counts[0] == 4 and not landed(7))
            wrong.extend(
                f"word {word} at {c} before tile {4 * word + k}"
                for word, c in enumerate(counts)
                for k in range(c)
                if not landed(4 * word + k)
            )

    watcher = threading.Thread(target=watch)
    watcher.start()
    proxy = w.proxy(fifo, 0, batch=8, coalesce=False, bandwidth=2 * COLS * 4 / 0.01)
    proxy.stop()
    done.set()
    watcher.join()
    assert wrong == [] and any(early)
    assert flags[1][:4].tolist() == [4, 4, 4, 4] and not flags[1][4:].any()
    s = proxy.loop_stats()
    assert (s["batches"], s["writes"], s["events"], s["raises"]) == (2, 16, 16, 4)


def test_flag_event_out_of_range_names_the_command() -> None:
    w, flags = flag_world()
    fifo = CommandFifo(8)
    t = rows(2)
    # The first signal's word is raised again after the bad command, so its raise is still
    # pending when the batch fails: it must go out anyway (the signal was executed).
    produce(
        fifo,
        [
            Command.signal(0, 1, 2),
            write(0, t[0], 1, t[0]._replace(buffer=1), event=FLAGS, task=77),
            Command.signal(0, 1, 2),
        ],
    )
    with pytest.raises(ProxyError, match=rf"event {FLAGS} is outside rank 1's {FLAGS} events") as e:
        w.proxy(fifo, 0).stop()
    assert "command #1 (WRITE" in str(e.value) and "task 77" in str(e.value)
    assert flags[1].tolist() == [0, 0, 1] + [0] * (FLAGS - 3)
    assert not torch.equal(w.region(1, t[0]._replace(buffer=1)), w.region(0, t[0]))
    assert fifo.tail_value == 1


def test_flags_ring_the_doorbell() -> None:
    w, flags = flag_world()
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    try:
        fifo = CommandFifo(8)
        fifo.push(Command.signal(0, 1, 6))
        w.proxy(fifo, 0, doorbell_fd=write_fd).stop()
        assert flags[1][6] == 1 and len(os.read(read_fd, 64)) >= 8
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_set_host_flags_refuses_bad_words() -> None:
    fifo = CommandFifo(8)
    drain = native.Drain(
        fifo.ring.data_ptr(), fifo.head.data_ptr(), fifo.tail.data_ptr(), 8, 8, True, 1.0
    )
    words = torch.zeros(4, dtype=torch.int32)
    drain.set_host_flags(0, words.data_ptr(), 4)
    with pytest.raises(ValueError, match="aligned to 4 bytes"):
        drain.set_host_flags(0, words.data_ptr() + 2, 3)
    with pytest.raises(ValueError, match="n >= 0"):
        drain.set_host_flags(0, words.data_ptr(), -1)
    with pytest.raises(ValueError, match="non-null"):
        drain.set_host_flags(0, 0, 4)


def test_register_flags_validates_the_tensor() -> None:
    w = World("2x1")
    for bad in (
        torch.zeros(4, dtype=torch.int64),
        torch.zeros(2, 2, dtype=torch.int32),
        torch.zeros(8, dtype=torch.int32)[::2],
        [0, 0, 0],
    ):
        with pytest.raises(ProxyError, match="1-D contiguous int32 CPU tensor"):
            w.transport.register_flags(0, bad)


# -- idle_sleep_us = 0 -------------------------------------------------------------------------
def test_idle_sleep_zero_never_sleeps_yet_reacts_and_lets_others_run() -> None:
    w, flags = flag_world()
    fifo = CommandFifo(8)
    with pytest.raises(ProxyError, match="idle_sleep_us must be an int >= 0"):
        w.proxy(fifo, 0, idle_sleep_us=-1)
    with w.proxy(fifo, 0, idle_sleep_us=0) as proxy:
        assert proxy._drain.idle_sleep_us == 0
        spins = 0
        deadline = time.perf_counter() + 0.1
        while time.perf_counter() < deadline:  # this thread still runs while the loop idles
            spins += 1
        assert spins > 1000
        fifo.push(Command.signal(0, 1, 0))
        deadline = time.monotonic() + 2
        while flags[1][0] == 0 and time.monotonic() < deadline:
            time.sleep(1e-4)
        assert flags[1][0] == 1


# -- cuda_ipc: memory symmetric memory already mapped -------------------------------------------
class NoStore:
    """A store that fails the test if touched: mapped memory exchanges no handles."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"the store was used ({name})")


class RecordingDrain:
    def __init__(self) -> None:
        self.buffers: list[tuple[int, int, int, int]] = []  # rank, place, index, rows
        self.flags: list[tuple[int, int]] = []  # rank, n
        self.host_flags: list[tuple[int, int]] = []  # rank, n: pinned host flag words
        self.local_memory: bool | None = None

    def use_cuda(self, device: int, runtime_libs: list[str], driver_libs: list[str]) -> str:
        return ""

    def add_buffer(self, rank, place, index, ptr, rows, *rest) -> None:  # noqa: ANN001
        self.buffers.append((rank, place, index, rows))

    def set_cuda_flags(self, rank: int, flags: int, n: int, shadow: int) -> None:
        self.flags.append((rank, n))

    def set_cuda_host_flags(self, rank: int, flags: int, n: int) -> None:
        self.host_flags.append((rank, n))


def cuda_ipc_on_cpu(monkeypatch):  # noqa: ANN001, ANN201
    """A CudaIpcTransport on this CPU machine: only its constructor asks for CUDA."""
    from mgraph.runtime.proxy import CudaIpcTransport

    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return CudaIpcTransport(NoStore(), {0: 0})


def test_register_mapped_validates_before_any_cuda_call(monkeypatch) -> None:
    t = cuda_ipc_on_cpu(monkeypatch)
    with pytest.raises(ProxyError, match="rank 1 buffer 0 is on cpu, not a CUDA device"):
        t.register_mapped(1, {0: torch.zeros(2, 2)}, None)
    with pytest.raises(ProxyError, match="flags are host memory that is not pinned"):
        t.register_mapped(1, {}, torch.zeros(4, dtype=torch.int32))  # host memory, pageable
    with pytest.raises(ProxyError, match="1-D contiguous int32 CPU tensor"):
        t.register_mapped(1, {}, torch.zeros(4, dtype=torch.int64))  # pinned or not: int32
    with pytest.raises(ProxyError, match="1-D contiguous int32 CUDA tensor"):
        t.register_mapped(1, {}, torch.zeros(4, dtype=torch.int64, device="meta"))
    assert t.memory == {} and t.mapped == set()


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
def test_mapped_ranks_connect_and_attach_without_the_store(monkeypatch) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    t = cuda_ipc_on_cpu(monkeypatch)
    try:  # CUDA tensors without a GPU: metadata only, which is all these paths may touch
        with FakeTensorMode():
            own = {0: torch.empty(8, 16, device="cuda:0"), 1: torch.empty(4, 16, device="cuda:0")}
            peer = {0: torch.empty(8, 16, device="cuda:0")}  # a peer's, on the local device
            own_flags = torch.empty(32, dtype=torch.int32, device="cuda:0")
            peer_flags = torch.empty(16, dtype=torch.int32, device="cuda:0")
        own[0].data_ptr()  # attach_native reads addresses (fake ones are 0)
    except Exception as exc:
        pytest.skip(f"this torch makes no fake CUDA tensors with addresses: {exc}")
    t.register_mapped(0, own, own_flags)
    t.register_mapped(5, peer, peer_flags)
    t.register_mapped(6, peer, None)  # not connected to 0: not attached
    t.connect(0, 5)  # NoStore fails the test if connect reaches for IPC handles
    assert t.mapped == {0, 5, 6} and t.connections == {frozenset((0, 5))}
    assert set(t.flags) == {0, 5} and t.shadow[5].tolist() == [0] * 16
    drain = RecordingDrain()
    t.attach_native(drain, 0, {})
    cuda = native.PLACE_CUDA
    assert sorted(drain.buffers) == [(0, cuda, 0, 8), (0, cuda, 1, 4), (5, cuda, 0, 8)]
    assert sorted(drain.flags) == [(0, 32), (5, 16)] and drain.host_flags == []
    assert drain.local_memory is True  # every tensor on cuda:0, the proxy's device

    # Rank 5's flags in pinned host memory (pinning needs CUDA: claimed here): attached as
    # host-resident flags, which the Python data path refuses to raise.
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    t.register_mapped(5, peer, torch.zeros(16, dtype=torch.int32))
    drain = RecordingDrain()
    t.attach_native(drain, 0, {})
    assert drain.flags == [(0, 32)] and drain.host_flags == [(5, 16)]
    with pytest.raises(ProxyError, match="only the native proxy raises in order"):
        t._raise_flags(5, [0])


@pytest.mark.gpu
def test_mapped_cuda_memory_end_to_end_with_merged_flag_writes() -> None:
    """One GPU: rank 0's memory and a stand-in 'peer' rank 1 (tensors on the same device),
    both register_mapped; repeated words go out as one cuStreamWriteValue32 of the total."""
    from mgraph.runtime.proxy import CudaIpcTransport

    gen = torch.Generator(device="cuda").manual_seed(0)
    src = torch.randn(ROWS, COLS, device="cuda", generator=gen)
    dst = torch.zeros(ROWS, COLS, device="cuda")
    flags = {r: torch.zeros(FLAGS, dtype=torch.int32, device="cuda") for r in (0, 1)}
    t = CudaIpcTransport(NoStore(), {0: torch.cuda.current_device()})
    t.register_mapped(0, {0: src}, flags[0])
    t.register_mapped(1, {1: dst}, flags[1])
    t.connect(0, 1)
    tiles = rows(16)
    cmds = [write(0, x, 1, x._replace(buffer=1), event=i // 4, done_event=9) for i, x in
            enumerate(tiles)] + [Command.signal(0, 1, 4)] * 4  # fmt: skip
    fifo = CommandFifo(32)
    produce(fifo, cmds)
    torch.cuda.synchronize()
    proxy = NativeProxy(fifo, t, 8, rank=0, idle_sleep_us=0)
    proxy.stop()
    torch.cuda.synchronize()
    assert torch.equal(dst, src)
    assert flags[1][:5].tolist() == [4, 4, 4, 4, 4] and flags[0][9] == 16
    s = proxy.loop_stats()
    assert (s["events"], s["raises"]) == (36, 7)  # 3 words a tile batch, 1 for the signals
    assert t.shadow[1][:5].tolist() == [4] * 5  # the host mirror matches what the GPU holds
