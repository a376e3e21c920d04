"""What travels between the proxies of different processes: the tcp frame, and store helpers.

A frame (runtime/proxy/native/wire.h mirrors it; the native loop writes the same bytes):

    8 little-endian int64 words: MAGIC << 32 | kind << 16 | n_events, epoch, src rank,
    dst rank, dst buffer, row0 << 32 | row1, col0 << 32 | col1, payload bytes
    n_events int64 event ids (at most MAX_EVENTS; more go as extra SIGNAL frames)
    payload: the destination region's rows, row-major

Kinds: WRITE (data, then its events), SIGNAL (events only), FENCE (the sender's writes of launch
``epoch`` all came before it), BYE (the sender closes on purpose).
"""

from __future__ import annotations

import ctypes
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch

from mgraph.errors import ProxyError

from .command import Rect

__all__ = [
    "HEADER",
    "HELLO",
    "MAGIC",
    "WRITE",
    "SIGNAL",
    "FENCE",
    "BYE",
    "MAX_EVENTS",
    "NO_RECT",
    "pack_header",
    "unpack_header",
    "tensor_bytes",
    "send_parts",
    "recv_into",
    "Closed",
    "store_barrier",
    "store_get",
    "Switchboard",
]

HEADER = struct.Struct("<8q")
HELLO = struct.Struct("<3q")  # magic, dialing rank, dialed rank
MAGIC = 0x4D475446  # "MGTF"
WRITE, SIGNAL, FENCE, BYE = 1, 2, 3, 4
MAX_EVENTS = 255
NO_RECT = Rect(0, 0, 0, 0, 0)


class Closed(Exception):
    """The peer ended the stream (or this side closed while waiting)."""


def pack_header(
    kind: int, n_events: int, epoch: int, src: int, dst: int, rect: Rect, nbytes: int
) -> bytes:
    return HEADER.pack(
        MAGIC << 32 | kind << 16 | n_events,
        epoch,
        src,
        dst,
        rect.buffer,
        rect.row0 << 32 | rect.row1,
        rect.col0 << 32 | rect.col1,
        nbytes,
    )


def unpack_header(raw: bytes | bytearray) -> tuple[int, int, int, int, int, Rect, int]:
    """(kind, n_events, epoch, src, dst, rect, nbytes); ProxyError for a wrong magic."""
    word0, epoch, src, dst, buf, rows, cols, nbytes = HEADER.unpack(raw)
    if word0 >> 32 != MAGIC:
        raise ProxyError(f"tcp: malformed frame header {HEADER.unpack(raw)}")
    rect = Rect(buf, rows >> 32, rows & 0xFFFFFFFF, cols >> 32, cols & 0xFFFFFFFF)
    return (word0 >> 16) & 0xFFFF, word0 & 0xFFFF, epoch, src, dst, rect, nbytes


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, without a copy (keep ``tensor`` alive while used)."""
    n = tensor.numel() * tensor.element_size()
    return memoryview((ctypes.c_char * n).from_address(tensor.data_ptr())).cast("B")


def send_parts(
    sock: socket.socket,
    parts: Sequence[bytes | memoryview],
    timeout: float,
    closed: Callable[[], bool],
    peer: int,
) -> None:
    """Send every byte of ``parts`` on a socket with a short timeout set; ProxyError when the
    peer is gone or accepts nothing for ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    for part in parts:
        view = memoryview(part).cast("B")
        while len(view):
            try:
                view = view[sock.send(view) :]
                deadline = time.monotonic() + timeout  # progress: a stall restarts the clock
            except TimeoutError:
                if closed() or time.monotonic() > deadline:
                    raise ProxyError(
                        f"tcp: rank {peer} accepted no data for {timeout:g} s"
                    ) from None
            except OSError as exc:
                raise ProxyError(
                    f"tcp: send to rank {peer} failed: {exc} (the peer disconnected)"
                ) from exc


def recv_into(sock: socket.socket, view: memoryview, closed: Callable[[], bool]) -> None:
    """Fill ``view`` from a socket with a short timeout set; Closed at end of stream."""
    while len(view):
        try:
            n = sock.recv_into(view)
        except TimeoutError:
            if closed():
                raise Closed from None
            continue
        if n == 0:
            raise Closed
        view = view[n:]


def store_get(store: object, key: str, timeout: float, what: str) -> bytes:
    """``store.get(key)``, waiting at most ``timeout`` seconds for a peer to set it."""
    try:
        store.wait([key], timedelta(seconds=timeout))
    except Exception as exc:
        raise ProxyError(
            f"tcp: {what} did not appear in the store within {timeout:g} s ({exc})",
            hint="every process must create its runtime (transport) and register its ranks",
        ) from exc
    return store.get(key)


def store_barrier(
    store: object, key: str, count: int, timeout: float, failed: Callable[[], bool] = lambda: False
) -> None:
    """Wait until ``count`` processes reached ``key`` (each calls this once)."""
    store.add(key, 1)
    deadline = time.monotonic() + timeout
    while store.add(key, 0) < count:
        if failed():
            return
        if time.monotonic() > deadline:
            raise ProxyError(
                f"tcp: only {store.add(key, 0)} of {count} processes reached {key!r} within "
                f"{timeout:g} s",
                hint="a peer process died or never started; check its output",
            )
        time.sleep(1e-3)


class Switchboard:
    """One socket per rank pair between processes: listens on ``host`` (the address goes into
    the store for each local rank), the lower rank of a pair dials the higher, whose side
    matches the accepted socket by the hello it sends."""

    def __init__(self, store: object, prefix: str, ranks: Sequence[int], host: str,
                 timeout: float) -> None:  # fmt: skip
        self.store, self.prefix, self.timeout = store, prefix, timeout
        self.closed = False
        self._cond = threading.Condition()
        self._accepted: dict[tuple[int, int], socket.socket] = {}
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(0.2)
        port = self._listener.getsockname()[1]
        for r in ranks:
            store.set(f"{prefix}/addr/{r}", f"{host}:{port}")
        threading.Thread(target=self._accept, name="mgraph-tcp-accept", daemon=True).start()

    def socket(self, rank: int, peer: int) -> socket.socket:
        """The connected socket between local ``rank`` and remote ``peer``."""
        if rank < peer:
            key = f"{self.prefix}/addr/{peer}"
            address = store_get(self.store, key, self.timeout, f"rank {peer}'s address").decode()
            host, port = address.rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=self.timeout)
            sock.sendall(HELLO.pack(MAGIC, rank, peer))
        else:
            with self._cond:
                if not self._cond.wait_for(lambda: (rank, peer) in self._accepted, self.timeout):
                    raise ProxyError(
                        f"tcp: rank {peer} did not connect to rank {rank} within "
                        f"{self.timeout:g} s",
                        hint="is the peer process alive?",
                    )
                sock = self._accepted.pop((rank, peer))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def _accept(self) -> None:
        while not self.closed:
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # listener closed
            try:
                sock.settimeout(self.timeout)
                hello = b""
                while len(hello) < HELLO.size:
                    chunk = sock.recv(HELLO.size - len(hello))
                    if not chunk:
                        raise OSError("closed during hello")
                    hello += chunk
                magic, src, dst = HELLO.unpack(hello)
            except OSError:
                sock.close()
                continue
            if magic != MAGIC:  # not one of ours
                sock.close()
                continue
            with self._cond:
                self._accepted[(dst, src)] = sock
                self._cond.notify_all()

    def close(self) -> None:
        self.closed = True
        self._listener.close()
