"""The reference runtime's network: one command FIFO and host proxy per rank, one transport.

An RDMA worker does what the GPU's does: it encodes its task as FIFO commands (a WRITE carrying
the first destination event and the first source "done" event, then SIGNALs for any further
events, which the proxy executes in ring order after the write) and returns without waiting.
The rank's proxy drains the ring through the transport, which copies into the peer's registered
buffer and raises the events on the runtime's counters.

What lives across launches: the transport, the registered memory and the connections (a tcp
rendezvous happens once). What is made per launch: the FIFOs and proxies, and the commands,
which carry the launch epoch. The proxy is the native drain loop or the Python one
(``Settings.proxy``); the transport is in-process when this process holds every rank, and tcp
(or verbs, with the Python proxy) between processes that each hold some nodes
(``Settings.transport``). Between processes a launch starts
with a barrier through the store (no peer may write into buffers this process has not reset yet)
and ends with a fence on every connection (every write a peer sent this launch has landed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mgraph.errors import MgraphError, ProxyError
from mgraph.graph import Task
from mgraph.kinds import Role
from mgraph.settings import Settings

from .proxy import Command, CommandFifo, InProcessTransport, Proxy, Rect, Transport
from .proxy.native import NativeProxy
from .proxy.tcp import TcpTransport
from .proxy.verbs import VerbsTransport
from .proxy.wire import store_barrier

if TYPE_CHECKING:
    from .reference import ReferenceRuntime

__all__ = ["Network"]


class Network:
    def __init__(
        self,
        runtime: ReferenceRuntime,
        settings: Settings,
        *,
        store: object = None,
        tag: str = "mgraph",
    ) -> None:
        graph = runtime.graph
        self.runtime = runtime
        self.settings = settings
        self.local = list(runtime.local_ranks)
        self.store = store
        self.tag = tag
        self.epoch = 0
        self.proxies: dict[int, Proxy | NativeProxy] = {}
        self.fifos: dict[int, CommandFifo] = {}
        self.commands: dict[int, list[Command]] = {}
        kind = settings.transport
        if kind == "auto":
            kind = "inprocess" if len(self.local) == graph.topology.world_size else "tcp"
        self.kind = kind
        # Registered memory: each rank's buffers by index, in graph order (the same in every
        # process, so an index means the same buffer on both ends of a connection).
        self.index: dict[str, int] = {}
        per_rank: dict[int, dict[int, object]] = {r: {} for r in graph.topology.ranks}
        for buf in graph.buffers.values():
            idx = len(per_rank[buf.rank])
            self.index[buf.id] = idx
            per_rank[buf.rank][idx] = runtime.memory[buf.id]
        self.transport = self._make_transport(kind, store)
        self.remote = isinstance(self.transport, (TcpTransport, VerbsTransport))
        for rank in self.local:
            if self.remote:  # peers check event ids against the count
                self.transport.register(rank, per_rank[rank], n_events=len(graph.events))
            else:
                self.transport.register(rank, per_rank[rank])
        pairs: set[tuple[int, int]] = set()
        for t in graph.tasks:
            if t.role == Role.RDMA.value:
                src, dst = t.rank, graph.buffers[t.writes[0].buffer].rank
                if src in self.local:
                    pairs.add((src, dst))
                elif dst in self.local:
                    pairs.add((dst, src))
        for rank, peer in sorted(pairs):
            self.transport.connect(rank, peer)

    def _make_transport(self, kind: str, store: object) -> Transport:
        topology = self.runtime.graph.topology
        if kind == "inprocess":
            if len(self.local) != topology.world_size:
                raise ProxyError(
                    f"transport 'inprocess' needs every rank in this process; it holds "
                    f"{self.local} of {topology.world_size}",
                    hint="use transport='tcp' (Settings.transport) between processes",
                )
            return InProcessTransport(self._raise, topology)
        if store is None:
            raise ProxyError(
                f"transport {kind!r} needs a torch.distributed store for the rendezvous",
                hint="pass store=... (torch.distributed.TCPStore, or the default store under "
                "torchrun) to ReferenceRuntime",
            )
        # Connecting waits for the other processes to START (import torch, build the graph):
        # seconds of skew that have nothing to do with a stuck peer, hence the 30 s floor here
        # only. Launch barriers and fences below are bounded by the watchdog alone.
        timeout = max(30.0, self.settings.watchdog_s)
        if kind == "verbs":
            return VerbsTransport(
                store,
                self._raise,
                topology,
                self.local,
                timeout=timeout,
                prefix=f"{self.tag}/verbs",
                on_error=self.runtime.fail,
            )
        return TcpTransport(
            store,
            self._raise,
            topology,
            self.local,
            host=self.settings.tcp_host,
            timeout=timeout,
            prefix=f"{self.tag}/tcp",
            on_error=self.runtime.fail,
        )

    def _encode(self, task: Task, epoch: int) -> list[Command]:
        graph = self.runtime.graph
        src_reg, dst_reg = task.reads[0], task.writes[0]
        dst_rank = graph.buffers[dst_reg.buffer].rank
        dst_events = [e for e in task.signals if graph.events[e].rank == dst_rank]
        src_events = [e for e in task.signals if graph.events[e].rank == task.rank]
        nbytes = graph.region_bytes(src_reg)
        cmds = [
            Command.write(
                task.rank,
                Rect(self.index[src_reg.buffer], *src_reg[1:]),
                dst_rank,
                Rect(self.index[dst_reg.buffer], *dst_reg[1:]),
                bytes=nbytes,
                event=dst_events[0] if dst_events else -1,
                done_event=src_events[0] if src_events else -1,
                epoch=epoch,
                task=task.id,
            )
        ]
        cmds += [
            Command.signal(task.rank, dst_rank, e, epoch=epoch, task=task.id)
            for e in dst_events[1:]
        ]
        cmds += [
            Command.signal(task.rank, task.rank, e, epoch=epoch, task=task.id)
            for e in src_events[1:]
        ]
        return cmds

    def _raise(self, rank: int, event: int, epoch: int) -> None:
        if epoch != self.epoch:  # epoch-tagged: a stale or early arrival is a protocol error
            raise ProxyError(
                f"event {event} on rank {rank} arrived tagged with launch {epoch} during launch "
                f"{self.epoch}",
                hint="a peer process runs a different launch: launches must be collective",
            )
        self.runtime.counters.add(event)

    # -- one launch ---------------------------------------------------------------------------
    def launch(self, epoch: int) -> None:
        """Commands, FIFOs and proxies for launch ``epoch``; started, after the peers are ready."""
        rt, s = self.runtime, self.settings
        self.epoch = epoch
        self.transport.begin(epoch)
        if self.remote:
            if self.transport.error is not None:
                raise self.transport.error
            store_barrier(
                self.store,
                f"{self.tag}/launch/{epoch}",
                rt.processes,
                s.watchdog_s,
                failed=lambda: rt.counters.aborted,
            )
        self.commands = {
            t.id: self._encode(t, epoch)
            for t in rt.graph.tasks
            if t.role == Role.RDMA.value and t.rank in self.local
        }
        slots = 1 << max(1, (s.fifo_slots - 1).bit_length())  # a power of two
        senders = sorted({rt.graph.tasks[t].rank for t in self.commands})  # ranks with RDMA work
        self.fifos = {r: CommandFifo(slots, timeout=s.watchdog_s) for r in senders}
        self.proxies = {}
        for r in senders:
            if s.proxy == "native":
                self.proxies[r] = NativeProxy(
                    self.fifos[r],
                    self.transport,
                    s.proxy_batch,
                    rank=r,
                    counters={q: rt.counters.tensor for q in self.local},
                    name=f"rank{r}",
                    timeout=s.watchdog_s,
                    on_error=rt.fail,
                    doorbell_fd=rt.counters.doorbell(),
                    bandwidth=s.nic_gbps * 1e9,
                )
            else:
                self.proxies[r] = Proxy(
                    self.fifos[r],
                    self.transport,
                    s.proxy_batch,
                    name=f"rank{r}",
                    timeout=s.watchdog_s,
                    on_error=rt.fail,
                )
        for p in self.proxies.values():
            p.start()

    def submit(self, task: Task, worker: int, start: float) -> None:
        """Push the task's commands (the GPU RDMA worker's job) and record the push."""
        fifo = self.fifos[task.rank]
        for cmd in self.commands[task.id]:
            fifo.push(cmd)
        self.runtime.record(task, worker, start)

    def finish(self, drain: bool = True) -> None:
        """Stop the proxies (executing what is queued when ``drain``); between processes, wait
        until every peer's writes of this launch landed here, or (a failed launch) cut the tcp
        connections so the peers fail too."""
        errors: list[BaseException] = []
        for p in self.proxies.values():
            try:
                if drain:
                    p.stop()
                elif isinstance(p, NativeProxy):
                    p.abort()
                else:
                    p.stop(0.5)
            except MgraphError as exc:  # report the first; still stop the others
                errors.append(exc)
        if errors and drain:
            raise errors[0]
        if not drain and isinstance(self.transport, TcpTransport):
            self.transport.abort()  # the peers learn of the failure now, not at their watchdog
        if drain and self.remote:
            self.transport.fence(self.epoch, timeout=self.settings.watchdog_s)

    def stats(self) -> dict[str, int]:
        out = {"commands": 0, "batches": 0, "coalesced": 0, "rdma_bytes": 0}
        for p in self.proxies.values():
            st = p.stats
            out["commands"] += st.commands
            out["batches"] += st.batches
            out["coalesced"] += st.coalesced
            out["rdma_bytes"] += st.bytes
        return out

    def bytes_by_nodes(self) -> dict[tuple[int, int], int]:
        return dict(self.transport.bytes_by_nodes)

    def close(self) -> None:
        self.transport.close()
