"""The verbs transport of the native drain loop: RDMA from C++, libibverbs loaded at run time.

``NativeVerbsTransport`` is the control plane of runtime/proxy/native/verbs.h (read it for the
wire protocol, memory registration and batching): it opens a NIC port, registers ONE rank's
buffers (host memory, or GPU memory through dma-buf, nvidia-peermem or host staging), creates an
RC queue pair per peer and exchanges what the peer needs through the torch.distributed store
(QP number, PSN, LID, GID; each buffer's address, rkey and shape; the event count). The data path
exists only in the native proxy (``attach_native``): a WRITE is an RDMA WRITE whose immediate is
the destination's event, raised by the receiving proxy when the completion arrives; "sent"
(done) events are raised once per batch when the NIC has read the sources.

Unlike ``VerbsTransport`` (pyverbs, Python proxy), nothing here imports pyverbs, and the
extension does not link libibverbs: it is dlopened when the transport is built, so a missing
library or device is a RdmaUnavailableError then, never an import failure.

It has not run on real InfiniBand, RoCE or EFA hardware (the machines this project has used have
none); it is tested against a fake libibverbs (tests/fake_verbs). EFA offers SRD queue pairs, not
RC, so this backend cannot use an EFA device as it is.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import torch

from mgraph.errors import ProxyError, RdmaUnavailableError
from mgraph.topology import Topology

from .command import Rect
from .cuda_ipc import cuda_libraries
from .native import add_tensor, load
from .transport import Transport, check_flag_words
from .wire import store_get

__all__ = ["NativeVerbsTransport", "LIBIBVERBS", "GPU_MEMORY"]

LIBIBVERBS = ("libibverbs.so.1", "libibverbs.so")
GPU_MEMORY = ("auto", "dmabuf", "peermem", "staged")
_HINT = (
    "run on a host with an InfiniBand/RoCE NIC and libibverbs (rdma-core), or use the cuda_ipc "
    "transport (GPUs of one host) or tcp"
)


class NativeVerbsTransport(Transport):
    """RDMA between this process's rank ``rank`` and its peers; see the module docstring.

    ``device`` picks the NIC (default: the first), ``port``/``gid_index`` its port and GID,
    ``depth`` the queue sizes, ``max_peers`` the queue pairs it may hold. ``gpu_memory`` says how
    GPU buffers are registered (``GPU_MEMORY``; auto tries dma-buf, then nvidia-peermem, then
    stages). ``libs`` are the libibverbs names or paths to try; ``cuda_libs`` (runtime, driver)
    the CUDA libraries for GPU memory (default: those torch loaded), needed when a buffer is
    registered with ``place="cuda"``."""

    name = "verbs_native"

    def __init__(
        self,
        store: object,
        rank: int,
        topology: Topology | None = None,
        *,
        device: str | None = None,
        port: int = 1,
        gid_index: int = 0,
        depth: int = 256,
        max_peers: int = 8,
        gpu_memory: str = "auto",
        staging_bytes: int = 64 << 20,
        libs: Sequence[str] = LIBIBVERBS,
        cuda_libs: tuple[list[str], list[str]] | None = None,
        cuda_device: int = -1,
        timeout: float = 30.0,
        prefix: str = "mgraph/verbs_native",
    ) -> None:
        if gpu_memory not in GPU_MEMORY:
            raise ProxyError(
                f"verbs_native: unknown gpu_memory {gpu_memory!r}", hint=f"one of {GPU_MEMORY}"
            )
        super().__init__(topology)
        native = load()
        self.nic = native.Nic()
        try:
            self.nic.open(list(libs), device or "", port, gid_index, depth, max_peers)
        except RuntimeError as exc:
            text = str(exc)
            if text.startswith(("no RDMA device", "libibverbs")):
                raise RdmaUnavailableError(f"verbs_native: {text}", hint=_HINT) from None
            raise ProxyError(f"verbs_native: {text}") from None
        self.nic.staging_bytes = staging_bytes
        self.store, self.rank, self.timeout, self.prefix = store, rank, timeout, prefix
        self.gpu_memory, self.cuda_device = gpu_memory, cuda_device
        self.cuda_libs = cuda_libs
        self.places: dict[int, str] = {}  # buffer index -> "host" / "cuda"
        self.memory_kinds: dict[int, str] = {}  # buffer index -> host/dmabuf/peermem/staged
        self.flags: torch.Tensor | None = None
        self.shadow: torch.Tensor | None = None
        self.n_events = -1
        self.peers: list[int] = []
        self.remote: dict[int, dict] = {}
        self._cuda_ready = False

    # -- setup ------------------------------------------------------------------------------
    def register(
        self,
        rank: int,
        buffers: dict[int, torch.Tensor],
        flags: torch.Tensor | None = None,
        *,
        place: str | None = None,
    ) -> None:
        """Register ``rank``'s (this transport's rank) 2-D buffers and its event words, and
        publish them. ``flags``: int32 words its events raise (GPU flag words with ``place=
        "cuda"``, host words otherwise); None: the native proxy's int64 counters. ``place``
        overrides where the memory is (default: the tensors' device), for tests whose "GPU"
        memory is host memory behind fake CUDA libraries."""
        self._check_open("register")
        if rank != self.rank:
            raise ProxyError(
                f"verbs_native: this transport serves rank {self.rank}, not rank {rank}",
                hint="one NativeVerbsTransport per rank (one NIC context each)",
            )
        where = place or (
            "cuda" if any(t.device.type == "cuda" for t in buffers.values()) else "host"
        )
        if where not in ("host", "cuda"):
            raise ProxyError(f"verbs_native: place must be 'host' or 'cuda', got {where!r}")
        super().register(rank, buffers)
        if where == "cuda" and not self._cuda_ready:
            runtime, driver = self.cuda_libs or cuda_libraries()
            try:
                self.nic.use_cuda(runtime, driver)
            except RuntimeError as exc:
                raise ProxyError(f"verbs_native: {exc}") from None
            self._cuda_ready = True
        layout = []
        for index, t in buffers.items():
            if t.size(1) > 1 and t.stride(1) != 1:
                raise ProxyError(f"verbs_native: rank {rank} buffer {index}: rows not contiguous")
            item = t.element_size()
            row_bytes = max(t.stride(0), t.size(1)) * item
            span = max((t.size(0) - 1) * row_bytes + t.size(1) * item, item)
            try:
                if where == "cuda":
                    region = self.nic.register_gpu(t.data_ptr(), span, self.gpu_memory)
                else:
                    region = self.nic.register_host(t.data_ptr(), span)
            except RuntimeError as exc:
                raise ProxyError(f"verbs_native: rank {rank} buffer {index}: {exc}") from None
            self.places[index] = where
            self.memory_kinds[index] = region["memory"]
            writable = region["memory"] != "staged"
            layout.append(
                [
                    index,
                    t.data_ptr(),
                    region["rkey"],
                    t.size(0),
                    t.size(1),
                    row_bytes,
                    item,
                    str(t.dtype).removeprefix("torch."),
                    writable,
                ]
            )
        if flags is not None:
            check_flag_words(
                flags,
                flags.device.type,
                f"verbs_native: rank {rank}'s flags",
                "pass the rank's int32 flag words",
            )
            self.flags = flags
            self.shadow = torch.zeros(flags.numel(), dtype=torch.int64)
            self.n_events = flags.numel()
        payload = {"buffers": layout, "events": self.n_events}
        self.store.set(f"{self.prefix}/layout/{rank}", json.dumps(payload))

    def connect(self, rank: int, peer: int) -> None:
        """Create the queue pair to ``peer`` and publish its address; the pair is brought up
        (RTR, RTS) when the proxy attaches, once the peer published its side."""
        self._check_open("connect")
        if rank != self.rank or peer == rank or peer in self.peers:
            if rank == self.rank and (peer == rank or peer in self.peers):
                return
            raise ProxyError(
                f"verbs_native: connect({rank}, {peer}) on rank {self.rank}'s transport"
            )
        try:
            qp = self.nic.create_qp(rank, peer)
        except RuntimeError as exc:
            raise ProxyError(f"verbs_native: {exc}") from None
        qp["gid"] = qp["gid"].hex()
        self.store.set(f"{self.prefix}/qp/{rank}/{peer}", json.dumps(qp))
        self.peers.append(peer)

    def _bring_up(self) -> None:
        for peer in self.peers:
            if self.nic.connected(self.rank, peer):
                continue
            what = f"rank {peer}'s queue pair"
            theirs = json.loads(
                store_get(self.store, f"{self.prefix}/qp/{peer}/{self.rank}", self.timeout, what)
            )
            layout = json.loads(
                store_get(
                    self.store,
                    f"{self.prefix}/layout/{peer}",
                    self.timeout,
                    f"rank {peer}'s layout",
                )
            )
            try:
                self.nic.connect(
                    self.rank,
                    peer,
                    theirs["qp_num"],
                    theirs["psn"],
                    theirs["lid"],
                    bytes.fromhex(theirs["gid"]),
                )
            except RuntimeError as exc:
                raise ProxyError(f"verbs_native: {exc}") from None
            self.remote[peer] = layout

    def check_region(self, rank: int, rect: Rect) -> torch.dtype:
        if rank in self.memory or rank not in self.remote:
            return super().check_region(rank, rect)
        from mgraph.graph import torch_dtype

        shapes = {b[0]: (b[3], b[4], torch_dtype(b[7])) for b in self.remote[rank]["buffers"]}
        return self.check_remote_region(rank, rect, shapes)

    def attach_native(self, drain: object, rank: int, counters: dict[int, torch.Tensor]) -> None:
        native = load()
        self._check_open("attach_native")
        if rank != self.rank:
            raise ProxyError(f"verbs_native: the proxy of rank {rank} on rank {self.rank}'s NIC")
        self._bring_up()
        try:
            drain.use_verbs(self.nic)
        except ValueError as exc:
            raise ProxyError(f"verbs_native: {exc}", hint="Settings(proxy_streams=1)") from None
        cuda = "cuda" in self.places.values()
        if cuda:
            runtime, driver = self.cuda_libs or cuda_libraries()
            failure = drain.use_cuda(max(self.cuda_device, 0), runtime, driver)
            if failure:
                raise ProxyError(f"verbs_native: {failure}")
        for index, tensor in self.memory.get(rank, {}).items():
            place = native.PLACE_CUDA if self.places[index] == "cuda" else native.PLACE_HOST
            add_tensor(drain, rank, place, index, tensor, max(self.cuda_device, 0) if cuda else -1)
        if self.flags is not None and cuda:
            assert self.shadow is not None
            drain.set_cuda_flags(
                rank, self.flags.data_ptr(), self.flags.numel(), self.shadow.data_ptr()
            )
        elif self.flags is not None:
            drain.set_host_flags(rank, self.flags.data_ptr(), self.flags.numel())
        elif rank in counters:
            drain.set_host_events(rank, counters[rank].data_ptr(), counters[rank].numel())
        for peer, layout in self.remote.items():
            for index, addr, rkey, rows, cols, row_bytes, item, dtype, writable in layout[
                "buffers"
            ]:
                drain.add_remote_buffer(
                    peer, index, addr, rkey, rows, cols, row_bytes, item, dtype, writable
                )
            drain.set_remote_events(peer, layout["events"])

    def stats(self) -> dict[str, int]:
        """The NIC's counters: post calls, work requests, immediates, completions, staging."""
        return dict(self.nic.stats())

    # -- no Python data path ----------------------------------------------------------------
    def _native_only(self, what: str) -> ProxyError:
        return ProxyError(
            f"verbs_native: {what} has no Python path; the native proxy drives this transport",
            hint="NativeProxy(fifo, transport, ...), or VerbsTransport for the Python proxy",
        )

    def write(
        self,
        src_rank: int,
        src: torch.Tensor,
        dst_rank: int,
        dst: Rect,
        events: Sequence[int] = (),
        epoch: int = 0,
    ) -> int:
        raise self._native_only("write")

    def signal(self, src_rank: int, dst_rank: int, event: int, epoch: int = 0) -> int:
        raise self._native_only("signal")

    def poll(self, rank: int | None = None) -> list[int]:
        return []  # the native loop raises "sent" events itself

    def close(self) -> None:
        self.closed = True  # the NIC closes when the last proxy holding it is gone
