"""The megakernel's network side: one command FIFO, host proxy and transport per process.

``Settings.transport`` picks the transport. ``auto`` (and ``inprocess``, what auto picks under
the interpreter):

On the GPU (one process per rank, torchrun) the FIFO ring and tail are pinned host memory the
kernel writes and reads through UVA, the ticket counter ``dhead`` is device memory, and the
native proxy drains the ring through the ``cuda_ipc`` transport: GPUs of this host act as nodes,
a WRITE is a copy-engine copy into the peer's buffer and its events are stream memory writes of
the peer's net words (netplan.py). The peers' memory is already mapped into this process by the
symmetric-memory rendezvous the runtime does for its arena and flags, so the transport registers
it as mapped memory instead of exchanging IPC handles. ``nic_gbps`` paces the copies like a NIC.

Under Triton's interpreter (CI) one process holds every rank: the FIFO lives in ordinary memory,
the proxy copies with memmove through the in-process transport and raises int32 host flags, and
the single interpreted program runs every rank's tasks, pushes included. The protocol, the
tables and the proxy are the ones the GPU uses.

``verbs``: the native proxy's verbs backend (proxy/verbs_native.py, native/verbs.h). Each rank
has its own NIC context (``NativeVerbsTransport``) with its buffers and net words registered
(GPU memory through dma-buf, nvidia-peermem or, for sending only, host staging), an RC queue
pair to every peer it exchanges data with (netplan.py's ``peers``), set up through the
torch.distributed store, and its own native proxy: a WRITE is an RDMA WRITE WITH IMMEDIATE into
the peer's registered buffer, and the PEER's proxy raises the net word named by the immediate.
So every net word of a rank has one writer, that rank's own proxy. On the GPU the process's one
rank gets one proxy; under the interpreter each rank gets one, and a ``FifoSplitter`` moves the
one program's commands onto the FIFO of their source rank. A missing libibverbs or no RDMA
device is RdmaUnavailableError when the runtime is built, before any launch.

The proxies live as long as the runtime (``close`` stops them): their per-word running counts
(the shadows) must persist across launches, like the flag words they mirror.
"""

from __future__ import annotations

import atexit
import itertools
import weakref
from typing import TYPE_CHECKING

import torch

from mgraph.errors import MgraphError, ProxyError

from ..proxy import CommandFifo, InProcessTransport, Opcode
from ..proxy.native import NativeProxy, load
from ..proxy.split import FifoSplitter

if TYPE_CHECKING:
    from mgraph.graph import TaskGraph

    from ..proxy.transport import Transport
    from ..proxy.verbs_native import NativeVerbsTransport
    from .netplan import NetPlan
    from .runtime import TritonRuntime

__all__ = ["KernelNet"]

MAX_SLOTS = 4096
_LIVE: weakref.WeakSet = weakref.WeakSet()  # nets whose proxy threads may still run
# Store keys of one runtime's verbs rendezvous: every process builds its runtimes in the same
# order (SPMD), so the n-th verbs runtime of each process meets the n-th of the others.
_VERBS_RUNTIMES = itertools.count()


@atexit.register
def _abort_live() -> None:
    """A runtime nobody closed (e.g. one cached by mg.run) must not leave its proxies spinning
    on a core while the interpreter shuts down: abort them (dropping nothing: no kernel runs
    now)."""
    for net in list(_LIVE):
        if not net.closed:
            net.closed = True
            net.abort()


