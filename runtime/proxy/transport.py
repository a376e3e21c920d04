"""Transports: how a proxy moves a region into a peer's memory and raises the peer's event.

``Transport`` is the interface every backend implements (in-process here; tcp.py, verbs.py and
cuda_ipc.py): ``register`` a rank's buffers by index, ``connect`` two ranks, ``write`` a source view
into a destination region and then raise events there, ``signal`` an event alone, ``poll``
completions, ``close``. A write's events are raised only after its data is visible at the
destination, and a transport keeps the order of writes and signals between one pair of ranks
(an RC queue pair gives both), which is all the proxy relies on.

The base class holds what every transport shares: the registered memory and its bounds checks,
and byte counters per rank pair and per node pair, which is how tests check that hierarchical
collectives cross the network once per node.
"""

from __future__ import annotations

import ctypes
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from mgraph.errors import ProxyError
from mgraph.topology import Topology

from .command import Rect

__all__ = ["RaiseEvent", "Transport", "InProcessTransport", "check_flag_words"]

RaiseEvent = Callable[[int, int, int], None]
"""``raise_event(rank, event_id, epoch)``: add one to ``event_id`` on ``rank`` (the runtime's)."""


def check_flag_words(flags: object, device_type: str, what: str, hint: str) -> None:
    """ProxyError unless ``flags`` is a 1-D contiguous int32 tensor on a ``device_type`` device:
    a rank's flag words, which a native loop addresses by raw pointer."""
    if (
        isinstance(flags, torch.Tensor)
        and flags.dtype == torch.int32
        and flags.dim() == 1
        and flags.is_contiguous()
        and flags.device.type == device_type
    ):
        return
    got = type(flags).__name__
    if isinstance(flags, torch.Tensor):
        layout = "contiguous" if flags.is_contiguous() else "not contiguous"
        got = f"{flags.dtype} {tuple(flags.shape)} on {flags.device}, {layout}"
    kind = "CUDA" if device_type == "cuda" else device_type.upper()
    raise ProxyError(
        f"{what} must be a 1-D contiguous int32 {kind} tensor, got {got}", hint=hint
    )


