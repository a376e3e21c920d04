"""The command FIFO: a power-of-two ring of 16-word commands, many producers, one consumer.

Memory is three int64 torch tensors, laid out as they will be on the GPU path (DESIGN.md, "Host
FIFO"): ``ring`` (capacity x 16 words, pinned host memory mapped into the GPU), ``head`` (the
next ticket, device memory, claimed by producers with an atomic add) and ``tail`` (the next ticket
the consumer will read, host memory the GPU polls for back-pressure).

Protocol, per command:
- producer: claim ticket ``t`` (only while ``t - tail < capacity``, so a claimed slot is always
  free), write words 1..15 of slot ``t % capacity``, then publish word 0, the header
  ``(t + 1) << 8 | opcode``, LAST. On the GPU that last store is a sys-scope release; here each
  word is one aligned 8-byte store under the GIL, so the consumer never sees a header before
  its body.
- consumer: poll the header at ``tail``; a non-zero header whose sequence is ``tail + 1`` means
  the body is complete. Read it, zero the slot, then advance ``tail`` (which frees the slot).

The claim checks for space before it takes the ticket (a compare-and-swap on the GPU) rather than
taking a ticket and then waiting for its slot: a producer that times out while waiting would
otherwise leave a claimed slot nobody ever publishes, and the consumer would wait at it forever.

Words are accessed through ctypes arrays over the tensors' storage: one word costs ~0.1 us this
way instead of ~2 us for a torch scalar index, and it is how the native drain loop will see them.
"""

from __future__ import annotations

import ctypes
import threading
import time

import torch

from mgraph.errors import ProxyError

from .command import WORDS, Command, Word, decode, encode, unpack_header

__all__ = ["CommandFifo", "Backoff"]

_ZERO_SLOT = [0] * WORDS


class Backoff:
    """Polling without burning the GIL: yield a few times, then sleep in growing steps."""

    __slots__ = ("spins", "sleep", "max_sleep")

    def __init__(self, max_sleep: float = 2e-4) -> None:
        self.spins = 0
        self.sleep = 1e-5
        self.max_sleep = max_sleep

    def reset(self) -> None:
        self.spins = 0
        self.sleep = 1e-5

    def pause(self) -> None:
        if self.spins < 16:
            self.spins += 1
            time.sleep(0)  # lets the thread we wait for run
        else:
            time.sleep(self.sleep)
            self.sleep = min(self.sleep * 2, self.max_sleep)


def _words(t: torch.Tensor) -> ctypes.Array:
    assert t.dtype == torch.int64 and t.is_contiguous() and t.device.type == "cpu"
    return (ctypes.c_int64 * t.numel()).from_address(t.data_ptr())