class KernelNet:
    def __init__(self, rt: TritonRuntime) -> None:
        load()  # the native proxy is required: a clear error if it was not built
        lay, graph, settings = rt.layout, rt.graph, rt.settings
        plan = lay.net
        assert plan is not None
        self.plan = plan
        self.rt = rt
        self.error: ProxyError | None = None
        self.closed = False
        gpu = not rt.interpret
        kind = _transport_kind(settings.transport, gpu, settings.proxy_streams)
        if gpu and kind != "verbs":
            _check_shared_gpu(rt)
        per_launch = sum(len(c) for c in plan.commands.values()) + sum(map(len, plan.peers))
        want = max(settings.fifo_slots, min(per_launch, MAX_SLOTS), 2)
        self.slots = 1 << (want - 1).bit_length()
        self.fifo = CommandFifo(self.slots, timeout=settings.watchdog_s, pinned=gpu)
        # The GPU claims tickets with device atomics; the interpreter can use the host counter.
        self.dhead = torch.zeros(1, dtype=torch.int64, device=rt.device) if gpu else self.fifo.head
        lo, hi = lay.net_base, lay.net_base + plan.count
        self.transports: list[Transport] = []
        self.proxies: list[NativeProxy] = []
        self.splitter: FifoSplitter | None = None
        if kind == "verbs":
            self._verbs(rt, plan, lo, hi)
        else:
            if gpu:
                transport = self._cuda_ipc(rt, plan, lo, hi)
                local = rt.rank
            else:
                transport = InProcessTransport(_no_callback, graph.topology)
                for r in graph.topology.ranks:
                    transport.register(r, _buffers(rt, r, rt.shared.arenas[r], plan))
                    transport.register_flags(r, rt.shared.flags[r][lo:hi])
                for r in graph.topology.ranks:  # one proxy serves every rank: reach them all
                    for q in graph.topology.ranks:
                        if q > r:
                            transport.connect(r, q)
                local = 0
            self.transports.append(transport)
            name = f"rank{local}" if gpu else "interpreter"
            self.proxies.append(self._proxy(self.fifo, transport, local, name))
        self.transport, self.proxy = self.transports[0], self.proxies[0]
        for p in self.proxies:
            p.start()
        if self.splitter is not None:
            self.splitter.start()
        _LIVE.add(self)

    # -- set-up -------------------------------------------------------------------------------
    def _proxy(self, fifo: CommandFifo, transport: Transport, rank: int, name: str) -> NativeProxy:
        s = self.rt.settings
        return NativeProxy(
            fifo,
            transport,
            s.proxy_batch,
            rank=rank,
            name=name,
            timeout=s.watchdog_s,
            on_error=self._failed,
            bandwidth=s.nic_gbps * 1e9,
            idle_sleep_us=0 if not self.rt.interpret else 200,
            flag_copy=s.gpu_flags == "copy",
            streams=s.proxy_streams,  # lanes come from netplan.py
            copy_kernel_bytes=s.proxy_copy_kernel_bytes,
        )

    @staticmethod
    def _cuda_ipc(rt: TritonRuntime, plan: NetPlan, lo: int, hi: int) -> Transport:
        import torch.distributed as dist

        from ..proxy.cuda_ipc import CudaIpcTransport

        rank, dev = rt.rank, rt.device
        transport = CudaIpcTransport(
            dist.distributed_c10d._get_default_store(),
            {rank: dev.index},
            rt.graph.topology,
            bandwidth=rt.settings.nic_gbps * 1e9,
        )
        transport.register_mapped(rank, _buffers(rt, rank, rt.arena, plan), rt.flags[lo:hi])
        for q in plan.peers[rank]:
            arena = rt.arena_handle.get_buffer(q, (rt.layout.arena_bytes,), torch.uint8)
            flags = rt.flags_handle.get_buffer(q, (rt.layout.flag_words,), torch.int32)
            transport.register_mapped(q, _buffers(rt, q, arena, plan), flags[lo:hi])
            transport.connect(rank, q)
        return transport

    def _verbs(self, rt: TritonRuntime, plan: NetPlan, lo: int, hi: int) -> None:
        """One NIC context, queue pairs and native proxy per rank of this process (see the
        module docstring); every transport is built, registered and connected before any proxy
        brings its queue pairs up, since that waits for the peers' addresses."""
        import torch.distributed as dist

        from ..proxy.verbs_native import NativeVerbsTransport

        graph, settings = rt.graph, rt.settings
        if rt.interpret:
            store = dist.HashStore()  # every rank is in this process
            ranks = list(graph.topology.ranks)
            memory = {r: (rt.shared.arenas[r], rt.shared.flags[r]) for r in ranks}
            timeout = settings.watchdog_s
        else:
            store = dist.distributed_c10d._get_default_store()
            ranks = [rt.rank]
            memory = {rt.rank: (rt.arena, rt.flags)}
            # Connecting waits for the peers to START: seconds of skew, not a stuck peer.
            timeout = max(30.0, settings.watchdog_s)
        prefix = f"mgraph/megakernel/verbs/{next(_VERBS_RUNTIMES)}"
        device = rt.device.index if not rt.interpret else -1
        for r in ranks:
            transport = NativeVerbsTransport(
                store,
                r,
                graph.topology,
                max_peers=max(8, len(plan.peers[r])),
                timeout=timeout,
                prefix=prefix,
                cuda_device=device,
            )
            self.transports.append(transport)
            arena, flags = memory[r]
            transport.register(r, _buffers(rt, r, arena, plan), flags[lo:hi])
            for q in plan.peers[r]:
                transport.connect(r, q)
        if rt.interpret and len(ranks) > 1:
            fifos = {r: CommandFifo(self.slots, timeout=settings.watchdog_s) for r in ranks}
        else:
            fifos = {ranks[0]: self.fifo}
        for r, transport in zip(ranks, self.transports, strict=True):
            self.proxies.append(self._proxy(fifos[r], transport, r, f"rank{r}-verbs"))
        for r, transport in zip(ranks, self.transports, strict=True):
            check_writable(graph, plan, r, transport)  # (the proxies have not started)
        if fifos[ranks[0]] is not self.fifo:
            self.splitter = FifoSplitter(
                self.fifo,
                fifos,
                batch=settings.proxy_batch,
                timeout=settings.watchdog_s,
                on_error=self._failed,
            )

    def _failed(self, err: ProxyError) -> None:
        """A proxy stopped on a bad command: abort the kernel's waits now (not at the
        watchdog). On the GPU through a copy-engine copy: no kernel launch while ours spins."""
        if self.error is None:
            self.error = err
        abort = self.rt.d["abort"]
        if self.rt.interpret:
            abort.fill_(1)
            return
        one = torch.ones(1, dtype=torch.int32, pin_memory=True)
        with torch.cuda.device(abort.device), torch.cuda.stream(torch.cuda.Stream(abort.device)):
            abort.copy_(one, non_blocking=True)

    # -- per launch ---------------------------------------------------------------------------
    def check(self) -> None:
        if self.error is not None:
            raise self.error
        if self.splitter is not None:
            self.splitter.check()
        for p in self.proxies:
            p.check()

    def abort(self) -> None:
        """End the splitter and every proxy now, dropping what is queued."""
        if self.splitter is not None:
            self.splitter.abort()
        for p in self.proxies:
            p.abort()

    def close(self) -> None:
        """Stop the proxies (after the kernel finished: everything pushed has been executed)."""
        if self.closed:
            return
        self.closed = True
        errors: list[MgraphError] = []
        if self.error is not None or self.rt.failed is not None:
            self.abort()
        else:
            if self.dhead is not self.fifo.head:  # the drain stops once head == tail
                self.fifo.head[0] = int(self.dhead.item())
            if self.splitter is not None:
                try:
                    self.splitter.stop()
                except MgraphError as exc:
                    errors.append(exc)
                    self.abort()
            for p in self.proxies:
                try:
                    p.stop()
                except MgraphError as exc:  # report the first; still stop the others
                    errors.append(exc)
        for t in self.transports:
            t.close()
        if errors:
            raise errors[0]