class Transport(ABC):
    """Moves regions between ranks' registered buffers. See the module docstring."""

    name = "transport"

    def __init__(self, topology: Topology | None = None) -> None:
        # Without a topology every rank is its own node (GPUs of one host acting as nodes).
        self.topology = topology
        self.memory: dict[int, dict[int, torch.Tensor]] = {}
        self.bytes_by_ranks: Counter[tuple[int, int]] = Counter()
        self.bytes_by_nodes: Counter[tuple[int, int]] = Counter()
        self.writes = 0
        self.signals = 0
        self.closed = False
        # rank pairs that share this process; network transports fill it in connect()
        self.local_pairs: set[frozenset[int]] = set()
        self.epoch = 0
        self._stats_lock = threading.Lock()

    # -- memory -----------------------------------------------------------------------------
    def register(self, rank: int, buffers: dict[int, torch.Tensor]) -> None:
        """Make ``rank``'s 2-D buffers addressable as ``buffers[index]`` (replaces earlier ones)."""
        self._check_open("register")
        if self.topology is not None:
            self.topology.check_rank(rank)
        for index, tensor in buffers.items():
            if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2:
                shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor)
                raise ProxyError(
                    f"{self.name}: rank {rank} buffer {index} is {shape}, not a 2-D tensor",
                    hint="register buffers as the runtime allocates them: 2-D (rows, cols)",
                )
        self.memory[rank] = dict(buffers)

    def view(self, rank: int, rect: Rect) -> torch.Tensor:
        """``rect`` of ``rank``'s registered buffer, bounds-checked."""
        buffers = self.memory.get(rank)
        if buffers is None:
            raise ProxyError(
                f"{self.name}: rank {rank} has no registered memory",
                hint=f"call register({rank}, buffers) first; registered: {sorted(self.memory)}",
            )
        tensor = buffers.get(rect.buffer)
        if tensor is None:
            raise ProxyError(
                f"{self.name}: rank {rank} has no buffer {rect.buffer}",
                hint=f"registered buffer indices on rank {rank}: {sorted(buffers)}",
            )
        rows, cols = tensor.shape
        if not (0 <= rect.row0 <= rect.row1 <= rows and 0 <= rect.col0 <= rect.col1 <= cols):
            raise ProxyError(
                f"{self.name}: region {rect} is outside rank {rank} buffer {rect.buffer} "
                f"of shape ({rows}, {cols})"
            )
        return tensor[rect.row0 : rect.row1, rect.col0 : rect.col1]

    def check_region(self, rank: int, rect: Rect) -> torch.dtype:
        """Bounds-check ``rect`` on ``rank`` and return its dtype. A transport whose peers'
        memory is remote overrides this with the shapes exchanged at connect time."""
        return self.view(rank, rect).dtype

    def check_remote_region(
        self, rank: int, rect: Rect, shapes: dict[int, tuple[int, int, torch.dtype]]
    ) -> torch.dtype:
        """``check_region`` for a peer whose buffers this process only knows by the
        (rows, cols, dtype) exchanged at connect time: a proxy never writes outside them."""
        buf = shapes.get(rect.buffer)
        if buf is None:
            raise ProxyError(
                f"{self.name}: rank {rank} has no buffer {rect.buffer}",
                hint=f"rank {rank}'s buffers: {sorted(shapes)}",
            )
        rows, cols, dtype = buf
        if not (0 <= rect.row0 <= rect.row1 <= rows and 0 <= rect.col0 <= rect.col1 <= cols):
            raise ProxyError(
                f"{self.name}: region {rect} is outside rank {rank} buffer {rect.buffer} "
                f"of shape ({rows}, {cols})"
            )
        return dtype

    # -- ranks of this process ---------------------------------------------------------------
    def is_local(self, src_rank: int, dst_rank: int) -> bool:
        """Both ranks live in this process (``local_pairs``, filled by ``connect``): a write
        between them is a plain copy, no wire."""
        return src_rank == dst_rank or frozenset((src_rank, dst_rank)) in self.local_pairs

    def deliver_locally(
        self, dst_rank: int, dst: Rect | None, src: torch.Tensor | None, events: Sequence[int],
        epoch: int, what: str,
    ) -> None:
        """Copy ``src`` into ``dst`` (if given) and raise ``events``, all in this process."""
        self._check_open(what)
        if dst is not None:
            self.view(dst_rank, dst).copy_(src)
        for event in events:
            self.raise_event(dst_rank, event, epoch)

    def node_of(self, rank: int) -> int:
        return rank if self.topology is None else self.topology.node_of(rank)

    def _count(self, src_rank: int, dst_rank: int, nbytes: int, writes: int = 1) -> None:
        with self._stats_lock:
            self.writes += writes
            self.bytes_by_ranks[(src_rank, dst_rank)] += nbytes
            self.bytes_by_nodes[(self.node_of(src_rank), self.node_of(dst_rank))] += nbytes

    def account(self, src_rank: int, dst_rank: int, nbytes: int, writes: int = 1) -> None:
        """Count traffic that went around ``write`` (a native proxy's data path)."""
        self._count(src_rank, dst_rank, nbytes, writes)

    @property
    def bytes_total(self) -> int:
        return sum(self.bytes_by_ranks.values())

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise ProxyError(f"{self.name}: {what} after close()", hint="create a new transport")

    # -- the data path ----------------------------------------------------------------------
    @abstractmethod
    def connect(self, rank: int, peer: int) -> None:
        """Open the channel between ``rank`` and ``peer`` (both directions)."""

    @abstractmethod
    def write(
        self,
        src_rank: int,
        src: torch.Tensor,
        dst_rank: int,
        dst: Rect,
        events: Sequence[int] = (),
        epoch: int = 0,
    ) -> int:
        """Copy ``src`` (a view of ``src_rank``'s memory) into ``dst`` on ``dst_rank``, then
        raise each of ``events`` on ``dst_rank`` with ``epoch``. Returns a work id that ``poll``
        reports once the source may be reused."""

    @abstractmethod
    def signal(self, src_rank: int, dst_rank: int, event: int, epoch: int = 0) -> int:
        """Raise ``event`` on ``dst_rank``, after every earlier write from ``src_rank`` to it.
        ``dst_rank == src_rank`` raises a local event. Returns a work id, like ``write``."""

    @abstractmethod
    def poll(self, rank: int | None = None) -> list[int]:
        """Work ids completed since the last poll, of work issued by ``rank`` (None: any).
        Proxies sharing one transport each poll their own ranks, so none takes another's."""

    def begin(self, epoch: int) -> None:
        """A launch starts: transports that tag or check events with the epoch note it."""
        self.epoch = epoch

    def attach_native(self, drain: object, rank: int, counters: dict[int, torch.Tensor]) -> None:
        """Describe to a native drain loop (runtime/proxy/native) the memory and events that
        ``rank``'s proxy reaches through this transport. ``counters`` holds the int64 event
        arrays of the ranks in this process. Transports without a native path say so."""
        raise ProxyError(
            f"{self.name}: this transport has no native data path",
            hint="use the Python proxy with it: Settings(proxy='python') or MGRAPH_PROXY=python",
        )

    def close(self) -> None:
        self.closed = True

    def __enter__(self) -> Transport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class InProcessTransport(Transport):
    """Every rank in this process: a write is a tensor copy, an event a direct callback.

    Writes complete before ``write`` returns, so ``poll`` just hands back the ids issued since
    the previous poll. Safe to share between the proxies of several ranks.

    A rank that registered int32 flag words (``register_flags``) has its events raised there
    instead of through the callback: event ``e`` adds one to ``flags[e]``. These are the net
    flag words of a Triton-interpreted megakernel, each a running count with ONE writing proxy.
    """

    name = "inprocess"

    def __init__(self, raise_event: RaiseEvent, topology: Topology | None = None) -> None:
        super().__init__(topology)
        if not callable(raise_event):
            raise ProxyError(f"inprocess: raise_event must be callable, got {raise_event!r}")
        self.raise_event = raise_event
        self.connections: set[frozenset[int]] = set()
        self._lock = threading.Lock()
        self._next_id = 0
        self._done: dict[int, list[int]] = {}
        self.flags: dict[int, torch.Tensor] = {}
        self._flag_words: dict[int, ctypes.Array] = {}
        self._flag_lock = threading.Lock()

    def register_flags(self, rank: int, flags: torch.Tensor) -> None:
        """Raise ``rank``'s events on ``flags`` (1-D, contiguous, int32, CPU), not the callback.
        The tensor must outlive the transport and any native proxy attached to it."""
        self._check_open("register_flags")
        check_flag_words(
            flags, "cpu", f"inprocess: rank {rank}'s flags",
            "pass the rank's int32 flag words, e.g. flags[lo:hi] of its flag array",
        )
        self.flags[rank] = flags
        # ctypes over the storage: a word costs ~0.1 us instead of ~2 us through torch indexing.
        self._flag_words[rank] = (ctypes.c_int32 * flags.numel()).from_address(flags.data_ptr())

    def _raise(self, rank: int, event: int, epoch: int) -> None:
        words = self._flag_words.get(rank)
        if words is None:
            self.raise_event(rank, event, epoch)
            return
        if not 0 <= event < len(words):
            raise ProxyError(
                f"inprocess: event {event} is outside rank {rank}'s {len(words)} flag words",
                hint="the command's event id must index the flags given to register_flags",
            )
        # One writing proxy per word, but several proxies may share this transport.
        with self._flag_lock:
            words[event] += 1

    def connect(self, rank: int, peer: int) -> None:
        self._check_open("connect")
        missing = [r for r in (rank, peer) if r not in self.memory]
        if missing:
            raise ProxyError(
                f"inprocess: cannot connect rank {rank} to rank {peer}: rank(s) {missing} "
                "registered no memory",
                hint="register(rank, buffers) on both ranks before connect()",
            )
        self.connections.add(frozenset((rank, peer)))

    def _check_path(self, src_rank: int, dst_rank: int, what: str) -> None:
        self._check_open(what)
        if src_rank != dst_rank and frozenset((src_rank, dst_rank)) not in self.connections:
            raise ProxyError(
                f"inprocess: {what} from rank {src_rank} to rank {dst_rank}, which are not "
                "connected",
                hint=f"call transport.connect({src_rank}, {dst_rank}) during setup",
            )

    def _complete(self, src_rank: int) -> int:
        with self._lock:
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
        self._check_path(src_rank, dst_rank, "write")
        target = self.view(dst_rank, dst)
        if target.shape != src.shape or target.dtype != src.dtype:
            raise ProxyError(
                f"inprocess: write of {tuple(src.shape)} {src.dtype} from rank {src_rank} into "
                f"rank {dst_rank} {dst}, which is {tuple(target.shape)} {target.dtype}",
                hint="source and destination regions must match in shape and dtype",
            )
        target.copy_(src)
        self._count(src_rank, dst_rank, src.numel() * src.element_size())
        for event in events:
            self._raise(dst_rank, event, epoch)
        return self._complete(src_rank)

    def signal(self, src_rank: int, dst_rank: int, event: int, epoch: int = 0) -> int:
        self._check_path(src_rank, dst_rank, "signal")
        with self._stats_lock:
            self.signals += 1
        self._raise(dst_rank, event, epoch)
        return self._complete(src_rank)

    def attach_native(self, drain: object, rank: int, counters: dict[int, torch.Tensor]) -> None:
        """Host memmove into every rank connected to ``rank``; events are atomic adds on the
        rank's registered int32 flags, else on its int64 ``counters`` (the ``raise_event``
        callback is not called on this path)."""
        from .native import add_tensor, load

        self._check_open("attach_native")
        place = load().PLACE_HOST
        reach = {rank} | {p for pair in self.connections if rank in pair for p in pair}
        for r in sorted(reach & set(self.memory)):
            for index, tensor in self.memory[r].items():
                add_tensor(drain, r, place, index, tensor)
            if r in self.flags:
                drain.set_host_flags(r, self.flags[r].data_ptr(), self.flags[r].numel())
            elif r in counters:
                drain.set_host_events(r, counters[r].data_ptr(), counters[r].numel())

    def poll(self, rank: int | None = None) -> list[int]:
        with self._lock:
            if rank is None:
                done = [w for works in self._done.values() for w in works]
                self._done.clear()
            else:
                done = self._done.pop(rank, [])
        return done
