"""Bandwidth sharing: transfers as fluid flows through ports of fixed capacity.

A port is one direction of one GPU's link: NVLink egress, NVLink ingress, NIC out, NIC in. A flow
moves ``nbytes`` at up to ``demand`` bytes/s (what one SM, or one NIC queue pair, can drive) and
puts ``frac`` of its rate on each port it crosses (a pull from 7 peers puts 1/7 on each peer's
egress and all of it on the puller's ingress). A port whose summed demand exceeds its capacity
scales every flow through it by ``capacity / load``; a flow runs at its demand times the smallest
scale among its ports.

Shares are refreshed when a port's scale moves by more than ``tolerance`` (the simulator uses
5%): with 32 workers on one saturated port every start or end would otherwise re-time all 32
flows; measured on the 2x8 GEMM+AllReduce the predicted time moves by < 0.1%.

Proportional scaling, not max-min fairness: a flow slowed by another port leaves some capacity
unused here. It is the one-pass rule that lets a start or an end touch only the flows sharing a
port whose scale changed, which is what keeps a 45k-task schedule under a few seconds; where
ports are saturated by identical flows (the collectives mgraph lowers) the two rules agree.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Flow", "FlowNet"]


class Flow:
    """One transfer in flight. ``version`` invalidates finish events computed at an old rate."""

    __slots__ = ("id", "remaining", "rate", "last", "demand", "ports", "version", "nbytes")

    def __init__(
        self, fid: int, nbytes: float, demand: float, ports: Sequence[tuple[int, float]]
    ) -> None:
        self.id = fid
        self.nbytes = nbytes
        self.remaining = float(nbytes)
        self.rate = 0.0
        self.last = 0.0
        self.demand = demand
        self.ports = ports
        self.version = 0

    def finish_time(self) -> float:
        return self.last + self.remaining / self.rate


class FlowNet:
    """Ports and the flows through them; ``start``/``end`` return the flows whose rate changed
    (their ``finish_time()`` must be rescheduled, tagged with their new ``version``)."""

    def __init__(self, capacities: Sequence[float], tolerance: float = 0.0) -> None:
        self.tolerance = tolerance
        self.capacity = [float(c) for c in capacities]
        self.load = [0.0] * len(capacities)
        self.scale = [1.0] * len(capacities)
        self.members: list[dict[int, Flow]] = [{} for _ in capacities]
        self.flows: dict[int, Flow] = {}

    def start(self, flow: Flow, now: float) -> list[Flow]:
        flow.last = now
        self.flows[flow.id] = flow
        changed: dict[int, Flow] = {flow.id: flow}
        for port, frac in flow.ports:
            self.members[port][flow.id] = flow
            self._reload(port, flow.demand * frac, changed)
        return self._rerate(changed, now)

    def end(self, flow: Flow, now: float) -> list[Flow]:
        del self.flows[flow.id]
        changed: dict[int, Flow] = {}
        for port, frac in flow.ports:
            del self.members[port][flow.id]
            self._reload(port, -flow.demand * frac, changed)
        changed.pop(flow.id, None)
        return self._rerate(changed, now)

    def set_demands(
        self, flows: Sequence[Flow], demands: Sequence[float], now: float
    ) -> list[Flow]:
        """Flows in flight whose drivers now drive them at ``demands`` (an NVLink worker slowed
        or released by compute beside it): the bytes moved so far at the old rate are kept."""
        changed: dict[int, Flow] = {}
        for flow, demand in zip(flows, demands, strict=True):
            changed[flow.id] = flow
            for port, frac in flow.ports:
                self._reload(port, (demand - flow.demand) * frac, changed)
        for flow, demand in zip(flows, demands, strict=True):
            flow.demand = demand
        return self._rerate(changed, now)

    def _reload(self, port: int, delta: float, changed: dict[int, Flow]) -> None:
        members = self.members[port]
        # An empty port is reset exactly, so float drift never leaves a phantom load behind.
        load = self.load[port] + delta if members else 0.0
        self.load[port] = load
        cap = self.capacity[port]
        # 1e-9: a port loaded exactly to capacity (16 workers x 1/16 of it) must not flip
        # between 1 and 1 - epsilon on float noise at every event.
        scale = cap / load if load > cap * (1.0 + 1e-9) else 1.0
        old = self.scale[port]
        # Within ``tolerance`` the old share stands (10x fewer updates on a saturated port);
        # a port that is no longer overloaded is always released at once.
        if scale != old and (scale == 1.0 or abs(scale - old) > self.tolerance * old):
            self.scale[port] = scale
            changed.update(members)

    def _rerate(self, changed: dict[int, Flow], now: float) -> list[Flow]:
        scale = self.scale
        for flow in changed.values():
            if flow.rate:
                flow.remaining -= flow.rate * (now - flow.last)
                if flow.remaining < 0.0:
                    flow.remaining = 0.0
            flow.last = now
            s = 1.0
            for port, _ in flow.ports:
                if scale[port] < s:
                    s = scale[port]
            flow.rate = flow.demand * s
            flow.version += 1
        return list(changed.values())