def _check_shared_gpu(rt: TritonRuntime) -> None:
    """Refuse, before anything is started, a schedule whose proxies' copies would never find a
    free SM (shared_gpu.py): ranks sharing this GPU (ipc_share.py), whose WRITEs are same-device
    copies run as kernels, or the proxy's copy-and-flag kernel (MGRAPH_PROXY_COPY_KERNEL_BYTES),
    which is a kernel wherever it runs."""
    from .ipc_share import IpcBuffers
    from .shared_gpu import COPY_KERNEL, SHARED, check_shared_gpu

    shared = isinstance(getattr(rt, "arena_handle", None), IpcBuffers)
    kernel = getattr(getattr(rt, "settings", None), "proxy_copy_kernel_bytes", 0) > 0
    if shared or kernel:
        sms = torch.cuda.get_device_properties(rt.device).multi_processor_count
        check_shared_gpu(rt.schedule, sms, why=SHARED if shared else COPY_KERNEL)


def _transport_kind(kind: str, gpu: bool, streams: int) -> str:
    """``auto`` or ``verbs`` (see the module docstring); ProxyError for what the megakernel's
    network does not offer."""
    if kind == "auto" or (kind == "inprocess" and not gpu):
        return "auto"
    if kind == "verbs":
        if streams != 1:
            raise ProxyError(
                f"MGRAPH_TRANSPORT=verbs with proxy_streams={streams}: the verbs backend posts "
                "one queue pair's requests in order and raises GPU words from one stream",
                hint="Settings(proxy_streams=1) / MGRAPH_PROXY_STREAMS=1 with verbs",
            )
        return "verbs"
    raise ProxyError(
        f"the megakernel's network has no {kind!r} transport"
        + (" on the GPU (one process per rank)" if kind == "inprocess" else ""),
        hint="MGRAPH_TRANSPORT=auto (cuda_ipc between GPUs of a host; in-process under the "
        "interpreter) or verbs (RDMA); tcp serves the CPU reference runtime only",
    )


def check_writable(
    graph: TaskGraph, plan: NetPlan, rank: int, transport: NativeVerbsTransport
) -> None:
    """ProxyError unless the NIC of ``rank`` could register every buffer its peers WRITE into
    (GPU memory without dma-buf or nvidia-peermem is staged: it can be sent from, never written
    into), found before the first launch instead of at the first write."""
    into = sorted(
        {
            c.dst.buffer
            for cmds in plan.commands.values()
            for c in cmds
            if c.opcode == Opcode.WRITE and c.dst_rank == rank
        }
    )
    staged = [i for i in into if transport.memory_kinds.get(i) == "staged"]
    if staged:
        names = {i: b for b, i in plan.buffer_index.items() if graph.buffers[b].rank == rank}
        raise ProxyError(
            f"MGRAPH_TRANSPORT=verbs: rank {rank}'s NIC could not register buffer(s) "
            f"{[names[i] for i in staged]} that peers write into (GPU memory without "
            "dma-buf or nvidia-peermem); host staging covers only the sending side",
            hint="load nvidia-peermem, or use a kernel and driver with dma-buf support",
        )


def _buffers(rt: TritonRuntime, rank: int, arena: torch.Tensor, plan) -> dict[int, torch.Tensor]:
    """``rank``'s buffers by their registered index, as 2-D views of its arena."""
    from .runtime import arena_views

    views = arena_views(rt.graph, rt.layout, rank, arena)
    return {plan.buffer_index[b]: v for b, v in views.items()}


def _no_callback(rank: int, event: int, epoch: int) -> None:
    raise ProxyError(
        f"interpreter network: event {event} of rank {rank} has no int32 flags registered",
        hint="every rank registers its net words with register_flags",
    )
