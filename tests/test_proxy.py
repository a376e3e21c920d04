"""The in-process transport and the drain proxy: data, events, batching, coalescing, errors."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch

from mgraph.errors import ProxyError
from mgraph.runtime.proxy import Command, CommandFifo, InProcessTransport, Proxy, Rect
from mgraph.topology import Topology

ROWS, COLS = 32, 64


class World:
    """Ranks with random 2-D buffers on one InProcessTransport; records every raised event.

    Each event id expects a (rank, Rect, data) that must already be in place when it is raised:
    that is how the tests check "data visible before the event".
    """

    def __init__(self, topology: str = "2x2", buffers: int = 2, seed: int = 0) -> None:
        self.topology = Topology.parse(topology)
        gen = torch.Generator().manual_seed(seed)
        self.mem = {
            r: {b: torch.randn(ROWS, COLS, generator=gen) for b in range(buffers)}
            for r in self.topology.ranks
        }
        self.raised: list[tuple[int, int, int]] = []
        self.expect: dict[tuple[int, int], tuple[Rect, torch.Tensor]] = {}
        self.transport = InProcessTransport(self.raise_event, self.topology)
        for rank, bufs in self.mem.items():
            self.transport.register(rank, bufs)
        for a in self.topology.ranks:
            for b in self.topology.ranks:
                if a < b:
                    self.transport.connect(a, b)

    def raise_event(self, rank: int, event: int, epoch: int) -> None:
        want = self.expect.get((rank, event))
        if want is not None:
            rect, data = want
            got = self.mem[rank][rect.buffer][rect.row0 : rect.row1, rect.col0 : rect.col1]
            assert torch.equal(got, data), f"event {event} on rank {rank} raised before its data"
        self.raised.append((rank, event, epoch))

    def write(self, src_rank: int, src: Rect, dst_rank: int, dst: Rect, event: int = -1,
              **kw: int) -> Command:  # fmt: skip
        data = self.mem[src_rank][src.buffer][src.row0 : src.row1, src.col0 : src.col1].clone()
        if event >= 0:
            self.expect[(dst_rank, event)] = (dst, data)
        return Command.write(src_rank, src, dst_rank, dst, bytes=data.numel() * 4, event=event,
                             **kw)  # fmt: skip

    def region(self, rank: int, rect: Rect) -> torch.Tensor:
        return self.mem[rank][rect.buffer][rect.row0 : rect.row1, rect.col0 : rect.col1]


def row_tiles(n: int, rows: int = 2, buffer: int = 0) -> list[Rect]:
    return [Rect(buffer, i * rows, (i + 1) * rows, 0, COLS) for i in range(n)]


# -- transport ---------------------------------------------------------------------------------
def test_transport_copies_raises_and_counts_bytes() -> None:
    w = World("2x2")
    t = w.transport
    src = w.region(0, Rect(0, 0, 4, 0, 8)).clone()
    t.write(0, w.region(0, Rect(0, 0, 4, 0, 8)), 2, Rect(1, 8, 12, 16, 24), events=[5, 6], epoch=3)
    t.write(0, w.region(0, Rect(0, 0, 2, 0, 8)), 1, Rect(0, 0, 2, 0, 8))
    t.signal(3, 1, event=9, epoch=3)
    assert torch.equal(w.region(2, Rect(1, 8, 12, 16, 24)), src)
    assert w.raised == [(2, 5, 3), (2, 6, 3), (1, 9, 3)]
    assert t.bytes_by_ranks == Counter({(0, 2): 128, (0, 1): 64})
    assert t.bytes_by_nodes == Counter({(0, 1): 128, (0, 0): 64})
    assert t.bytes_total == 192 and t.writes == 2 and t.signals == 1
    assert t.poll(3) == [2] and sorted(t.poll()) == [0, 1] and t.poll() == []


def test_transport_errors_are_named() -> None:
    w = World("1x2")
    t = w.transport
    view = w.region(0, Rect(0, 0, 2, 0, 2))
    with pytest.raises(ProxyError, match="rank 5 has no registered memory"):
        t.view(5, Rect(0, 0, 1, 0, 1))
    with pytest.raises(ProxyError, match="rank 1 has no buffer 7"):
        t.write(0, view, 1, Rect(7, 0, 2, 0, 2))
    with pytest.raises(ProxyError, match=r"outside rank 1 buffer 0 of shape \(32, 64\)"):
        t.write(0, view, 1, Rect(0, 31, 33, 0, 2))
    with pytest.raises(ProxyError, match=r"write of \(2, 2\) torch.float32 .* \(2, 3\)"):
        t.write(0, view, 1, Rect(0, 0, 2, 0, 3))
    with pytest.raises(ProxyError, match="not a 2-D tensor"):
        t.register(1, {0: torch.ones(3)})
    lone = InProcessTransport(w.raise_event)
    lone.register(0, w.mem[0])
    lone.register(4, w.mem[1])
    with pytest.raises(ProxyError, match="not connected") as info:
        lone.write(0, view, 4, Rect(0, 0, 2, 0, 2))
    assert "connect(0, 4)" in str(info.value)
    with pytest.raises(ProxyError, match=r"rank\(s\) \[9\] registered no memory"):
        lone.connect(0, 9)
    t.close()
    with pytest.raises(ProxyError, match="after close"):
        t.signal(0, 1, 0)


# -- proxy: data and events --------------------------------------------------------------------
def test_proxy_moves_scattered_tiles_and_raises_every_event() -> None:
    w = World("2x2", seed=1)
    fifo = CommandFifo(16)
    gen = torch.Generator().manual_seed(2)
    tiles = [Rect(0, r, r + 4, c, c + 8) for r in range(0, ROWS, 4) for c in range(0, COLS, 8)]
    order = torch.randperm(len(tiles), generator=gen).tolist()
    with Proxy(fifo, w.transport, batch=8):
        for event, i in enumerate(order):  # random order: nothing is adjacent to its neighbour
            fifo.push(w.write(1, tiles[i], 3, tiles[i]._replace(buffer=1), event, epoch=2, task=i))
    assert torch.equal(w.mem[3][1], w.mem[1][0])
    assert sorted(w.raised) == [(3, e, 2) for e in range(len(tiles))]
    assert w.transport.bytes_by_nodes == Counter({(0, 1): ROWS * COLS * 4})


def test_done_events_raise_on_the_source_after_the_write() -> None:
    w = World("2x1")
    fifo = CommandFifo(8)
    proxy = Proxy(fifo, w.transport)
    for i, tile in enumerate(row_tiles(3, rows=4)):
        fifo.push(w.write(0, tile, 1, tile, event=10 + i, done_event=20 + i, epoch=1))
    proxy.stop()  # never started: drains on this thread
    assert sorted(w.raised) == [(0, 20, 1), (0, 21, 1), (0, 22, 1), (1, 10, 1), (1, 11, 1),
                                (1, 12, 1)]  # fmt: skip
    assert w.raised.index((0, 22, 1)) > w.raised.index((1, 12, 1))
    assert proxy.stats.writes == 1 and proxy.stats.coalesced == 2 and proxy.stats.signals == 3


# -- proxy: batching and coalescing ------------------------------------------------------------
def test_batches_hold_at_most_batch_commands_and_coalesce() -> None:
    w = World("2x1")
    fifo = CommandFifo(64)
    tiles = row_tiles(16)
    for i, tile in enumerate(tiles):
        fifo.push(w.write(0, tile, 1, tile, event=i))
    proxy = Proxy(fifo, w.transport, batch=8)
    proxy.stop()
    s = proxy.stats
    assert (s.commands, s.batches, s.max_batch) == (16, 2, 8)
    assert (s.writes, s.coalesced, s.bytes) == (2, 14, ROWS * COLS * 4)
    assert w.transport.writes == 2
    assert torch.equal(w.mem[1][0], w.mem[0][0])
    assert sorted(e for _, e, _ in w.raised) == list(range(16))


def _cols(r0: int, r1: int, c0: int, c1: int, buffer: int = 0) -> Rect:
    return Rect(buffer, r0, r1, c0, c1)


@pytest.mark.parametrize(
    "pairs, writes",
    [
        # adjacent columns of the same rows, source and destination alike: one write
        ([(_cols(0, 4, c, c + 8), _cols(8, 12, c + 16, c + 24)) for c in range(0, 32, 8)], 1),
        # a 2x2 grid in row-major order: each tile row merges, the rows do not
        (
            [
                (_cols(r, r + 4, c, c + 8), _cols(r, r + 4, c, c + 8))
                for r in (0, 4)
                for c in (0, 8)
            ],
            2,
        ),
        # source rows adjacent but destinations side by side: no merge
        ([(_cols(0, 4, 0, 8), _cols(0, 4, 0, 8)), (_cols(4, 8, 0, 8), _cols(0, 4, 8, 16))], 2),
        # destinations adjacent but in different buffers: no merge
        ([(_cols(0, 4, 0, 8), _cols(0, 4, 0, 8)), (_cols(4, 8, 0, 8), _cols(4, 8, 0, 8, 1))], 2),
        # pushed out of order: only ring neighbours merge
        ([(_cols(4, 8, 0, 8), _cols(4, 8, 0, 8)), (_cols(0, 4, 0, 8), _cols(0, 4, 0, 8))], 2),
    ],
)
def test_coalescing_rules(pairs: list[tuple[Rect, Rect]], writes: int) -> None:
    w = World("2x1")
    fifo = CommandFifo(16)
    for i, (src, dst) in enumerate(pairs):
        fifo.push(w.write(0, src, 1, dst, event=i))
    proxy = Proxy(fifo, w.transport)
    proxy.stop()
    assert proxy.stats.writes == w.transport.writes == writes
    assert proxy.stats.coalesced == len(pairs) - writes
    for src, dst in pairs:
        assert torch.equal(w.region(1, dst), w.region(0, src))
    assert sorted(e for _, e, _ in w.raised) == list(range(len(pairs)))


def test_signals_epochs_and_switch_keep_order() -> None:
    w = World("2x1")
    fifo = CommandFifo(16)
    a, b, c, d = row_tiles(4)
    fifo.push(w.write(0, a, 1, a, event=0, epoch=1))
    fifo.push(Command.signal(0, 1, event=1, epoch=1))  # must follow a's data, precede b's
    fifo.push(w.write(0, b, 1, b, event=2, epoch=1))
    fifo.push(w.write(0, c, 1, c, event=3, epoch=2))  # another epoch: its own write
    fifo.push(w.write(0, d, 1, d, event=4, epoch=2))
    plain = Proxy(fifo, w.transport)
    plain.stop()
    assert plain.stats.writes == 3 and plain.stats.signals == 1
    assert w.raised == [(1, 0, 1), (1, 1, 1), (1, 2, 1), (1, 3, 2), (1, 4, 2)]

    fifo.push(w.write(0, a, 1, a, event=5))
    fifo.push(w.write(0, b, 1, b, event=6))
    single = Proxy(fifo, w.transport, coalesce=False)
    single.stop()
    assert single.stats.writes == 2 and single.stats.coalesced == 0


# -- proxy: many producers, stop, shutdown -----------------------------------------------------
def test_many_producers_through_a_small_ring() -> None:
    w = World("2x2", buffers=4, seed=3)
    fifo = CommandFifo(32)
    producers, per = 4, 512  # 4 x 512 one-element tiles of one 32 x 64 buffer each
    with Proxy(fifo, w.transport, batch=8) as proxy:

        def produce(p: int) -> None:
            for i in range(per):
                tile = Rect(p, i // COLS * 4 + (i % 4), i // COLS * 4 + (i % 4) + 1,
                            i % COLS, i % COLS + 1)  # fmt: skip
                fifo.push(w.write(0, tile, 2, tile, event=p * per + i, task=p))

        threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert proxy.stats.commands == producers * per and proxy.stats.max_batch <= 8
    assert sorted(e for _, e, _ in w.raised) == list(range(producers * per))
    for p in range(producers):
        touched = torch.zeros(ROWS, COLS, dtype=torch.bool)
        for i in range(per):
            touched[i // COLS * 4 + (i % 4), i % COLS] = True
        assert torch.equal(w.mem[2][p][touched], w.mem[0][p][touched])
    assert w.transport.bytes_by_ranks == Counter({(0, 2): producers * per * 4})


def test_two_proxies_share_one_transport() -> None:
    w = World("2x1")
    fifos = [CommandFifo(8), CommandFifo(8)]
    proxies = [Proxy(f, w.transport, name=f"rank{r}").start() for r, f in enumerate(fifos)]
    tiles = row_tiles(8, rows=4)
    for i, tile in enumerate(tiles):
        src_rank = i % 2
        fifos[src_rank].push(
            w.write(
                src_rank, tile, 1 - src_rank, tile._replace(buffer=1), event=i, done_event=100 + i
            )  # fmt: skip
        )
    for p in proxies:
        p.stop()
    done = sorted((r, e) for r, e, _ in w.raised if e >= 100)
    assert done == sorted((i % 2, 100 + i) for i in range(8))  # on its own source, once each


def test_stop_drains_what_is_queued() -> None:
    w = World("2x1")
    fifo = CommandFifo(256)
    proxy = Proxy(fifo, w.transport, batch=4).start()
    tiles = [Rect(0, r, r + 1, c, c + 4) for r in range(ROWS) for c in range(0, COLS, 8)]
    for i, tile in enumerate(tiles):
        fifo.push(w.write(0, tile, 1, tile, event=i))
    proxy.stop()
    assert not proxy.running and len(fifo) == 0
    assert proxy.stats.commands == len(tiles) and len(w.raised) == len(tiles)


def test_shutdown_command_ends_the_thread() -> None:
    w = World("2x1")
    fifo = CommandFifo(16)
    proxy = Proxy(fifo, w.transport).start()
    for i, tile in enumerate(row_tiles(4)):
        fifo.push(w.write(0, tile, 1, tile, event=i))
    fifo.push(Command.nop())
    fifo.push(Command.shutdown())
    proxy._thread.join(5.0)
    assert not proxy.running and proxy.stats.commands == 6 and len(w.raised) == 4
    proxy.stop()


def test_stop_times_out_on_a_claimed_but_unpublished_slot() -> None:
    w = World("2x1")
    fifo = CommandFifo(8)
    proxy = Proxy(fifo, w.transport).start()
    fifo.head[0] += 1  # a producer claimed a slot and died
    with pytest.raises(ProxyError, match="slot 0 was claimed but never published"):
        proxy.stop(timeout=0.1)


# -- proxy: errors -----------------------------------------------------------------------------
def test_error_names_the_command_and_stops_at_it() -> None:
    w = World("2x1")
    fifo = CommandFifo(16)
    a, b, c, d = row_tiles(4)
    fifo.push(w.write(0, a, 1, a, event=0))
    fifo.push(w.write(0, b, 1, b, event=1))  # sent before the bad one fails
    fifo.push(w.write(0, c, 1, Rect(9, 0, 2, 0, COLS), event=2, task=42))  # no buffer 9
    fifo.push(w.write(0, d, 1, d, event=3))
    proxy = Proxy(fifo, w.transport).start()
    with pytest.raises(
        ProxyError, match=r"command #2 \(WRITE .*task 42\) failed: .*no buffer 9"
    ) as info:
        proxy.stop()
    assert info.value.ticket == 2 and info.value.command.task == 42
    assert info.value.hint and "registered buffer indices" in info.value.hint
    with pytest.raises(ProxyError, match="command #2"):
        proxy.check()  # stays raised
    assert [e for _, e, _ in w.raised] == [0, 1]
    assert torch.equal(w.region(1, b), w.region(0, b))
    assert fifo.tail_value == 2 and [t for t, _ in fifo.peek(8)] == [2, 3]


def test_bytes_mismatch_and_callback_errors_are_wrapped() -> None:
    w = World("2x1")
    fifo = CommandFifo(8)
    (a,) = row_tiles(1)
    fifo.push(Command.write(0, a, 1, a, bytes=3, task=7))
    with pytest.raises(ProxyError, match=r"command #0 .*bytes=3 but the \(2, 64\)"):
        Proxy(fifo, w.transport).stop()

    def broken(rank: int, event: int, epoch: int) -> None:
        raise KeyError(f"event {event} unknown on rank {rank}")

    t = InProcessTransport(broken)
    t.register(0, w.mem[0])
    t.register(1, w.mem[1])
    t.connect(0, 1)
    fifo = CommandFifo(8)
    fifo.push(Command.signal(0, 1, event=5, task=11))
    with pytest.raises(ProxyError, match=r"command #0 \(SIGNAL .*task 11\) failed: KeyError"):
        Proxy(fifo, t).stop()


# -- int32 flag words --------------------------------------------------------------------------
def test_registered_int32_flags_replace_the_callback() -> None:
    w = World("2x1")
    flags = torch.zeros(8, dtype=torch.int32)
    w.transport.register_flags(1, flags)  # rank 1 only: rank 0 keeps the callback
    a, b, c = row_tiles(3)
    fifo = CommandFifo(16)
    fifo.push(w.write(0, a, 1, a, event=2, done_event=5))  # done event on rank 0: the callback
    fifo.push(w.write(0, c, 1, c, event=2))  # not adjacent to a: its own write
    fifo.push(Command.signal(0, 1, event=7))
    fifo.push(w.write(1, b, 0, b, event=3, done_event=2))  # done event on rank 1: a flag
    Proxy(fifo, w.transport).stop()
    assert flags.tolist() == [0, 0, 3, 0, 0, 0, 0, 1]
    assert sorted(w.raised) == [(0, 3, 0), (0, 5, 0)]
    assert torch.equal(w.region(1, a), w.region(0, a))
    with pytest.raises(ProxyError, match="event 8 is outside rank 1's 8 flag words"):
        w.transport.signal(0, 1, event=8)
    with pytest.raises(ProxyError, match="1-D contiguous int32 CPU tensor, got torch.int64"):
        w.transport.register_flags(0, torch.zeros(8, dtype=torch.int64))
