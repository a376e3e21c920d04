"""Event counters of the CPU reference runtime, shared with the native host proxy.

The counters are int64 words of one tensor (global event ids index it), so the native drain
loop raises an RDMA arrival exactly as the GPU path does: an atomic add on the event's word,
no Python involved. Waiters block on their event's rank condition; a native writer cannot
notify a Python condition, so it writes a doorbell (a pipe) once per batch that raised events,
and one waker thread turns that into ``notify_all``. Python-side adds go through the same
atomic add when a native writer exists (``atomic_add``), otherwise a plain add under the rank's
lock is enough.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import weakref
from collections.abc import Callable

import torch

from mgraph.graph import TaskGraph

__all__ = ["Counters"]

AtomicAdd = Callable[[int, int], int]  # (address, delta) -> new value


class Counters:
    """Event counters of all ranks; see the module docstring."""

    def __init__(self, graph: TaskGraph, atomic_add: AtomicAdd | None = None) -> None:
        n = len(graph.events)
        self.tensor = torch.zeros(max(n, 1), dtype=torch.int64)
        self.values = (ctypes.c_int64 * n).from_address(self.tensor.data_ptr())
        self.rank_of = [e.rank for e in graph.events]
        self.conds = [threading.Condition() for _ in graph.topology.ranks]
        self.aborted = False
        self._atomic_add = atomic_add
        self._base = self.tensor.data_ptr()
        self._doorbell: int | None = None
        self._close_doorbell: weakref.finalize | None = None

    def add(self, event: int) -> None:
        cond = self.conds[self.rank_of[event]]
        with cond:
            if self._atomic_add is not None:
                self._atomic_add(self._base + 8 * event, 1)
            else:
                self.values[event] += 1
            cond.notify_all()

    def wait(self, event: int, target: int, timeout: float) -> bool:
        """True once the counter reaches ``target``; False on timeout or abort."""
        cond = self.conds[self.rank_of[event]]
        deadline = time.monotonic() + timeout
        with cond:
            while self.values[event] < target and not self.aborted:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                cond.wait(left)
            return self.values[event] >= target

    def abort(self) -> None:
        self.aborted = True
        self.wake_all()

    def wake_all(self) -> None:
        for cond in self.conds:
            with cond:
                cond.notify_all()

    # -- native writers ---------------------------------------------------------------------
    def doorbell(self) -> int:
        """The fd a native writer writes after raising events (starts the waker once)."""
        if self._doorbell is None:
            read, write = os.pipe()
            os.set_blocking(write, False)  # a full pipe already means "wake up"
            self._doorbell = write
            # The waker holds only a weak reference, and collecting the counters closes the
            # pipe, so a runtime nobody closed does not leak a thread.
            self._close_doorbell = weakref.finalize(self, os.close, write)
            threading.Thread(
                target=_wake, args=(read, weakref.ref(self)), name="mgraph-doorbell", daemon=True
            ).start()
        return self._doorbell

    def close(self) -> None:
        """Stop the waker (after every native writer stopped)."""
        if self._doorbell is not None:
            self._close_doorbell()  # the waker reads end-of-file and exits
            self._doorbell = None

    @property
    def address(self) -> int:
        return self._base


def _wake(fd: int, counters: weakref.ref[Counters]) -> None:
    try:
        while os.read(fd, 4096):
            alive = counters()
            if alive is None:
                break
            alive.wake_all()
            del alive
    finally:
        os.close(fd)
