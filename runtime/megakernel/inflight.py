"""Calls that return before their kernel ends: what each one leaves to check, and when.

A Program call on one GPU does not wait for its kernel (runtime.run with ``wait=False``): a
training or serving loop issues the next call, or the next layer, while this one runs, as eager
torch does. A wait per call left the GPU idle for the host's work between two calls: on one
H200 the Llama layer's Program call ran 0.35 ms behind its own kernel back to back, and level
with it once calls stopped waiting (benchmarks/NOTES.md v17, calls 2-4).

What the wait was for, the kernel's watchdog record, still reaches the host: each call queues
the record's copy into pinned host memory and a CUDA event behind its kernel, and the record is
read once that event has passed, at the start of a later call (only calls already finished:
no wait) or at ``synchronize()`` (every call, waiting). A timeout is raised there with the
words it always has (the task, the event, the rank). The outputs of a call whose kernel timed
out, and of every call launched after it before the host heard, are NaN: the runtime masks them
on the GPU with the record itself (runtime._whole_outputs), so no stale or partial output is
returned silently. At most ``limit`` calls are in flight; the next waits for the oldest, so a
loop that never synchronises hears of a timeout within ``limit`` calls.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["InFlight", "Slot"]


class Slot:
    """One call's CUDA event and the pinned host copy of its watchdog record (reused)."""

    __slots__ = ("event", "record")

    def __init__(self, event: Any, record: torch.Tensor) -> None:
        self.event, self.record = event, record


class InFlight:
    """The calls launched without a wait, oldest first. ``new_slot(like)`` makes a slot for a
    record shaped as ``like`` (on a GPU: a CUDA event and pinned memory; tests pass fakes)."""

    def __init__(self, new_slot: Callable[[torch.Tensor], Slot], limit: int = 4) -> None:
        if limit < 1:
            raise ValueError(f"limit {limit} must be at least 1")
        self.limit = limit
        self.calls: deque[Slot] = deque()
        self._free: list[Slot] = []
        self._new_slot = new_slot

    def queue(self, err: torch.Tensor) -> Slot:
        """Queue (on the current stream, behind the kernel) the copy of the device record
        ``err`` and an event after it; the caller then passes the slot to ``add``."""
        slot = self._free.pop() if self._free else self._new_slot(err)
        slot.record.copy_(err, non_blocking=True)
        slot.event.record()
        return slot

    def add(self, slot: Slot, check: Callable[[torch.Tensor], None]) -> None:
        """``slot``'s call is in flight; past ``limit`` calls, wait for the oldest and check it
        (``check(record)`` raises the timeout a record holds)."""
        self.calls.append(slot)
        while len(self.calls) > self.limit:
            self._pop(check, wait=True)

    def poll(self, check: Callable[[torch.Tensor], None], wait: bool = False) -> None:
        """Check every call that has finished, oldest first (``wait``: every call, waiting
        for each). The first timeout found is raised; the calls after it are dropped (the
        runtime is failed from then on, and their outputs are NaN)."""
        while self.calls and (wait or self.calls[0].event.query()):
            self._pop(check, wait)

    def _pop(self, check: Callable[[torch.Tensor], None], wait: bool) -> None:
        slot = self.calls.popleft()
        if wait:
            slot.event.synchronize()
        try:
            check(slot.record)
        except BaseException:
            self.calls.clear()
            raise
        self._free.append(slot)


def cuda_slot(like: torch.Tensor) -> Slot:
    """A slot on the current CUDA device: an event (no timing) and pinned memory."""
    record = torch.empty(like.shape, dtype=like.dtype, pin_memory=True)
    return Slot(torch.cuda.Event(), record)
