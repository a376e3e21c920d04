"""One command FIFO split into one FIFO per source rank, for a producer that pushes for several.

A proxy of the verbs backend serves ONE rank (its NIC context, its queue pairs to that rank's
peers), so every rank needs a FIFO of its own. Under Triton's interpreter the megakernel runs
every rank in one program and pushes all of their commands into one ring; ``FifoSplitter``
moves each command, in ring order, onto the FIFO of its ``src_rank``, where that rank's native
proxy drains it. Commands of one source keep their order (one consumer, one producer per
target), which is the only order the protocol relies on: a SIGNAL follows the WRITEs of its own
rank that came before it.

It is a Python thread (the interpreted kernel is itself Python, so it sets the pace); a GPU's
process holds one rank and needs no splitter.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

from mgraph.errors import MgraphError, ProxyError

from .fifo import Backoff, CommandFifo

__all__ = ["FifoSplitter"]


class FifoSplitter:
    """Drains ``source`` onto ``targets[cmd.src_rank]``; ``on_error`` (from the thread) gets the
    ProxyError that stopped it, e.g. a command whose source rank has no FIFO here."""

    def __init__(
        self,
        source: CommandFifo,
        targets: Mapping[int, CommandFifo],
        *,
        batch: int = 8,
        timeout: float = 10.0,
        on_error: Callable[[ProxyError], None] | None = None,
    ) -> None:
        self.source = source
        self.targets = dict(targets)
        self.batch = batch
        self.timeout = timeout
        self.on_error = on_error
        self.moved = 0
        self.error: ProxyError | None = None
        self._stopping = threading.Event()
        self._abort = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mgraph-fifo-split", daemon=True)

    def start(self) -> FifoSplitter:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Move everything pushed so far, then end; raise the thread's error, if any."""
        self._stopping.set()
        self._thread.join(self.timeout + 1.0)
        if self._thread.is_alive():
            self._abort.set()
            raise ProxyError(
                f"fifo splitter: did not stop within {self.timeout:.3g} s ({self.source!r})",
                hint="a producer claimed a slot and never published it, or a rank's proxy "
                "stopped draining its FIFO",
            )
        self.check()

    def abort(self) -> None:
        """End now, leaving what is queued (a failed run's cleanup)."""
        self._abort.set()
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(self.timeout + 1.0)

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        backoff = Backoff()
        deadline: float | None = None
        try:
            while not self._abort.is_set():
                got = self.source.peek(self.batch)
                if got:
                    for ticket, cmd in got:
                        fifo = self.targets.get(cmd.src_rank)
                        if fifo is None:
                            raise ProxyError(
                                f"fifo splitter: command #{ticket} ({cmd}) comes from rank "
                                f"{cmd.src_rank}, which has no FIFO here (ranks "
                                f"{sorted(self.targets)})",
                                hint="every rank whose tasks push commands needs its own proxy",
                            )
                        # back-pressure: waits (bounded) while that rank's proxy catches up
                        fifo.push(cmd, timeout=self.timeout)
                        self.source.release(1)
                        self.moved += 1
                    backoff.reset()
                    continue
                if self._stopping.is_set():
                    if self.source.head_value == self.source.tail_value:
                        return
                    deadline = deadline or time.monotonic() + self.timeout
                    if time.monotonic() > deadline:
                        raise ProxyError(
                            f"fifo splitter: slot {self.source.tail_value & self.source.mask} "
                            f"was claimed but never published ({self.source!r})"
                        )
                backoff.pause()
        except MgraphError as exc:
            self.error = exc if isinstance(exc, ProxyError) else ProxyError(str(exc))
            if self.on_error is not None:
                self.on_error(self.error)
