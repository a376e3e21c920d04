"""The tcp transport: proxies of different processes (any hosts; loopback in CI) over sockets.

Each process owns some ranks (one node's, under SPMD). Rendezvous goes through a
torch.distributed store (the TCPStore torchrun provides, or one made by the caller): every
process publishes its listening address and each local rank's buffer layout; ``connect(rank,
peer)`` opens ONE socket per rank pair (the lower rank dials, the higher accepts), which keeps the
order of that pair's writes and signals the way an RC queue pair does.

A write is one frame (wire.py; the native loop writes the very same bytes).

A receiver thread per socket checks every frame against its registered buffer (a region outside
it is rejected, never written), receives the payload straight into the buffer and only then
raises the frame's events through ``raise_event``. FENCE frames mark the end of a launch (all of
that launch's frames were received before it); BYE says the peer closed on purpose. A socket
that ends without BYE is a lost peer: the error goes to ``on_error`` at once, so the runtime
aborts its waits instead of running into the watchdog.

Writes complete when the kernel took the bytes, so ``poll`` reports them right away.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from mgraph.errors import ProxyError
from mgraph.graph import torch_dtype
from mgraph.topology import Topology

from .command import Rect
from .transport import RaiseEvent, Transport
from .wire import (
    BYE,
    FENCE,
    HEADER,
    MAX_EVENTS,
    NO_RECT,
    SIGNAL,
    WRITE,
    Closed,
    Switchboard,
    pack_header,
    recv_into,
    send_parts,
    store_get,
    tensor_bytes,
    unpack_header,
)

__all__ = ["TcpTransport"]

_POLL_S = 0.2  # how often a blocked socket call looks at ``closed``


@dataclass
class _Conn:
    sock: socket.socket
    local: int
    remote: int
    lock: threading.Lock = field(default_factory=threading.Lock)
    thread: threading.Thread | None = None
    bye: bool = False
    fence: int = 0


class TcpTransport(Transport):
    """Ranks of this process (``ranks``) talk to the others' over TCP; see the module docstring.

    ``raise_event(rank, event, epoch)`` is called for events arriving on local ranks (and for
    writes between two local ranks, which stay in-process). ``on_error`` receives a lost peer
    or a rejected frame as soon as the receiver sees it. ``timeout`` bounds rendezvous, sends
    that make no progress, and fences.
    """

    name = "tcp"

    def __init__(
        self,
        store: object,
        raise_event: RaiseEvent,
        topology: Topology | None,
        ranks: Sequence[int],
        *,
        host: str = "127.0.0.1",
        timeout: float = 30.0,
        prefix: str = "mgraph/tcp",
        on_error: Callable[[ProxyError], None] | None = None,
    ) -> None:
        super().__init__(topology)
        if not callable(raise_event):
            raise ProxyError(f"tcp: raise_event must be callable, got {raise_event!r}")
        self.store = store
        self.raise_event = raise_event
        self.local = sorted(set(ranks))
        self.timeout = timeout
        self.prefix = prefix
        self.on_error = on_error
        self.error: ProxyError | None = None
        self.conns: dict[tuple[int, int], _Conn] = {}  # (local rank, remote rank)
        self.remote: dict[int, dict[int, tuple[int, int, torch.dtype]]] = {}
        self.remote_events: dict[int, int] = {}
        self.events: dict[int, int] = {}
        self._cond = threading.Condition()
        self._next_id = 0
        self._done: dict[int, list[int]] = {}
        self._switchboard = Switchboard(store, prefix, self.local, host, timeout)

    # -- setup ------------------------------------------------------------------------------
    def register(self, rank: int, buffers: dict[int, torch.Tensor], n_events: int = -1) -> None:
        """Register a LOCAL rank's buffers (and how many events it has, for checks) and publish
        their layout for the peers."""
        if rank not in self.local:
            raise ProxyError(f"tcp: rank {rank} is not one of this process's ranks {self.local}")
        super().register(rank, buffers)
        self.events[rank] = n_events
        layout = {
            "buffers": [
                [i, t.shape[0], t.shape[1], str(t.dtype).removeprefix("torch.")]
                for i, t in buffers.items()
            ],
            "events": n_events,
        }
        self.store.set(f"{self.prefix}/layout/{rank}", json.dumps(layout))

    def _get(self, key: str, what: str) -> bytes:
        return store_get(self.store, key, self.timeout, what)

    def connect(self, rank: int, peer: int) -> None:
        self._check_open("connect")
        if rank not in self.local:
            raise ProxyError(
                f"tcp: connect({rank}, {peer}): rank {rank} is not local (local ranks {self.local})"
            )
        if peer in self.local:
            self.local_pairs.add(frozenset((rank, peer)))
            return
        if (rank, peer) in self.conns:
            return
        layout = json.loads(self._get(f"{self.prefix}/layout/{peer}", f"rank {peer}'s layout"))
        self.remote[peer] = {
            i: (rows, cols, torch_dtype(dt)) for i, rows, cols, dt in layout["buffers"]
        }
        self.remote_events[peer] = layout["events"]
        sock = self._switchboard.socket(rank, peer)
        sock.settimeout(_POLL_S)
        conn = _Conn(sock, rank, peer)
        conn.thread = threading.Thread(
            target=self._receive, args=(conn,), name=f"mgraph-tcp-r{rank}-from-r{peer}", daemon=True
        )
        self.conns[(rank, peer)] = conn
        conn.thread.start()

    # -- memory checks ----------------------------------------------------------------------
    def check_region(self, rank: int, rect: Rect) -> torch.dtype:
        if rank in self.memory or rank not in self.remote:
            return super().check_region(rank, rect)
        return self.check_remote_region(rank, rect, self.remote[rank])

    # -- the data path ----------------------------------------------------------------------
    def _conn(self, src_rank: int, dst_rank: int, what: str) -> _Conn:
        self._check_open(what)
        if self.error is not None:
            raise self.error
        conn = self.conns.get((src_rank, dst_rank))
        if conn is None:
            raise ProxyError(
                f"tcp: {what} from rank {src_rank} to rank {dst_rank}, which are not connected",
                hint=f"call connect({src_rank}, {dst_rank}) in both processes during setup",
            )
        return conn

    def _complete(self, src_rank: int) -> int:
        with self._cond:
            work = self._next_id
            self._next_id += 1
            self._done.setdefault(src_rank, []).append(work)
        return work

    def write(
        self,
        src_rank: int,
        src: torch.Tensor,
        dst_rank: int,
        dst: Rect,
        events: Sequence[int] = (),
        epoch: int = 0,
    ) -> int:
        nbytes = src.numel() * src.element_size()
        if self.is_local(src_rank, dst_rank):
            self.deliver_locally(dst_rank, dst, src, events, epoch, "write")
        else:
            conn = self._conn(src_rank, dst_rank, "write")
            dtype = self.check_region(dst_rank, dst)
            if dtype != src.dtype or src.shape != Rect(*dst).shape:
                raise ProxyError(
                    f"tcp: write of {tuple(src.shape)} {src.dtype} into rank "
                    f"{dst_rank} {dst} ({dtype})"
                )
            data = src.contiguous()
            self._send(conn, WRITE, dst_rank, dst, list(events), epoch, data)
        self._count(src_rank, dst_rank, nbytes)
        return self._complete(src_rank)

    def signal(self, src_rank: int, dst_rank: int, event: int, epoch: int = 0) -> int:
        if self.is_local(src_rank, dst_rank):
            self.deliver_locally(dst_rank, None, None, [event], epoch, "signal")
        else:
            conn = self._conn(src_rank, dst_rank, "signal")
            self._send(conn, SIGNAL, dst_rank, NO_RECT, [event], epoch, None)
        with self._stats_lock:
            self.signals += 1
        return self._complete(src_rank)

    def poll(self, rank: int | None = None) -> list[int]:
        with self._cond:
            if rank is None:
                done = [w for works in self._done.values() for w in works]
                self._done.clear()
            else:
                done = self._done.pop(rank, [])
        return done

    def _send(
        self,
        conn: _Conn,
        kind: int,
        dst_rank: int,
        dst: Rect,
        events: list[int],
        epoch: int,
        data: torch.Tensor | None,
    ) -> None:
        first, rest = events[:MAX_EVENTS], events[MAX_EVENTS:]
        payload = tensor_bytes(data) if data is not None else memoryview(b"")
        head = pack_header(kind, len(first), epoch, conn.local, dst_rank, dst, len(payload))
        with conn.lock:
            send_parts(
                conn.sock,
                [head, struct.pack(f"<{len(first)}q", *first), payload],
                self.timeout,
                lambda: self.closed,
                conn.remote,
            )
        for e in rest:
            self._send(conn, SIGNAL, dst_rank, NO_RECT, [e], epoch, None)

    # -- receiving --------------------------------------------------------------------------
    def _recv_into(self, conn: _Conn, view: memoryview) -> None:
        recv_into(conn.sock, view, lambda: self.closed)

    def _receive(self, conn: _Conn) -> None:
        head = bytearray(HEADER.size)
        try:
            while True:
                self._recv_into(conn, memoryview(head))
                kind, n_events, epoch, src, dst, rect, nbytes = unpack_header(head)
                if dst != conn.local or src != conn.remote:
                    raise ProxyError(
                        f"tcp: rank {conn.local} got a frame from rank "
                        f"{conn.remote} addressed {src} -> {dst}"
                    )
                raw = bytearray(8 * n_events)
                self._recv_into(conn, memoryview(raw))
                events = list(struct.unpack(f"<{n_events}q", raw))
                if kind == WRITE:
                    self._land(conn, rect, nbytes)
                elif kind == FENCE:
                    with self._cond:
                        conn.fence = max(conn.fence, epoch)
                        self._cond.notify_all()
                    continue
                elif kind == BYE:
                    conn.bye = True
                    continue
                elif kind != SIGNAL:
                    raise ProxyError(f"tcp: unknown frame kind {kind} from rank {conn.remote}")
                limit = self.events.get(dst, -1)  # -1: the rank did not say how many it has
                for e in events:
                    if limit >= 0 and not 0 <= e < limit:
                        raise ProxyError(
                            f"tcp: rank {src} raised event {e} outside rank {dst}'s "
                            f"{limit} events; frame rejected"
                        )
                    self.raise_event(dst, e, epoch)
        except (Closed, ConnectionError) as exc:
            if not (conn.bye or self.closed):
                how = "closed without a goodbye" if isinstance(exc, Closed) else str(exc)
                self._fail(
                    ProxyError(
                        f"tcp: the connection between rank {conn.local} and peer rank "
                        f"{conn.remote} was lost ({how})",
                        hint="a process died or lost its network; see both processes' errors",
                    )
                )
        except ProxyError as err:
            self._fail(err)
            self._sever(conn)  # the stream cannot be trusted after a bad frame
        except Exception as exc:  # a socket error or raise_event failing
            if not self.closed:
                self._fail(
                    ProxyError(
                        f"tcp: receiving from rank {conn.remote} on rank "
                        f"{conn.local} failed: {type(exc).__name__}: {exc}"
                    )
                )

    @staticmethod
    def _sever(conn: _Conn) -> None:
        try:
            conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _land(self, conn: _Conn, rect: Rect, nbytes: int) -> None:
        """Receive a WRITE's payload into the registered region, after checking it fits."""
        try:
            target = self.view(conn.local, rect)
        except ProxyError as err:
            raise ProxyError(
                f"tcp: rank {conn.remote} sent a write that rank {conn.local} "
                f"rejected: {err.message}",
                hint="the proxy never writes outside a registered buffer",
            ) from None
        want = target.numel() * target.element_size()
        if nbytes != want:
            raise ProxyError(
                f"tcp: rank {conn.remote} sent {nbytes} bytes for {rect} on rank "
                f"{conn.local}, which holds {want}; frame rejected"
            )
        if target.is_contiguous():
            self._recv_into(conn, tensor_bytes(target))
        else:
            staging = torch.empty(target.shape, dtype=target.dtype)
            self._recv_into(conn, tensor_bytes(staging))
            target.copy_(staging)

    def _fail(self, err: ProxyError) -> None:
        with self._cond:
            first = self.error is None
            if first:
                self.error = err
            self._cond.notify_all()
        if first and self.on_error is not None:
            self.on_error(err)

    # -- launches ---------------------------------------------------------------------------
    def fence(self, epoch: int, timeout: float | None = None) -> None:
        """Mark the end of launch ``epoch`` on every connection, then wait until every peer's
        mark arrived: by then each of their writes of this launch has landed here."""
        for conn in self.conns.values():
            self._send(conn, FENCE, conn.remote, NO_RECT, [], epoch, None)
        limit = self.timeout if timeout is None else timeout
        with self._cond:
            ok = self._cond.wait_for(
                lambda: (
                    self.error is not None or all(c.fence >= epoch for c in self.conns.values())
                ),
                limit,
            )
        if self.error is not None:
            raise self.error
        if not ok:
            late = sorted(c.remote for c in self.conns.values() if c.fence < epoch)
            raise ProxyError(
                f"tcp: ranks {late} did not finish launch {epoch} within {limit:g} s",
                hint="a peer is stuck or slower than the watchdog allows",
            )

    # -- native path ------------------------------------------------------------------------
    def attach_native(self, drain: object, rank: int, counters: dict[int, torch.Tensor]) -> None:
        """Local ranks by memmove; remote ones by frames the native loop writes on ``rank``'s
        sockets. While that loop runs it is the only sender on them (Python sends FENCE and BYE
        only after the proxies stopped), so frames never interleave."""
        from .native import add_tensor, dtype_name, load

        native = load()
        self._check_open("attach_native")
        reach = {rank} | {p for pair in self.local_pairs if rank in pair for p in pair}
        for r in sorted(reach & set(self.memory)):
            for index, tensor in self.memory[r].items():
                add_tensor(drain, r, native.PLACE_HOST, index, tensor)
            if r in counters:
                drain.set_host_events(r, counters[r].data_ptr(), counters[r].numel())
        for (local, peer), conn in self.conns.items():
            if local != rank:
                continue
            events = self.remote_events.get(peer, -1)
            drain.set_socket(peer, conn.sock.fileno(), events if events >= 0 else 2**31 - 1)
            for index, (rows, cols, dtype) in self.remote[peer].items():
                item = torch.empty((), dtype=dtype).element_size()
                drain.add_buffer(
                    peer,
                    native.PLACE_SOCKET,
                    index,
                    0,
                    rows,
                    cols,
                    cols * item,
                    item,
                    dtype_name(dtype),
                )

    def abort(self) -> None:
        """Cut every connection without a goodbye (a failed launch): each peer's receiver sees a
        lost connection at once and fails its launch too, instead of running into a watchdog."""
        with self._cond:
            if self.error is None:
                self.error = ProxyError(
                    "tcp: this transport was aborted after a failed launch",
                    hint="create a new runtime (and transport) in every process",
                )
            self._cond.notify_all()
        self.closed = True
        for conn in self.conns.values():
            self._sever(conn)
            conn.sock.close()
        self._switchboard.close()

    def close(self) -> None:
        if self.closed:
            return
        for conn in self.conns.values():
            try:  # a goodbye, so the peer knows the end of stream is on purpose
                self._send(conn, BYE, conn.remote, NO_RECT, [], 0, None)
            except ProxyError:
                pass
        self.closed = True
        for conn in self.conns.values():
            self._sever(conn)
            conn.sock.close()
        self._switchboard.close()
        with self._cond:
            self._cond.notify_all()
