"""The cuda_ipc transport: GPUs of one host act as separate nodes.

Each rank is a GPU (``devices`` maps this process's ranks to device indices) and its memory is
CUDA tensors. Python keeps the control plane: ``register`` publishes a rank's buffers and
``register_flags`` its event flag words through the torch.distributed store as CUDA IPC handles
(torch's own ``reduce_tensor``: handle, offset and size of the allocation); ``connect(rank,
peer)`` opens the peer's handles (cudaIpcOpenMemHandle), mapping its buffers and flags here.
Memory that torch symmetric memory already mapped into this process is registered directly
instead (``register_mapped``): no handles are exchanged for it.

The data path is the native drain loop (``attach_native``): cudaMemcpy2DAsync on the proxy's
own stream from the local buffer into the mapped peer buffer (the copy engine, no SM), then
cuStreamWriteValue32 of each event's flag word, ordered after the copy by the stream. A flag
word holds a running count that is never reset (epoch-tagged: the consumer waits for
``epoch * count``); the proxy keeps that count in a host-side shadow, so each flag word must have
ONE writing proxy (true of the hierarchical collectives: a rank hears each event from one rail
peer). ``bandwidth`` (bytes/s) paces the copies like a NIC, to emulate e.g. a 50 GB/s link.

The Python write path (for the Python Proxy) does the same with torch: a copy on a side stream
and a one-element fill of the flag word, which costs a kernel launch per event.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence

import torch

from mgraph.errors import ProxyError
from mgraph.topology import Topology

from .command import Rect
from .transport import Transport, check_flag_words
from .wire import store_get

__all__ = ["CudaIpcTransport", "cuda_libraries"]


def cuda_libraries() -> tuple[list[str], list[str]]:
    """Paths (or names) of the CUDA runtime and driver this process uses, best first: the
    libraries torch loaded (from /proc/self/maps), then the usual sonames."""
    runtime: list[str] = []
    driver: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if "/" in line else ""
                name = path.rsplit("/", 1)[-1]
                if name.startswith("libcudart.so") and path not in runtime:
                    runtime.append(path)
                elif name.startswith("libcuda.so") and path not in driver:
                    driver.append(path)
    except OSError:
        pass
    return runtime + ["libcudart.so.12", "libcudart.so"], driver + ["libcuda.so.1", "libcuda.so"]


class CudaIpcTransport(Transport):
    """Ranks are GPUs of this host; see the module docstring."""

    name = "cuda_ipc"

    def __init__(
        self,
        store: object,
        devices: Mapping[int, int],
        topology: Topology | None = None,
        *,
        bandwidth: float = 0.0,
        timeout: float = 30.0,
        prefix: str = "mgraph/cuda_ipc",
    ) -> None:
        if not torch.cuda.is_available():
            raise ProxyError(
                "cuda_ipc: CUDA is not available in this process",
                hint="cuda_ipc moves GPU memory; on a CPU machine use the tcp transport",
            )
        super().__init__(topology)
        self.store = store
        self.devices = dict(devices)
        self.bandwidth = float(bandwidth)
        self.timeout = timeout
        self.prefix = prefix
        self.flags: dict[int, torch.Tensor] = {}  # rank -> int32 flag words (own or mapped)
        self.shadow: dict[int, torch.Tensor] = {}  # rank -> int64 host copy of its flag words
        self.connections: set[frozenset[int]] = set()
        self.mapped: set[int] = set()  # ranks registered with register_mapped
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._pending: dict[int, list[tuple[int, torch.cuda.Event]]] = {}
        self._next_id = 0

    # -- setup ------------------------------------------------------------------------------
    def register(self, rank: int, buffers: dict[int, torch.Tensor]) -> None:
        from torch.multiprocessing.reductions import reduce_tensor

        device = self._device(rank)
        for index, t in buffers.items():
            if t.device != torch.device("cuda", device):
                raise ProxyError(
                    f"cuda_ipc: rank {rank} buffer {index} is on {t.device}, the "
                    f"rank's GPU is cuda:{device}"
                )
        super().register(rank, buffers)
        handles = {i: reduce_tensor(t) for i, t in buffers.items()}
        self.store.set(f"{self.prefix}/mem/{rank}", pickle.dumps(handles))

    def register_flags(self, rank: int, flags: torch.Tensor) -> None:
        """``rank``'s event flag words: a 1-D int32 tensor on its GPU, zero at the start."""
        from torch.multiprocessing.reductions import reduce_tensor

        device = self._device(rank)
        if (
            flags.dtype != torch.int32
            or flags.dim() != 1
            or flags.device != torch.device("cuda", device)
        ):
            raise ProxyError(
                f"cuda_ipc: rank {rank}'s flags must be a 1-D int32 tensor on "
                f"cuda:{device}, got {flags.dtype} {tuple(flags.shape)} on {flags.device}"
            )
        self.flags[rank] = flags
        self.shadow[rank] = torch.zeros(flags.numel(), dtype=torch.int64)
        self.store.set(f"{self.prefix}/flags/{rank}", pickle.dumps(reduce_tensor(flags)))

    def register_mapped(
        self, rank: int, buffers: dict[int, torch.Tensor], flags: torch.Tensor | None
    ) -> None:
        """Register memory of ``rank`` that this process can already address: its own GPU's,
        or a peer's that torch symmetric memory mapped here (``symm_mem.rendezvous(t)
        .get_buffer(peer, ...)``: a tensor on the LOCAL device index that points at the peer's
        memory). ``buffers`` are 2-D CUDA tensors on any device; ``flags`` is the rank's net
        flag words (1-D int32 CUDA tensor, zero when the first event is raised) or None. Flags
        may also be a pinned host tensor (``pin_memory=True``, which the rank's kernels poll
        with sys-scope loads): the native loop then raises them itself, with host stores once
        its stream has executed their data (mover.h, "Host-resident flags"; one copy stream;
        the Python path refuses them).

        Why this path exists: the rendezvous has already done the mapping (it exchanged the
        handles and opened them, for every rank, once), so opening IPC handles again would only
        map the same memory twice. And ``register`` cannot share such memory at all: it
        publishes handles with torch's ``reduce_tensor``, which works for caching-allocator
        blocks only, and symmetric-memory allocations do not come from the caching allocator.

        Nothing is published to or read from the store: once ``rank`` and ``peer`` are both
        registered this way, ``connect(rank, peer)`` only records the pair, and
        ``attach_native`` describes both ranks' buffers and flags to the drain loop. The flag
        words' running counts start from zero in a new host shadow, so each word must have ONE
        writing proxy and a rank is registered once per lifetime of its flags.
        """
        self._check_open("register_mapped")
        for index, t in buffers.items():
            if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
                where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
                raise ProxyError(
                    f"cuda_ipc: rank {rank} buffer {index} is on {where}, not a CUDA device",
                    hint="register_mapped takes GPU memory this process can address; "
                    "host memory belongs to the inprocess or tcp transport",
                )
        if flags is not None:
            hosted = isinstance(flags, torch.Tensor) and flags.device.type == "cpu"
            check_flag_words(
                flags, "cpu" if hosted else "cuda", f"cuda_ipc: rank {rank}'s flags (or None)",
                "pass the rank's net flag words, e.g. flags[lo:hi] of its symmetric flags",
            )
            if hosted and not flags.is_pinned():
                raise ProxyError(
                    f"cuda_ipc: rank {rank}'s flags are host memory that is not pinned: its GPU "
                    "cannot poll them",
                    hint="allocate them with pin_memory=True, or pass GPU flag words",
                )
        Transport.register(self, rank, buffers)  # shape checks only: no handles published
        self.mapped.add(rank)
        if flags is None:
            self.flags.pop(rank, None)
            self.shadow.pop(rank, None)
        else:
            self.flags[rank] = flags
            self.shadow[rank] = torch.zeros(flags.numel(), dtype=torch.int64)

    def _device(self, rank: int) -> int:
        if rank not in self.devices:
            raise ProxyError(
                f"cuda_ipc: rank {rank} is not one of this process's GPUs {self.devices}"
            )
        return self.devices[rank]

    def connect(self, rank: int, peer: int) -> None:
        """Map ``peer``'s buffers and flags into this process through the store's IPC
        handles; only the pair is recorded when ``peer`` is local or was ``register_mapped``."""
        self._check_open("connect")
        if rank not in self.mapped:
            self._device(rank)  # a rank this process holds
        if peer not in self.devices and peer not in self.memory and peer not in self.mapped:
            with torch.cuda.device(self._device(rank)):
                handles = pickle.loads(
                    store_get(
                        self.store,
                        f"{self.prefix}/mem/{peer}",
                        self.timeout,
                        f"rank {peer}'s buffers",
                    )
                )
                self.memory[peer] = {i: fn(*args) for i, (fn, args) in handles.items()}
                fn, args = pickle.loads(
                    store_get(
                        self.store,
                        f"{self.prefix}/flags/{peer}",
                        self.timeout,
                        f"rank {peer}'s flags",
                    )
                )
                self.flags[peer] = fn(*args)
                self.shadow[peer] = torch.zeros(self.flags[peer].numel(), dtype=torch.int64)
        self.connections.add(frozenset((rank, peer)))

    # -- the Python data path ---------------------------------------------------------------
    def _stream(self, rank: int) -> torch.cuda.Stream:
        device = self._device(rank)
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _raise_flags(self, rank: int, events: Sequence[int]) -> None:
        flags, shadow = self.flags.get(rank), self.shadow.get(rank)
        if flags is None or shadow is None:
            raise ProxyError(
                f"cuda_ipc: rank {rank} registered no flags",
                hint="register_flags(rank, flags) and connect() first",
            )
        if flags.device.type == "cpu":  # a host fill would land before the queued copy
            raise ProxyError(
                f"cuda_ipc: rank {rank}'s flags are in host memory, which only the native "
                "proxy raises in order (after its stream executed the data)",
                hint="use NativeProxy, or register GPU flag words",
            )
        for e in events:
            if not 0 <= e < flags.numel():
                raise ProxyError(
                    f"cuda_ipc: event {e} is outside rank {rank}'s {flags.numel()} flags"
                )
            shadow[e] += 1
            flags[e : e + 1].fill_(int(shadow[e]))

    def _issue(self, src_rank: int) -> int:
        event = torch.cuda.Event()
        event.record(self._stream(src_rank))
        work = self._next_id
        self._next_id += 1
        self._pending.setdefault(src_rank, []).append((work, event))
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
        self._check_open("write")
        if src_rank != dst_rank and frozenset((src_rank, dst_rank)) not in self.connections:
            raise ProxyError(
                f"cuda_ipc: write from rank {src_rank} to rank {dst_rank}, which are not connected",
                hint=f"call connect({src_rank}, {dst_rank})",
            )
        target = self.view(dst_rank, dst)
        stream = self._stream(src_rank)
        stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(stream):
            target.copy_(src, non_blocking=True)
            self._raise_flags(dst_rank, events)  # stream order: after the copy
        self._count(src_rank, dst_rank, src.numel() * src.element_size())
        return self._issue(src_rank)

    def signal(self, src_rank: int, dst_rank: int, event: int, epoch: int = 0) -> int:
        self._check_open("signal")
        with torch.cuda.stream(self._stream(src_rank)):
            self._raise_flags(dst_rank, [event])
        with self._stats_lock:
            self.signals += 1
        return self._issue(src_rank)

    def poll(self, rank: int | None = None) -> list[int]:
        done: list[int] = []
        for r in [rank] if rank is not None else list(self._pending):
            left = []
            for work, event in self._pending.get(r, []):
                if event.query():
                    done.append(work)
                else:
                    left.append((work, event))
            self._pending[r] = left
        return done

    # -- the native data path ---------------------------------------------------------------
    def attach_native(self, drain: object, rank: int, counters: dict[int, torch.Tensor]) -> None:
        from .native import add_tensor, load

        place = load().PLACE_CUDA
        self._check_open("attach_native")
        device = self._device(rank)
        runtime_libs, driver_libs = cuda_libraries()
        failure = drain.use_cuda(device, runtime_libs, driver_libs)
        if failure:
            raise ProxyError(
                f"cuda_ipc: {failure}",
                hint="the native proxy resolves CUDA from the libraries torch "
                "loaded; is this a CUDA build of torch?",
            )
        if self.bandwidth > 0:
            drain.bytes_per_s = self.bandwidth
        reach = {rank} | {p for pair in self.connections if rank in pair for p in pair}
        # Every buffer and flag word on the proxy's GPU: a flag's readers are all there, so a
        # GPU-scope barrier orders data before flags for them (NativeProxy gpu_fence).
        mine = [t for r in reach for t in self.memory.get(r, {}).values()]
        mine += [self.flags[r] for r in reach if r in self.flags and self.flags[r].is_cuda]
        drain.local_memory = all(t.device == torch.device("cuda", device) for t in mine)
        for r in sorted(reach & set(self.memory)):
            for index, tensor in self.memory[r].items():
                add_tensor(drain, r, place, index, tensor, device)
            if r in self.flags and not self.flags[r].is_cuda:  # pinned host flag words
                drain.set_cuda_host_flags(r, self.flags[r].data_ptr(), self.flags[r].numel())
            elif r in self.flags:
                drain.set_cuda_flags(
                    r, self.flags[r].data_ptr(), self.flags[r].numel(), self.shadow[r].data_ptr()
                )
