"""Cluster topology: nodes x GPUs per node, ranks, rail peers and link classes.

rank = node * gpus_per_node + local. Two GPUs of one node talk over NVLink; GPUs of different
nodes talk over RDMA, and a rail-optimised network only connects rail peers: GPUs with the same
local index on different nodes.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from .errors import TopologyError

__all__ = ["Topology", "LinkClass"]

LinkClass = Literal["local", "nvlink", "rdma"]


class Topology(BaseModel):
    """``nodes`` machines with ``gpus_per_node`` GPUs each."""

    model_config = ConfigDict(frozen=True)

    nodes: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)

    def __init__(self, nodes: int | None = None, gpus_per_node: int | None = None, **kw) -> None:
        # Positional form Topology(2, 8) as well as the keyword form pydantic gives.
        if nodes is not None:
            kw["nodes"] = nodes
        if gpus_per_node is not None:
            kw["gpus_per_node"] = gpus_per_node
        for name in ("nodes", "gpus_per_node"):
            value = kw.get(name)
            if isinstance(value, int) and value < 1:
                raise TopologyError(
                    f"Topology {name}={value}: must be at least 1",
                    hint='write it as NODESxGPUS, e.g. "2x8"',
                )
        super().__init__(**kw)

    @classmethod
    def parse(cls, text: str | Topology) -> Topology:
        """``"2x8"`` -> 2 nodes of 8 GPUs."""
        if isinstance(text, Topology):
            return text
        match = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(text))
        if not match:
            raise TopologyError(
                f"cannot parse topology {text!r}", hint='write it as NODESxGPUS, e.g. "2x8"'
            )
        return cls(int(match.group(1)), int(match.group(2)))

    def __str__(self) -> str:
        return f"{self.nodes}x{self.gpus_per_node}"

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def ranks(self) -> range:
        return range(self.world_size)

    def check_rank(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside topology {self} (0..{self.world_size - 1})")
        return rank

    def rank(self, node: int, local: int) -> int:
        if not (0 <= node < self.nodes and 0 <= local < self.gpus_per_node):
            raise TopologyError(f"(node={node}, local={local}) is outside topology {self}")
        return node * self.gpus_per_node + local

    def node_of(self, rank: int) -> int:
        return self.check_rank(rank) // self.gpus_per_node

    def local_of(self, rank: int) -> int:
        return self.check_rank(rank) % self.gpus_per_node

    def node_ranks(self, node: int) -> list[int]:
        return [self.rank(node, local) for local in range(self.gpus_per_node)]

    def rail_peer(self, rank: int, node: int) -> int:
        """The GPU on ``node`` with the same local index as ``rank``."""
        return self.rank(node, self.local_of(rank))

    def rail_peers(self, rank: int) -> list[int]:
        """The rank's rail peers on every other node."""
        home = self.node_of(rank)
        return [self.rail_peer(rank, n) for n in range(self.nodes) if n != home]

    def link(self, a: int, b: int) -> LinkClass:
        if a == b:
            self.check_rank(a)
            return "local"
        return "nvlink" if self.node_of(a) == self.node_of(b) else "rdma"
