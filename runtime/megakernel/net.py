"""The megakernel's network side: one command FIFO, host proxy and transport per process.

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

The proxy lives as long as the runtime (``close`` stops it): its per-word running counts (the
shadows) must persist across launches, like the flag words they mirror.
"""

from __future__ import annotations

import atexit
import weakref
from typing import TYPE_CHECKING

import torch

from mgraph.errors import ProxyError

from ..proxy import CommandFifo, InProcessTransport
from ..proxy.native import NativeProxy, load

if TYPE_CHECKING:
    from .runtime import TritonRuntime

__all__ = ["KernelNet"]

MAX_SLOTS = 4096
_LIVE: weakref.WeakSet = weakref.WeakSet()  # nets whose proxy thread may still run


@atexit.register
def _abort_live() -> None:
    """A runtime nobody closed (e.g. one cached by mg.run) must not leave its proxy spinning on
    a core while the interpreter shuts down: abort it (dropping nothing: no kernel runs now)."""
    for net in list(_LIVE):
        if not net.closed:
            net.closed = True
            net.proxy.abort()


class KernelNet:
    def __init__(self, rt: TritonRuntime) -> None:
        load()  # the native proxy is required: a clear error if it was not built
        lay, graph, settings = rt.layout, rt.graph, rt.settings
        plan = lay.net
        assert plan is not None
        self.plan = plan
        self.rt = rt
        self.error: ProxyError | None = None
        per_launch = sum(len(c) for c in plan.commands.values()) + sum(map(len, plan.peers))
        want = max(settings.fifo_slots, min(per_launch, MAX_SLOTS), 2)
        slots = 1 << (want - 1).bit_length()
        gpu = not rt.interpret
        self.fifo = CommandFifo(slots, timeout=settings.watchdog_s, pinned=gpu)
        # The GPU claims tickets with device atomics; the interpreter can use the host counter.
        self.dhead = (
            torch.zeros(1, dtype=torch.int64, device=rt.device) if gpu else self.fifo.head
        )
        lo, hi = lay.net_base, lay.net_base + plan.count
        if gpu:
            self.transport = self._cuda_ipc(rt, plan, lo, hi)
            local = rt.rank
        else:
            self.transport = InProcessTransport(_no_callback, graph.topology)
            for r in graph.topology.ranks:
                self.transport.register(r, _buffers(rt, r, rt.shared.arenas[r], plan))
                self.transport.register_flags(r, rt.shared.flags[r][lo:hi])
            for r in graph.topology.ranks:  # one proxy serves every rank: reach them all
                for q in graph.topology.ranks:
                    if q > r:
                        self.transport.connect(r, q)
            local = 0
        self.proxy = NativeProxy(
            self.fifo,
            self.transport,
            settings.proxy_batch,
            rank=local,
            name=f"rank{local}" if gpu else "interpreter",
            timeout=settings.watchdog_s,
            on_error=self._failed,
            bandwidth=settings.nic_gbps * 1e9,
            idle_sleep_us=0 if gpu else 200,
            flag_copy=settings.gpu_flags == "copy",
            streams=settings.proxy_streams,  # lanes come from netplan.py
        )
        self.closed = False
        self.proxy.start()
        _LIVE.add(self)

    # -- set-up -------------------------------------------------------------------------------
    @staticmethod
    def _cuda_ipc(rt: TritonRuntime, plan, lo: int, hi: int):
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

    def _failed(self, err: ProxyError) -> None:
        """The proxy stopped on a bad command: abort the kernel's waits now (not at the
        watchdog). On the GPU through a copy-engine copy: no kernel launch while ours spins."""
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
        self.proxy.check()

    def close(self) -> None:
        """Stop the proxy (after the kernel finished: everything pushed has been executed)."""
        if self.closed:
            return
        self.closed = True
        if self.error is not None or self.rt.failed is not None:
            self.proxy.abort()
        else:
            if self.dhead is not self.fifo.head:  # the drain stops once head == tail
                self.fifo.head[0] = int(self.dhead.item())
            self.proxy.stop()
        self.transport.close()


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
