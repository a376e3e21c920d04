"""The fixed-size command record a GPU pushes into the host FIFO.

One command is ``WORDS`` = 16 int64 words = 128 bytes: one GPU L2 line, so the body goes out as
one PCIe burst and a slot never straddles two lines. Layout (``Word`` names the indices):

====  ==========  ===========================================================================
word  name        meaning
====  ==========  ===========================================================================
0     HEADER      ``seq << 8 | opcode``; 0 means "slot empty". Written LAST by the producer.
1     TASK        id of the graph task that issued the command (-1: none), for error messages
2     EPOCH       launch epoch; events are raised with it (counter targets are epoch * count)
3     SRC_RANK    rank that holds the source region (the one whose GPU pushed the command)
4     SRC_BUF     index of the source buffer in that rank's registered memory
5     SRC_ROWS    ``row0 << 32 | row1`` of the source region
6     SRC_COLS    ``col0 << 32 | col1`` of the source region
7     DST_RANK    rank the data goes to (and the event is raised on)
8     DST_BUF     index of the destination buffer in that rank's registered memory
9     DST_ROWS    ``row0 << 32 | row1`` of the destination region
10    DST_COLS    ``col0 << 32 | col1`` of the destination region
11    BYTES       payload size; the proxy checks it against the regions and dtype
12    EVENT       event id on DST_RANK raised once the data is visible there (-1: none)
13    DONE_EVENT  event id on SRC_RANK raised once the write completed, i.e. the source region
                  may be reused (-1: none)
14    LANE        the proxy executes the command on copy stream ``LANE mod streams`` (0: the
                  first). Every command raising one flag word carries the same lane, so the word
                  keeps ONE writing stream and its running count never goes backwards
                  (runtime/megakernel/netplan.py assigns lanes)
15    (reserved)  zero
====  ==========  ===========================================================================

Coordinates are packed two per word (each < 2**31) so that both full regions fit in one line
next to everything else; every field is range-checked when a ``Command`` is built, so a bad
value fails in Python with the field's name instead of as a wild copy in the drain loop.
The sequence number in the header is the slot's ticket + 1: the consumer checks it, which catches
a stale or torn slot instead of executing last lap's command.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

from mgraph.errors import ProxyError

__all__ = [
    "WORDS",
    "COMMAND_BYTES",
    "MAX_COORD",
    "MAX_SEQ",
    "Word",
    "Opcode",
    "Rect",
    "Command",
    "pack_header",
    "unpack_header",
    "encode",
    "decode",
]

WORDS = 16
COMMAND_BYTES = WORDS * 8
MAX_COORD = 2**31 - 1  # ranks, buffer indices, coordinates, event ids: int32 on the GPU side
MAX_SEQ = 2**55 - 1  # seq << 8 | opcode stays a positive int64
MAX_LANE = 255  # lanes a command may name; the proxy maps them onto its (fewer) streams
MAX_WORD = 2**62  # bytes, epoch, task id: anything a positive int64 holds comfortably
_LOW32 = 0xFFFFFFFF


class Word(IntEnum):
    """Index of each field in the 16-word record (see the module docstring)."""

    HEADER = 0
    TASK = 1
    EPOCH = 2
    SRC_RANK = 3
    SRC_BUF = 4
    SRC_ROWS = 5
    SRC_COLS = 6
    DST_RANK = 7
    DST_BUF = 8
    DST_ROWS = 9
    DST_COLS = 10
    BYTES = 11
    EVENT = 12
    DONE_EVENT = 13
    LANE = 14


class Opcode(IntEnum):
    """What the proxy does with a command. 0 is reserved: a zero header means an empty slot."""

    NOP = 1  # nothing; lets a producer fill a slot it claimed but has nothing for
    WRITE = 2  # copy SRC region into DST region, then raise EVENT on DST_RANK, DONE_EVENT on SRC
    SIGNAL = 3  # raise EVENT on DST_RANK only, ordered after every earlier command
    SHUTDOWN = 4  # the producer is finished: the proxy drains what is queued and stops


class Rect(NamedTuple):
    """``buffer[row0:row1, col0:col1]`` of a registered buffer named by its index on a rank."""

    buffer: int
    row0: int
    row1: int
    col0: int
    col1: int

    @property
    def shape(self) -> tuple[int, int]:
        return (self.row1 - self.row0, self.col1 - self.col0)

    @property
    def numel(self) -> int:
        return (self.row1 - self.row0) * (self.col1 - self.col0)

    def __str__(self) -> str:
        return f"buf{self.buffer}[{self.row0}:{self.row1},{self.col0}:{self.col1}]"


_EMPTY = Rect(0, 0, 0, 0, 0)


def _check_int(name: str, value: int, lo: int, hi: int, cmd: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ProxyError(
            f"{cmd}: field {name}={value!r} is outside [{lo}, {hi}]",
            hint="ranks, buffer indices, coordinates and event ids are int32 on the GPU; "
            "-1 means 'none' for TASK, EVENT and DONE_EVENT",
        )


def _check_rect(name: str, rect: Rect, cmd: str, nonempty: bool) -> None:
    if not isinstance(rect, tuple) or len(rect) != 5:
        raise ProxyError(
            f"{cmd}: {name} must be a Rect(buffer, row0, row1, col0, col1), got {rect!r}"
        )
    for part, value in zip(Rect._fields, rect, strict=True):
        _check_int(f"{name}.{part}", value, 0, MAX_COORD, cmd)
    _, r0, r1, c0, c1 = rect
    if r0 > r1 or c0 > c1 or (nonempty and (r0 == r1 or c0 == c1)):
        raise ProxyError(
            f"{cmd}: {name} {Rect(*rect)} is {'empty or ' if nonempty else ''}inverted",
            hint="a WRITE moves a non-empty region: row0 < row1 and col0 < col1",
        )


@dataclass(frozen=True, slots=True)
class Command:
    """One decoded FIFO command. Build WRITEs and SIGNALs with the class methods."""

    opcode: Opcode
    src_rank: int = 0
    src: Rect = _EMPTY
    dst_rank: int = 0
    dst: Rect = _EMPTY
    bytes: int = 0
    event: int = -1
    done_event: int = -1
    epoch: int = 0
    task: int = -1
    lane: int = 0

    def __post_init__(self) -> None:
        try:
            op = Opcode(self.opcode)
        except ValueError:
            raise ProxyError(
                f"command: unknown opcode {self.opcode!r}",
                hint=f"use one of {', '.join(o.name for o in Opcode)}",
            ) from None
        where = f"{op.name} command (task {self.task})"
        is_write = op is Opcode.WRITE
        _check_rect("src", self.src, where, nonempty=is_write)
        _check_rect("dst", self.dst, where, nonempty=is_write)
        object.__setattr__(self, "opcode", op)
        if type(self.src) is not Rect:
            object.__setattr__(self, "src", Rect(*self.src))
        if type(self.dst) is not Rect:
            object.__setattr__(self, "dst", Rect(*self.dst))
        _check_int("task", self.task, -1, MAX_WORD, where)
        _check_int("epoch", self.epoch, 0, MAX_WORD, where)
        _check_int("src_rank", self.src_rank, 0, MAX_COORD, where)
        _check_int("dst_rank", self.dst_rank, 0, MAX_COORD, where)
        _check_int("bytes", self.bytes, 0, MAX_WORD, where)
        _check_int("event", self.event, -1, MAX_COORD, where)
        _check_int("done_event", self.done_event, -1, MAX_COORD, where)
        _check_int("lane", self.lane, 0, MAX_LANE, where)
        if is_write:
            if self.src.shape != self.dst.shape:
                raise ProxyError(
                    f"{where}: source {self.src} is {self.src.shape} but destination "
                    f"{self.dst} is {self.dst.shape}",
                    hint="a WRITE copies a region onto one of the same shape",
                )
            if self.bytes == 0:
                raise ProxyError(f"{where}: bytes=0 for a {self.src.numel}-element region")
        if op is Opcode.SIGNAL and self.event < 0:
            raise ProxyError(f"{where}: a SIGNAL needs an event id >= 0 on the destination")

    # -- constructors ----------------------------------------------------------------------
    @classmethod
    def write(
        cls,
        src_rank: int,
        src: Sequence[int],
        dst_rank: int,
        dst: Sequence[int],
        *,
        bytes: int,
        event: int = -1,
        done_event: int = -1,
        epoch: int = 0,
        task: int = -1,
        lane: int = 0,
    ) -> Command:
        return cls(Opcode.WRITE, src_rank, tuple(src), dst_rank, tuple(dst), bytes, event,
                   done_event, epoch, task, lane)  # fmt: skip

    @classmethod
    def signal(
        cls,
        src_rank: int,
        dst_rank: int,
        event: int,
        *,
        epoch: int = 0,
        task: int = -1,
        lane: int = 0,
    ) -> Command:
        return cls(
            Opcode.SIGNAL, src_rank, _EMPTY, dst_rank, _EMPTY, 0, event, -1, epoch, task, lane
        )

    @classmethod
    def nop(cls, task: int = -1) -> Command:
        return cls(Opcode.NOP, task=task)

    @classmethod
    def shutdown(cls) -> Command:
        return cls(Opcode.SHUTDOWN)

    def __str__(self) -> str:
        op = self.opcode.name
        if self.opcode is Opcode.WRITE:
            body = f"r{self.src_rank}:{self.src} -> r{self.dst_rank}:{self.dst} {self.bytes}B"
        elif self.opcode is Opcode.SIGNAL:
            body = f"r{self.src_rank} -> r{self.dst_rank}"
        else:
            body = ""
        events = f" event {self.event}" if self.event >= 0 else ""
        events += f" done {self.done_event}" if self.done_event >= 0 else ""
        lane = f" lane {self.lane}" if self.lane else ""
        return f"{op} {body}{events} epoch {self.epoch} task {self.task}{lane}".replace("  ", " ")


# -- the wire format ---------------------------------------------------------------------------
def pack_header(seq: int, opcode: Opcode) -> int:
    if not 1 <= seq <= MAX_SEQ:
        raise ProxyError(f"header: sequence number {seq} is outside [1, {MAX_SEQ}]")
    return seq << 8 | int(opcode)


def unpack_header(word: int) -> tuple[int, int]:
    """``(seq, opcode)``; (0, 0) for an empty slot."""
    return word >> 8, word & 0xFF


def _pair(hi: int, lo: int) -> int:
    return hi << 32 | lo


def _unpair(word: int) -> tuple[int, int]:
    return word >> 32, word & _LOW32


def encode(cmd: Command, seq: int) -> list[int]:
    """The 16 words of ``cmd`` as slot ``seq`` (header first, written last by the FIFO)."""
    s, d = cmd.src, cmd.dst
    return [
        pack_header(seq, cmd.opcode),
        cmd.task,
        cmd.epoch,
        cmd.src_rank,
        s.buffer,
        _pair(s.row0, s.row1),
        _pair(s.col0, s.col1),
        cmd.dst_rank,
        d.buffer,
        _pair(d.row0, d.row1),
        _pair(d.col0, d.col1),
        cmd.bytes,
        cmd.event,
        cmd.done_event,
        cmd.lane,
        0,
    ]


def decode(words: Sequence[int]) -> tuple[int, Command]:
    """``(seq, command)`` from 16 words; ProxyError for an empty slot or a bad field."""
    if len(words) != WORDS:
        raise ProxyError(f"decode: a command is {WORDS} words, got {len(words)}")
    seq, op = unpack_header(words[Word.HEADER])
    if seq == 0:
        raise ProxyError("decode: the header is empty (slot not published)")
    sr0, sr1 = _unpair(words[Word.SRC_ROWS])
    sc0, sc1 = _unpair(words[Word.SRC_COLS])
    dr0, dr1 = _unpair(words[Word.DST_ROWS])
    dc0, dc1 = _unpair(words[Word.DST_COLS])
    cmd = Command(
        op,
        words[Word.SRC_RANK],
        Rect(words[Word.SRC_BUF], sr0, sr1, sc0, sc1),
        words[Word.DST_RANK],
        Rect(words[Word.DST_BUF], dr0, dr1, dc0, dc1),
        words[Word.BYTES],
        words[Word.EVENT],
        words[Word.DONE_EVENT],
        words[Word.EPOCH],
        words[Word.TASK],
        words[Word.LANE],
    )
    return seq, cmd