class CommandFifo:
    """A ring of ``capacity`` commands (a power of two). ``push`` from any thread; exactly one
    consumer calls ``peek``/``release`` (or ``pop``).

    ``timeout`` bounds how long a producer waits for space before ProxyError. ``pinned``
    allocates the three tensors in page-locked host memory, which a GPU kernel can read and
    write through unified addressing (the megakernel pushes its commands itself); it needs CUDA.
    """

    def __init__(
        self, capacity: int = 1024, *, timeout: float = 10.0, pinned: bool = False
    ) -> None:
        if not isinstance(capacity, int) or capacity < 1 or capacity & (capacity - 1):
            raise ProxyError(
                f"fifo: capacity {capacity!r} is not a power of two",
                hint="slots are found with ticket & (capacity - 1): use 2**k, e.g. 1024",
            )
        if timeout <= 0:
            raise ProxyError(f"fifo: timeout must be positive, got {timeout}")
        if pinned and not torch.cuda.is_available():
            raise ProxyError(
                "fifo: pinned=True needs CUDA (page-locked memory is for a GPU to reach), but "
                "torch.cuda is not available in this process",
                hint="use pinned=False on a CPU-only machine: the proxy drains either kind",
            )
        self.capacity = capacity
        self.mask = capacity - 1
        self.timeout = timeout
        self.pinned = pinned
        self.ring = torch.zeros((capacity, WORDS), dtype=torch.int64, pin_memory=pinned)
        self.head = torch.zeros(1, dtype=torch.int64, pin_memory=pinned)
        self.tail = torch.zeros(1, dtype=torch.int64, pin_memory=pinned)
        self._ring = _words(self.ring)
        self._head = _words(self.head)
        self._tail = _words(self.tail)
        # Emulates the GPU's atomic on ``head``: one claim at a time.
        self._claim = threading.Lock()
        # There is one consumer by design; the lock turns a second one into a wait, not a race.
        self._consume = threading.Lock()

    # -- producer side ----------------------------------------------------------------------
    def push(self, cmd: Command, *, timeout: float | None = None) -> int:
        """Enqueue ``cmd``; return its ticket. Blocks while the ring is full (back-pressure)."""
        if not isinstance(cmd, Command):
            raise ProxyError(f"fifo.push: expected a Command, got {type(cmd).__name__}")
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        backoff = Backoff()
        while True:
            with self._claim:
                ticket = self._head[0]
                tail = self._tail[0]
                if ticket - tail < self.capacity:
                    self._head[0] = ticket + 1
                    break
            if time.monotonic() > deadline:
                raise ProxyError(
                    f"fifo full for {limit:.3g} s: waiting for slot {ticket & self.mask} "
                    f"(head {ticket}, tail {tail}, capacity {self.capacity}) to push {cmd}",
                    hint="the consumer is not draining: is the proxy started, or did it fail "
                    "(Proxy.check())? Otherwise raise the capacity or the timeout",
                )
            backoff.pause()
        words = encode(cmd, ticket + 1)
        base = (ticket & self.mask) * WORDS
        self._ring[base + 1 : base + WORDS] = words[1:]
        self._ring[base] = words[0]  # publish last: the release store
        return ticket

    # -- consumer side ----------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether the command at ``tail`` is published."""
        return self._ring[(self._tail[0] & self.mask) * WORDS] != 0

    def peek(self, max_count: int) -> list[tuple[int, Command]]:
        """Up to ``max_count`` consecutive published commands from ``tail``, as (ticket, command),
        without freeing their slots. Stops at the first slot not yet published."""
        with self._consume:
            tail = self._tail[0]
            out: list[tuple[int, Command]] = []
            for ticket in range(tail, tail + min(max_count, self.capacity)):
                base = (ticket & self.mask) * WORDS
                header = self._ring[base]
                if header == 0:
                    break
                seq, _ = unpack_header(header)
                if seq != ticket + 1:
                    raise ProxyError(
                        f"fifo slot {ticket & self.mask}: header holds sequence {seq}, expected "
                        f"{ticket + 1} (tail {tail}, head {self._head[0]})",
                        hint="a producer wrote a slot it had not claimed, or the ring memory "
                        "was overwritten",
                    )
                out.append((ticket, decode(self._ring[base : base + WORDS])[1]))
            return out

    def release(self, count: int) -> None:
        """Zero the ``count`` slots from ``tail`` and advance ``tail`` past them."""
        with self._consume:
            tail = self._tail[0]
            for ticket in range(tail, tail + count):
                base = (ticket & self.mask) * WORDS
                if self._ring[base + Word.HEADER] == 0:
                    raise ProxyError(
                        f"fifo.release({count}): slot {ticket & self.mask} (ticket {ticket}) "
                        "is not published",
                        hint="release only what peek() returned",
                    )
                self._ring[base : base + WORDS] = _ZERO_SLOT
            self._tail[0] = tail + count  # after the clears: a producer may reuse them now

    def pop(self, max_count: int) -> list[tuple[int, Command]]:
        """``peek`` then ``release`` what it returned."""
        got = self.peek(max_count)
        if got:
            self.release(len(got))
        return got

    # -- state ------------------------------------------------------------------------------
    @property
    def head_value(self) -> int:
        return self._head[0]

    @property
    def tail_value(self) -> int:
        return self._tail[0]

    def __len__(self) -> int:
        """Commands claimed but not yet released (published or still being written)."""
        return self._head[0] - self._tail[0]

    def __repr__(self) -> str:
        return (
            f"CommandFifo(capacity={self.capacity}, head={self.head_value}, tail={self.tail_value})"
        )
