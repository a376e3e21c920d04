"""TaskGraph statistics: tasks per (rank, role, kind), flops per rank, bytes per link class/node.

Bytes count what crosses a link: any task's reads and writes of another rank's memory (an nvlink
task's copies, a compute task's epilogue stores into a peer), an rdma task's writes to its rail
peer. This is how hierarchical movement is checked: all-reduce of D
bytes over 2 nodes moves D per node over RDMA, not G x D.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .graph import ITEMSIZE, TaskGraph

__all__ = ["GraphStats", "graph_stats"]


@dataclass
class GraphStats:
    tasks: Counter = field(default_factory=Counter)  # (rank, role, kind) -> count
    flops_per_rank: list[float] = field(default_factory=list)
    bytes_by_link: dict[str, int] = field(default_factory=dict)  # nvlink / rdma
    rdma_sent_per_node: list[int] = field(default_factory=list)
    rdma_received_per_node: list[int] = field(default_factory=list)
    nvlink_per_node: list[int] = field(default_factory=list)

    @property
    def total_tasks(self) -> int:
        return sum(self.tasks.values())

    def by_role_kind(self) -> Counter:
        out: Counter = Counter()
        for (_, role, kind), n in self.tasks.items():
            out[(role, kind)] += n
        return out

    def by_kind(self) -> Counter:
        out: Counter = Counter()
        for (_, _, kind), n in self.tasks.items():
            out[kind] += n
        return out

    def to_dict(self) -> dict:
        return {
            "tasks": [
                {"rank": r, "role": role, "kind": k, "count": n}
                for (r, role, k), n in sorted(self.tasks.items())
            ],
            "total_tasks": self.total_tasks,
            "flops_per_rank": self.flops_per_rank,
            "bytes_by_link": self.bytes_by_link,
            "rdma_sent_per_node": self.rdma_sent_per_node,
            "rdma_received_per_node": self.rdma_received_per_node,
            "nvlink_per_node": self.nvlink_per_node,
        }


def graph_stats(graph: TaskGraph) -> GraphStats:
    topo = graph.topology
    bufs = graph.buffers
    st = GraphStats(
        flops_per_rank=[0.0] * topo.world_size,
        bytes_by_link={"nvlink": 0, "rdma": 0},
        rdma_sent_per_node=[0] * topo.nodes,
        rdma_received_per_node=[0] * topo.nodes,
        nvlink_per_node=[0] * topo.nodes,
    )
    for t in graph.tasks:
        st.tasks[(t.rank, t.role, t.kind)] += 1
        st.flops_per_rank[t.rank] += t.flops
        node = topo.node_of(t.rank)
        for region in (*t.reads, *t.writes):
            buf = bufs[region.buffer]
            if buf.rank == t.rank:
                continue
            nbytes = region.numel * ITEMSIZE[buf.dtype]
            link = topo.link(t.rank, buf.rank)
            st.bytes_by_link[link] += nbytes
            if link == "rdma":
                st.rdma_sent_per_node[node] += nbytes
                st.rdma_received_per_node[topo.node_of(buf.rank)] += nbytes
            else:
                st.nvlink_per_node[node] += nbytes
    return st
