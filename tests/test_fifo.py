"""The command record and the FIFO ring: encoding, wrap-around, back-pressure, many producers."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mgraph.errors import ProxyError
from mgraph.runtime.proxy import COMMAND_BYTES, WORDS, Command, CommandFifo, Opcode, Rect, Word
from mgraph.runtime.proxy.command import MAX_COORD, MAX_SEQ, decode, encode, unpack_header

coord = st.integers(0, MAX_COORD)
ids = st.integers(-1, MAX_COORD)
big = st.integers(0, 2**62)


@st.composite
def rects(draw, rows: int | None = None, cols: int | None = None) -> Rect:
    rows = draw(st.integers(1, 1 << 20)) if rows is None else rows
    cols = draw(st.integers(1, 1 << 20)) if cols is None else cols
    r0 = draw(st.integers(0, MAX_COORD - rows))
    c0 = draw(st.integers(0, MAX_COORD - cols))
    return Rect(draw(coord), r0, r0 + rows, c0, c0 + cols)


@st.composite
def commands(draw) -> Command:
    op = draw(st.sampled_from(list(Opcode)))
    if op is Opcode.WRITE:
        src = draw(rects())
        dst = draw(rects(*src.shape))
        return Command.write(draw(coord), src, draw(coord), dst, bytes=draw(st.integers(1, 2**62)),
                             event=draw(ids), done_event=draw(ids), epoch=draw(big),
                             task=draw(st.integers(-1, 2**62)))  # fmt: skip
    if op is Opcode.SIGNAL:
        return Command.signal(draw(coord), draw(coord), draw(coord), epoch=draw(big))
    return Command.nop(task=draw(st.integers(-1, 100))) if op is Opcode.NOP else Command.shutdown()


@settings(max_examples=300, deadline=None)
@given(cmd=commands(), seq=st.integers(1, MAX_SEQ))
def test_encode_decode_round_trip(cmd: Command, seq: int) -> None:
    words = encode(cmd, seq)
    assert len(words) == WORDS and COMMAND_BYTES == 128
    assert all(-(2**63) <= w < 2**63 for w in words)  # fits the int64 ring
    assert words[Word.HEADER] > 0 and unpack_header(words[Word.HEADER]) == (seq, cmd.opcode)
    assert decode(words) == (seq, cmd)
    # through an int64 tensor, as the ring stores it
    assert decode(torch.tensor(words, dtype=torch.int64).tolist()) == (seq, cmd)


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: Command.write(-1, (0, 0, 1, 0, 1), 1, (0, 0, 1, 0, 1), bytes=4), "src_rank"),
        (
            lambda: Command.write(0, (0, 0, 2**31, 0, 1), 1, (0, 0, 2**31, 0, 1), bytes=4),
            "src.row1",
        ),
        (lambda: Command.write(0, (0, 0, 1, 0, 1), 1, (0, 0, 1, 0, 1), bytes=4, event=-2), "event"),
        (lambda: Command.write(0, (0, 0, 1, 0, 1), 1, (0, 0, 1, 0, 1), bytes=4, epoch=-1), "epoch"),
        (lambda: Command.write(0, (0, 0, 1, 0, 1), 1, (-3, 0, 1, 0, 1), bytes=4), "dst.buffer"),
        (lambda: Command.write(0, (0, 0, 1, 0, 1), 1, (0, 0, 1, 0, 1), bytes=-4), "bytes"),
        (
            lambda: Command.write(0, (0, 0, 1, 0, 1), 1, (0, 0, 1, 0, 1), bytes=4, task=2**63),
            "task",
        ),
        (lambda: Command.signal(0, 1, 2**31), "event"),
    ],
)
def test_field_out_of_range(make, field: str) -> None:
    with pytest.raises(ProxyError, match=rf"field {field}=.* is outside"):
        make()


def test_bad_commands_name_the_problem() -> None:
    with pytest.raises(ProxyError, match="is \\(2, 4\\) but destination .* is \\(4, 2\\)"):
        Command.write(0, (0, 0, 2, 0, 4), 1, (0, 0, 4, 0, 2), bytes=32)
    with pytest.raises(ProxyError, match="empty or inverted"):
        Command.write(0, (0, 3, 3, 0, 4), 1, (0, 3, 3, 0, 4), bytes=32)
    with pytest.raises(ProxyError, match="bytes=0"):
        Command.write(0, (0, 0, 2, 0, 4), 1, (0, 0, 2, 0, 4), bytes=0)
    with pytest.raises(ProxyError, match="SIGNAL needs an event"):
        Command.signal(0, 1, -1)
    with pytest.raises(ProxyError, match="unknown opcode 9"):
        Command(9)
    with pytest.raises(ProxyError, match="header is empty"):
        decode([0] * WORDS)
    with pytest.raises(ProxyError, match="not a power of two"):
        CommandFifo(12)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_pinned_fifo_needs_cuda() -> None:
    with pytest.raises(ProxyError, match=r"pinned=True needs CUDA") as info:
        CommandFifo(8, pinned=True)
    assert "pinned=False" in str(info.value.hint)
    assert CommandFifo(8, pinned=False).pinned is False  # the default path is untouched
    with pytest.raises(ProxyError, match="not a power of two"):  # checked first, as before
        CommandFifo(12, pinned=True)


@pytest.mark.gpu
def test_pinned_fifo_is_page_locked_and_works() -> None:
    fifo = CommandFifo(8, pinned=True)
    assert fifo.pinned and all(t.is_pinned() for t in (fifo.ring, fifo.head, fifo.tail))
    for i in range(20):  # wraps around: the ctypes views address the pinned storage
        fifo.push(_signal(i))
        assert fifo.pop(1) == [(i, _signal(i))]


def _signal(i: int, producer: int = 0) -> Command:
    return Command.signal(producer, 1, event=i % 1000, epoch=i, task=producer)


def test_ring_wraps_around_many_times() -> None:
    fifo = CommandFifo(8)
    pushed = got = 0
    # uneven push/pop counts so the tail visits every slot offset
    for round_ in range(400):
        for _ in range(1 + round_ % 5):  # at most 3 are left over, so 5 more always fit
            fifo.push(_signal(pushed))
            pushed += 1
        while len(fifo) > 3:
            for ticket, cmd in fifo.pop(1 + (round_ * 5) % 8):
                assert ticket == got and cmd == _signal(got)
                got += 1
    for ticket, cmd in fifo.pop(8):
        assert ticket == got and cmd == _signal(got)
        got += 1
    assert got == pushed > 100 * fifo.capacity
    assert len(fifo) == 0 and fifo.head_value == fifo.tail_value == pushed
    assert not fifo.ready() and int(fifo.ring.abs().sum()) == 0  # released slots are zeroed


def test_peek_stops_at_an_unpublished_slot() -> None:
    fifo = CommandFifo(8)
    fifo.push(_signal(0))
    fifo.head[0] += 1  # a producer claimed ticket 1 and is still writing it
    fifo.push(_signal(2))
    assert [t for t, _ in fifo.peek(8)] == [0]
    fifo.release(1)
    assert fifo.peek(8) == [] and len(fifo) == 2
    with pytest.raises(ProxyError, match="slot 1 \\(ticket 1\\) is not published"):
        fifo.release(1)


def test_stale_header_is_caught() -> None:
    fifo = CommandFifo(4)
    fifo.push(_signal(0))
    fifo.ring[0, Word.HEADER] = (5 << 8) | int(Opcode.SIGNAL)  # last lap's sequence
    with pytest.raises(ProxyError, match="sequence 5, expected 1"):
        fifo.peek(4)


def test_back_pressure_blocks_until_drained() -> None:
    fifo = CommandFifo(4, timeout=5.0)
    for i in range(4):
        fifo.push(_signal(i))
    done = threading.Event()

    def producer() -> None:
        fifo.push(_signal(4))
        done.set()

    thread = threading.Thread(target=producer)
    thread.start()
    time.sleep(0.05)
    assert not done.is_set(), "push must block while the ring is full"
    assert [t for t, _ in fifo.pop(1)] == [0]
    assert done.wait(2.0)
    thread.join()
    assert [c.epoch for _, c in fifo.pop(8)] == [1, 2, 3, 4]


def test_back_pressure_timeout_names_slot_head_tail() -> None:
    fifo = CommandFifo(2, timeout=0.05)
    fifo.push(_signal(0))
    fifo.push(_signal(1))
    start = time.monotonic()
    with pytest.raises(ProxyError, match=r"slot 0 \(head 2, tail 0, capacity 2\)") as info:
        fifo.push(_signal(2))
    assert time.monotonic() - start < 1.0
    assert "proxy" in str(info.value)  # the hint says where to look
    # nothing was claimed by the failed push: the ring is still consistent
    assert fifo.head_value == 2 and [t for t, _ in fifo.pop(4)] == [0, 1]
    fifo.push(_signal(2), timeout=0.05)


def test_many_producers_exactly_once_in_order() -> None:
    producers, per_producer = 4, 2500
    fifo = CommandFifo(64, timeout=10.0)
    received: dict[int, list[int]] = {p: [] for p in range(producers)}
    tickets: list[int] = []
    errors: list[BaseException] = []

    def produce(p: int) -> None:
        try:
            for i in range(per_producer):
                fifo.push(_signal(i, producer=p))
        except BaseException as exc:  # surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    for t in threads:
        t.start()
    total = producers * per_producer
    deadline = time.monotonic() + 15.0
    while len(tickets) < total and time.monotonic() < deadline:
        got = fifo.pop(16)
        if not got:
            time.sleep(0)
        for ticket, cmd in got:
            tickets.append(ticket)
            received[cmd.task].append(cmd.epoch)
    for t in threads:
        t.join(5.0)
    assert not errors, errors
    assert tickets == list(range(total))
    for p in range(producers):
        assert received[p] == list(range(per_producer)), f"producer {p} out of order or lost"
    assert len(fifo) == 0
