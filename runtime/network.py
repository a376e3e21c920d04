"""The reference runtime's network: one command FIFO and host proxy per rank, one transport.

An RDMA worker does what the GPU's does: it encodes its task as FIFO commands (a WRITE carrying
the first destination event and the first source "done" event, then SIGNALs for any further
events, which the proxy executes in ring order after the write) and returns without waiting.
The rank's proxy drains the ring through the in-process transport, which copies into the peer's
registered buffer and raises the events on the runtime's counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mgraph.graph import Task
from mgraph.kinds import Role
from mgraph.settings import Settings

from .proxy import Command, CommandFifo, InProcessTransport, Proxy, Rect

if TYPE_CHECKING:
    from .reference import ReferenceRuntime

__all__ = ["Network"]


class Network:
    def __init__(self, runtime: ReferenceRuntime, settings: Settings) -> None:
        graph = runtime.graph
        self.runtime = runtime
        self.transport = InProcessTransport(self._raise, graph.topology)
        # Registered memory: each rank's buffers by index, in graph order.
        self.index: dict[str, int] = {}
        per_rank: dict[int, dict[int, object]] = {r: {} for r in graph.topology.ranks}
        for buf in graph.buffers.values():
            idx = len(per_rank[buf.rank])
            self.index[buf.id] = idx
            per_rank[buf.rank][idx] = runtime.memory[buf.id]
        for rank, bufs in per_rank.items():
            self.transport.register(rank, bufs)
        self.commands: dict[int, list[Command]] = {}
        for t in graph.tasks:
            if t.role == Role.RDMA.value:
                self.commands[t.id] = self._encode(t, runtime.epoch)
                src, dst = t.rank, graph.buffers[t.writes[0].buffer].rank
                if frozenset((src, dst)) not in self.transport.connections:
                    self.transport.connect(src, dst)
        slots = 1 << max(1, (settings.fifo_slots - 1).bit_length())  # a power of two
        self.fifos = {r: CommandFifo(slots, timeout=settings.watchdog_s) for r in graph.topology.ranks}
        self.proxies = {
            r: Proxy(self.fifos[r], self.transport, settings.proxy_batch, name=f"rank{r}",
                     timeout=settings.watchdog_s)
            for r in graph.topology.ranks
        }

    def _encode(self, task: Task, epoch: int) -> list[Command]:
        graph = self.runtime.graph
        src_reg, dst_reg = task.reads[0], task.writes[0]
        dst_rank = graph.buffers[dst_reg.buffer].rank
        dst_events = [e for e in task.signals if graph.events[e].rank == dst_rank]
        src_events = [e for e in task.signals if graph.events[e].rank == task.rank]
        nbytes = graph.region_bytes(src_reg)
        cmds = [
            Command.write(
                task.rank, Rect(self.index[src_reg.buffer], *src_reg[1:]),
                dst_rank, Rect(self.index[dst_reg.buffer], *dst_reg[1:]),
                bytes=nbytes, event=dst_events[0] if dst_events else -1,
                done_event=src_events[0] if src_events else -1, epoch=epoch, task=task.id,
            )
        ]
        cmds += [Command.signal(task.rank, dst_rank, e, epoch=epoch, task=task.id) for e in dst_events[1:]]
        cmds += [Command.signal(task.rank, task.rank, e, epoch=epoch, task=task.id) for e in src_events[1:]]
        return cmds

    def _raise(self, rank: int, event: int, epoch: int) -> None:
        self.runtime.counters.add(event)

    # -- run-time -----------------------------------------------------------------------------
    def start(self) -> None:
        for p in self.proxies.values():
            p.start()

    def submit(self, task: Task, worker: int, start: float) -> None:
        """Push the task's commands (the GPU RDMA worker's job) and record the push."""
        fifo = self.fifos[task.rank]
        for cmd in self.commands[task.id]:
            fifo.push(cmd)
        self.runtime.record(task, worker, start)

    def stop(self, drain: bool = True) -> None:
        errors = []
        for p in self.proxies.values():
            try:
                p.stop(None if drain else 0.5)
            except Exception as exc:  # report the first; still stop the others
                errors.append(exc)
        self.transport.close()
        if errors and drain:
            raise errors[0]

    def stats(self) -> dict[str, int]:
        out = {"commands": 0, "batches": 0, "coalesced": 0, "rdma_bytes": self.transport.bytes_total}
        for p in self.proxies.values():
            out["commands"] += p.stats.commands
            out["batches"] += p.stats.batches
            out["coalesced"] += p.stats.coalesced
        return out

    def bytes_by_nodes(self) -> dict[tuple[int, int], int]:
        return dict(self.transport.bytes_by_nodes)
