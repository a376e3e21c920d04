"""The host proxy: a thread that drains a CommandFifo into a Transport.

Each round takes up to ``batch`` published commands from the ring, executes them in ring order
and only then advances the tail (so a command that fails stays at the tail for inspection).
Consecutive WRITEs of one batch that go from one buffer to one buffer, with the same epoch, and
whose source regions AND destination regions are adjacent the same way (next rows of the same
columns, or next columns of the same rows) become one transport write: fewer, larger transfers
is what a NIC wants. Every command's event is still raised, after the merged data is visible.
Only neighbours in ring order merge, so writes and signals reach each peer in the order pushed.

DONE_EVENTs (the source may be reused) are raised on the source rank when the transport reports
the write complete. An exception in the thread stops it; ``check()`` and ``stop()`` re-raise it as
a ProxyError naming the command (``.ticket`` and ``.command`` hold it).

This Python loop is the CPU oracle and the control path; the GPU path's drain loop is native
(DESIGN.md: a Python loop is far below the command rate a 50 GB/s link needs).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mgraph.errors import ProxyError

from .command import Command, Opcode, Rect
from .fifo import Backoff, CommandFifo
from .transport import Transport

__all__ = ["Proxy", "ProxyStats"]


@dataclass
class ProxyStats:
    """Counters of one proxy. ``coalesced`` counts WRITE commands that rode on a neighbour's
    transport write, so WRITE commands = ``writes + coalesced``."""

    commands: int = 0
    batches: int = 0
    max_batch: int = 0
    writes: int = 0
    coalesced: int = 0
    signals: int = 0
    bytes: int = 0


@dataclass
class _Group:
    """Consecutive mergeable WRITEs: one transport write."""

    first: int  # ticket of the first command
    cmd: Command
    src: Rect
    dst: Rect
    events: list[int] = field(default_factory=list)
    done_events: list[int] = field(default_factory=list)
    count: int = 1


def _direction(a: Rect, b: Rect) -> str | None:
    """How ``b`` continues ``a`` into one rectangle: "rows", "cols", or None."""
    if a.buffer != b.buffer:
        return None
    if a.col0 == b.col0 and a.col1 == b.col1 and a.row1 == b.row0:
        return "rows"
    if a.row0 == b.row0 and a.row1 == b.row1 and a.col1 == b.col0:
        return "cols"
    return None


def _join(a: Rect, b: Rect) -> Rect:
    return Rect(a.buffer, min(a.row0, b.row0), max(a.row1, b.row1),
                min(a.col0, b.col0), max(a.col1, b.col1))  # fmt: skip


class _CommandFailed(Exception):
    def __init__(self, ticket: int, cmd: Command, extra: int, cause: BaseException) -> None:
        self.ticket, self.cmd, self.extra, self.cause = ticket, cmd, extra, cause


class Proxy:
    """Drains ``fifo`` into ``transport`` on a thread: ``start()``, then ``stop()``.

    ``batch`` bounds the commands taken per round; ``timeout`` bounds ``stop()``'s drain and join
    and the wait for outstanding completions. ``coalesce=False`` sends every WRITE on its own.
    ``on_error`` is called from the drain thread with the error that stopped it.
    """

    def __init__(
        self,
        fifo: CommandFifo,
        transport: Transport,
        batch: int = 8,
        *,
        name: str = "proxy",
        timeout: float = 10.0,
        coalesce: bool = True,
        on_error: Callable[[ProxyError], None] | None = None,
    ) -> None:
        if not isinstance(batch, int) or batch < 1:
            raise ProxyError(f"proxy {name}: batch must be a positive int, got {batch!r}")
        self.fifo = fifo
        self.transport = transport
        self.batch = batch
        self.name = name
        self.timeout = timeout
        self.coalesce = coalesce
        self.on_error = on_error
        self.stats = ProxyStats()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._deadline = float("inf")
        self._error: ProxyError | None = None
        # src rank -> work id -> done events to raise when the transport completes it
        self._inflight: dict[int, dict[int, tuple[list[int], int]]] = {}

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> Proxy:
        if self._thread is not None:
            raise ProxyError(f"proxy {self.name}: already started", hint="create one per run")
        self._thread = threading.Thread(target=self._run, name=f"mgraph-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Execute every command still queued, stop the thread, raise the thread's error."""
        limit = self.timeout if timeout is None else timeout
        self._deadline = time.monotonic() + limit
        self._stopping.set()
        if self._thread is None:
            self._run()  # never started: drain on the caller's thread
        else:
            self._thread.join(limit + 1.0)
            if self._thread.is_alive():
                raise ProxyError(
                    f"proxy {self.name}: did not stop within {limit:.3g} s "
                    f"({self.fifo!r}, {self.stats.commands} commands done)",
                    hint="a producer claimed a slot and never published it, or the transport hangs",
                )
        self.check()

    def check(self) -> None:
        """Raise the drain thread's error, if it had one."""
        if self._error is not None:
            raise self._error

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.stop()
        else:  # keep the caller's exception; still end the thread
            self._stopping.set()
            self._deadline = time.monotonic() + self.timeout

    def _run(self) -> None:
        backoff = Backoff()
        try:
            while True:
                if self.drain_once():
                    backoff.reset()
                    continue
                if self._stopping.is_set():
                    if len(self.fifo) == 0:
                        break
                    if time.monotonic() > self._deadline:
                        raise ProxyError(
                            f"proxy {self.name}: slot {self.fifo.tail_value & self.fifo.mask} "
                            f"was claimed but never published ({self.fifo!r})",
                            hint="every claimed slot must be published, with a NOP if need be",
                        )
                backoff.pause()
            self._wait_inflight()
        except ProxyError as exc:
            self._error = exc
        except Exception as exc:  # e.g. the runtime's raise_event failing on a done event
            err = ProxyError(f"proxy {self.name}: drain loop failed: {type(exc).__name__}: {exc}")
            err.__cause__ = exc
            self._error = err
        if self._error is not None and self.on_error is not None:
            self.on_error(self._error)  # at once: the runtime's waiters need not run into a watchdog

    # -- one round --------------------------------------------------------------------------
    def drain_once(self) -> int:
        """Execute up to ``batch`` ready commands; return how many. Raises on failure."""
        if self._error is not None:
            return 0
        ready = self.fifo.peek(self.batch)
        self._complete()
        if not ready:
            return 0
        self.stats.batches += 1
        self.stats.max_batch = max(self.stats.max_batch, len(ready))
        done = 0
        try:
            done = self._execute(ready)
        except _CommandFailed as failed:
            done = failed.ticket - ready[0][0]
            self.fifo.release(done)  # the failing command stays at the tail
            self.stats.commands += done
            self._error = self._wrap(failed)
            raise self._error from failed.cause
        self.fifo.release(done)
        self.stats.commands += done
        self._complete()
        return done

    def _execute(self, ready: list[tuple[int, Command]]) -> int:
        group: _Group | None = None
        for ticket, cmd in ready:
            op = cmd.opcode
            try:
                if op is Opcode.WRITE:
                    self._check_write(cmd)
            except Exception as exc:
                if group is not None:  # the commands before the bad one still go out
                    self._send(group)
                raise _CommandFailed(ticket, cmd, 0, exc) from exc
            if op is Opcode.WRITE and group is not None and self._extends(group, cmd):
                continue
            if group is not None:
                self._send(group)
                group = None
            if op is Opcode.WRITE:
                group = _Group(ticket, cmd, cmd.src, cmd.dst)
                self._add(group, cmd)
            elif op is Opcode.SIGNAL:
                try:
                    self.transport.signal(cmd.src_rank, cmd.dst_rank, cmd.event, cmd.epoch)
                except Exception as exc:
                    raise _CommandFailed(ticket, cmd, 0, exc) from exc
                self.stats.signals += 1
            elif op is Opcode.SHUTDOWN:
                self._deadline = time.monotonic() + self.timeout
                self._stopping.set()
        if group is not None:
            self._send(group)
        return len(ready)

    def _check_write(self, cmd: Command) -> None:
        src_dtype = self.transport.check_region(cmd.src_rank, cmd.src)
        dst_dtype = self.transport.check_region(cmd.dst_rank, cmd.dst)
        if src_dtype != dst_dtype:
            raise ProxyError(f"source is {src_dtype} but destination is {dst_dtype}")
        nbytes = cmd.src.numel * src_dtype.itemsize
        if nbytes != cmd.bytes:
            raise ProxyError(
                f"bytes={cmd.bytes} but the {cmd.src.shape} {src_dtype} region holds {nbytes}",
                hint="the command's BYTES word must equal rows * cols * itemsize",
            )

    def _extends(self, group: _Group, cmd: Command) -> bool:
        """Merge ``cmd`` into ``group`` when both rectangles continue the same way."""
        first = group.cmd
        if not (
            self.coalesce
            and cmd.src_rank == first.src_rank
            and cmd.dst_rank == first.dst_rank
            and cmd.epoch == first.epoch
        ):
            return False
        way = _direction(group.src, cmd.src)
        if way is None or way != _direction(group.dst, cmd.dst):
            return False
        group.src = _join(group.src, cmd.src)
        group.dst = _join(group.dst, cmd.dst)
        group.count += 1
        self._add(group, cmd)
        return True

    @staticmethod
    def _add(group: _Group, cmd: Command) -> None:
        if cmd.event >= 0:
            group.events.append(cmd.event)
        if cmd.done_event >= 0:
            group.done_events.append(cmd.done_event)

    def _send(self, group: _Group) -> None:
        cmd = group.cmd
        try:
            view = self.transport.view(cmd.src_rank, group.src)
            work = self.transport.write(
                cmd.src_rank, view, cmd.dst_rank, group.dst, group.events, cmd.epoch
            )
        except Exception as exc:
            raise _CommandFailed(group.first, cmd, group.count - 1, exc) from exc
        self._inflight.setdefault(cmd.src_rank, {})[work] = (group.done_events, cmd.epoch)
        self.stats.writes += 1
        self.stats.coalesced += group.count - 1
        self.stats.bytes += view.numel() * view.element_size()

    # -- completions ------------------------------------------------------------------------
    def _complete(self) -> int:
        """Raise the done events of every write the transport reports complete."""
        finished = 0
        for rank, works in self._inflight.items():
            if not works:
                continue
            for work in self.transport.poll(rank):
                entry = works.pop(work, None)
                if entry is None:
                    continue
                finished += 1
                done_events, epoch = entry
                for event in done_events:
                    self.transport.signal(rank, rank, event, epoch)
                    self.stats.signals += 1
        return finished

    def _wait_inflight(self) -> None:
        backoff = Backoff()
        while any(self._inflight.values()):
            self._complete()
            if time.monotonic() > self._deadline:
                left = {r: sorted(w) for r, w in self._inflight.items() if w}
                raise ProxyError(
                    f"proxy {self.name}: writes {left} (by source rank) never completed",
                    hint=f"the {self.transport.name} transport lost a completion",
                )
            backoff.pause()

    def _wrap(self, failed: _CommandFailed) -> ProxyError:
        more = f" (coalesced with {failed.extra} more)" if failed.extra else ""
        cause = failed.cause
        text = (
            cause.message if isinstance(cause, ProxyError) else f"{type(cause).__name__}: {cause}"
        )
        hint = cause.hint if isinstance(cause, ProxyError) else None
        err = ProxyError(
            f"proxy {self.name}: command #{failed.ticket} ({failed.cmd}){more} failed: {text}",
            hint=hint,
        )
        err.ticket = failed.ticket  # type: ignore[attr-defined]
        err.command = failed.cmd  # type: ignore[attr-defined]
        return err

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"Proxy({self.name!r}, {state}, batch={self.batch}, {self.stats})"
