"""The discrete-event core: a Schedule's workers, queues, counters, FIFOs, proxies and NICs.

Everything the Schedule says is followed exactly: each rank's role queues in their order, taken
by that role's workers with a fetch-add (a worker takes the next task, then waits for its
counters: head-of-line blocking included), event counters with their counts, and the rdma path
of DESIGN.md. An rdma worker pushes the task's commands into its rank's FIFO (``fifo_slots``
deep: a full FIFO stalls the worker); the rank's host proxy takes up to ``proxy_batch`` commands
per round at ``proxy_command_us`` each and posts the writes at the round's end; each (source,
destination) queue pair sends its writes in order, each after ``rdma_chunk_us`` of NIC work, as a
flow through the source NIC's out port and the destination NIC's in port. Data is visible at the
destination ``rdma_latency_us`` after its last byte left; the completion is back at the source
one latency later.

An NVLink worker's flow is driven at ``nvlink_beside_compute`` of the measured alone rate
(``task_model``'s demand) while its GPU has compute tasks not yet finished (in their math, or
claimed and spinning on their waits, or queued), and at the alone rate once they all have; the
GPU's NVLink flows in flight are re-rated once, when its last compute task ends. Not "only while
a compute task is in its math": bench_tp v7's AG+GEMM trace at 8 NVLink workers had the compute
SMs busy 51% of the time (the rest waiting for gathered rows) and the workers still moved 0.48x
of their alone push rate, as at 16-24 workers with compute busy 80-92%. Epilogue peer stores
are not scaled: ``epilogue_peer_gbps`` was measured beside the GEMM that issues them.

With ``adaptive=True`` each rank's compute and nvlink workers are re-split every ``period``
seconds by the controller's rule, ``mgraph.scheduler.controller.decide`` (the same function the
CPU reference runtime calls with ``Settings(adaptive=True)``), fed in ns: tasks not yet taken,
tasks done and their summed run time, time the role's SMs spent blocked on waits in the window,
SMs per role, and the task model's estimate for the next queued task; comm capped at
``hw.nvlink_max_sms`` as in the static partition. An SM changes role when it finishes a task.
Every decision is kept in ``Engine.windows``. The Triton megakernel runs the same rule under
``Settings(adaptive=True)`` (runtime/megakernel/control.py), not yet on a GPU, so the adaptive
prediction is not yet checked against a measurement.

Ties are broken by a sequence number, so a run is deterministic.
"""

from __future__ import annotations

import heapq
from collections import deque

from mgraph.errors import ScheduleError
from mgraph.hardware import HardwareProfile
from mgraph.kinds import ROLES
from mgraph.scheduler import Schedule
from mgraph.scheduler.controller import MAX_WORKERS, RoleProgress, Window, decide

from ..trace import TaskRecord
from .flows import Flow, FlowNet
from .model import COMPUTE, NVLINK, RDMA, Fill, port_capacities, ports_of, task_model

__all__ = ["Engine", "TransferRecord"]

_ROLE_NAMES = tuple(r.value for r in ROLES)
_TASK_END, _FLOW_END, _SIGNAL, _PUSH_END, _PROXY_END, _QP_START, _TICK, _EPILOGUE = range(8)


class TransferRecord:
    """One RDMA write: posted by the proxy, on the wire from ``start`` to ``end``, visible at the
    destination at ``arrive``."""

    __slots__ = ("task", "src", "dst", "bytes", "posted", "start", "end", "arrive")

    def __init__(self, task: int, src: int, dst: int, nbytes: int, posted: float) -> None:
        self.task, self.src, self.dst, self.bytes = task, src, dst, nbytes
        self.posted, self.start, self.end, self.arrive = posted, 0.0, 0.0, 0.0


class Engine:
    def __init__(
        self,
        schedule: Schedule,
        hw: HardwareProfile,
        *,
        fifo_slots: int = 64,
        adaptive: bool = False,
        period: float = 20e-6,
        tolerance: float = 0.0,
        fill: Fill | None = None,
    ) -> None:
        graph = self.graph = schedule.graph
        self.hw = hw
        self.world = world = graph.topology.world_size
        self.m = task_model(graph, hw, fill)
        self.net = FlowNet(port_capacities(world, hw), tolerance)
        self.base = ports_of(world)
        self.fifo_slots = fifo_slots
        self.adaptive = adaptive
        self.period = period
        n = len(graph.tasks)
        self.n = n
        self.missing = [len(t.waits) for t in graph.tasks]
        self.owner = [-1] * n  # the SM that claimed the task
        self.start_at = [0.0] * n
        self.count = [0] * len(graph.events)
        self.waiters: list[dict[int, list[int]] | None] = [None] * len(graph.events)
        for t in graph.tasks:
            for e, c in t.waits:
                table = self.waiters[e]
                if table is None:
                    table = self.waiters[e] = {}
                table.setdefault(c, []).append(t.id)
        # Per rank and role (index 0 compute, 1 nvlink, 2 rdma): queue, head, free SMs.
        self.queues = [[rs.queues[r] for r in _ROLE_NAMES] for rs in schedule.ranks]
        self.head = [[0, 0, 0] for _ in range(world)]
        self.unfinished = [[len(q) for q in qs] for qs in self.queues]
        self.sm_role: list[list[int]] = []
        self.workers: list[list[int]] = []
        for rs in schedule.ranks:
            roles: list[int] = []
            for code, name in enumerate(_ROLE_NAMES):
                roles += [code] * rs.workers.get(name, 0)
            self.sm_role.append(roles)
            self.workers.append([rs.workers.get(name, 0) for name in _ROLE_NAMES])
        self.target = [list(w) for w in self.workers]
        self.assigned = [list(w) for w in self.workers]  # SMs per role now (adaptive moves them)
        self.held = [[0.0, 0.0, 0.0] for _ in range(world)]  # SM-seconds per role, closed spans
        self.since = [[0.0] * len(roles) for roles in self.sm_role]
        self.idle: list[list[list[int]]] = [[[], [], []] for _ in range(world)]
        self.done_time = [[0.0, 0.0] for _ in range(world)]  # summed seconds: compute, nvlink
        self.done_count = [[0, 0] for _ in range(world)]
        # SMs of compute/nvlink blocked on waits now, and the integral of that count (SM-seconds)
        self.waiting = [[0, 0] for _ in range(world)]
        self.waited = [[0.0, 0.0] for _ in range(world)]
        self.waited_at = [[0.0, 0.0] for _ in range(world)]
        self.waited_mark = [[0.0, 0.0] for _ in range(world)]  # the integral at the last tick
        self.windows: list[Window] = []  # the controller's decisions, in time order
        # rdma path
        self.fifo: list[deque[int]] = [deque() for _ in range(world)]
        self.fifo_used = [0] * world
        # rdma tasks whose pushes wait for FIFO slots, in the order they stalled (one per rdma
        # worker of the rank)
        self.blocked: list[deque[int]] = [deque() for _ in range(world)]
        self.proxy_busy = [False] * world
        self.proxy_time = [0.0] * world  # seconds each host proxy spent executing commands
        self.round: list[list[int]] = [[] for _ in range(world)]
        self.qps: dict[tuple[int, int], deque[TransferRecord]] = {}
        self.qp_busy: dict[tuple[int, int], bool] = {}
        # results
        self.heap: list[tuple] = []
        self.seq = 0
        self.records: list[TaskRecord] = []
        self.transfers: list[TransferRecord] = []
        self.bytes = {"nvlink": 0, "rdma": 0}
        self.proxy_rounds = 0
        self.commands = 0
        self.finished = 0
        self.draining: set[int] = set()  # compute tasks whose epilogue stores are in flight
        # when a draining task's SM moved on (its record ends when the stores have drained):
        # the SM's busy time ends here, not at the record's end
        self.sm_free: dict[int, float] = {}
        self.push_free = [0.0] * graph.topology.world_size  # when each GPU's push port frees
        self.beside = hw.nvlink_beside_compute
        self.nvl_flows: list[dict[int, Flow]] = [{} for _ in range(world)]  # in flight, per GPU
        self.last = 0.0

    # -- event plumbing -----------------------------------------------------------------------
    def at(self, time: float, code: int, a: object, b: object = None) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (time, self.seq, code, a, b))

    def run(self) -> float:
        for rank in range(self.world):
            for sm, code in enumerate(self.sm_role[rank]):
                self.claim(rank, code, sm, 0.0)
            if self.adaptive and self.unfinished[rank][COMPUTE] and self.unfinished[rank][NVLINK]:
                self.at(self.period, _TICK, rank)
        heap, pop = self.heap, heapq.heappop
        while heap:
            now, _, code, a, b = pop(heap)
            if code == _TASK_END:
                self.task_end(a, now)
            elif code == _FLOW_END:
                if a.version == b:
                    self.flow_end(a, now)
            elif code == _SIGNAL:
                self.signal(a, now)
            elif code == _PUSH_END:
                self.push_end(a, now)
            elif code == _PROXY_END:
                self.proxy_end(a, now)
            elif code == _QP_START:
                self.qp_start(a, now)
            elif code == _EPILOGUE:
                self.epilogue(a, now)
            else:
                self.tick(a, now)
        if self.finished < self.n:
            self.deadlock()
        for rank, roles in enumerate(self.sm_role):  # close every SM's current span
            for sm, code in enumerate(roles):
                self.held[rank][code] += self.last - self.since[rank][sm]
        return self.last

    # -- workers ------------------------------------------------------------------------------
    def claim(self, rank: int, code: int, sm: int, now: float) -> None:
        """SM ``sm`` of ``rank`` takes the next task of role ``code`` (fetch-add on the head)."""
        if self.adaptive and code != RDMA:
            new = self.rebalance(rank, code)
            if new != code:  # the SM held ``code`` until now
                self.held[rank][code] += now - self.since[rank][sm]
                self.since[rank][sm] = now
                self.sm_role[rank][sm] = code = new
        heads = self.head[rank]
        queue = self.queues[rank][code]
        h = heads[code]
        if h >= len(queue):
            self.idle[rank][code].append(sm)
            return
        heads[code] = h + 1
        tid = queue[h]
        self.owner[tid] = sm
        if self.missing[tid] == 0:
            self.begin(tid, now)
        elif self.adaptive and code != RDMA:
            self.wait_count(rank, code, now, 1)

    def begin(self, tid: int, now: float) -> None:
        m = self.m
        self.start_at[tid] = now
        role = m.role[tid]
        if role == RDMA:
            self.try_push(tid, now)
        elif role == COMPUTE and m.remote[tid]:
            self.at(now + m.duration[tid], _EPILOGUE, tid)
        elif role == COMPUTE or not m.remote[tid]:
            self.at(now + m.duration[tid], _TASK_END, tid)
        else:
            rank = self.graph.tasks[tid].rank
            flow = Flow(tid, m.remote[tid], m.demand[tid] * self.slowdown(rank), m.ports[tid])
            self.nvl_flows[rank][tid] = flow
            self.reflow(self.net.start(flow, now))

    # -- compute beside NVLink workers ----------------------------------------------------------
    def slowdown(self, rank: int) -> float:
        """Fraction of its alone rate an NVLink worker of ``rank`` drives now."""
        return self.beside if self.unfinished[rank][COMPUTE] else 1.0

    def rerate_nvlink(self, rank: int, now: float) -> None:
        flows = self.nvl_flows[rank]
        if not flows or self.beside == 1.0:
            return
        f, demand = self.slowdown(rank), self.m.demand
        moved = list(flows.values())
        self.reflow(self.net.set_demands(moved, [demand[x.id] * f for x in moved], now))

    def reflow(self, flows: list[Flow]) -> None:
        for f in flows:
            self.at(f.finish_time(), _FLOW_END, f, f.version)

    def record(self, tid: int, now: float) -> None:
        t = self.graph.tasks[tid]
        self.records.append(
            TaskRecord(
                tid, t.name, t.kind, t.rank, t.role, self.owner[tid], self.start_at[tid], now
            )
        )
        if now > self.last:
            self.last = now
        self.finished += 1

    def epilogue(self, tid: int, now: float) -> None:
        """A compute task whose epilogue stores into peers finished its math: its SM takes the
        next task while the stores drain (asynchronous TMA stores); the task ends, and signals,
        when they have. The GPU's pushes drain one after another through its push port at
        ``epilogue_demand`` (a FIFO pipe per GPU, O(1) per push): modelled as fair-shared flows,
        every compute SM's push would re-time every other one's, ~100x the events on a 2x8
        graph, for the same throughput."""
        rank, code = self.graph.tasks[tid].rank, self.m.role[tid]
        self.draining.add(tid)
        self.sm_free[tid] = now
        self.claim(rank, code, self.owner[tid], now)
        start = max(now, self.push_free[rank])
        end = start + self.m.remote[tid] / self.m.epilogue_demand
        self.push_free[rank] = end
        self.bytes["nvlink"] += self.m.remote[tid]
        self.at(end, _TASK_END, tid)

    def task_end(self, tid: int, now: float) -> None:
        """A compute or nvlink task is done: record, signal, take the next task."""
        self.record(tid, now)
        for e, delay in self.m.signals[tid]:
            if delay:
                self.at(now + delay, _SIGNAL, e)
            else:
                self.signal(e, now)
        rank, code = self.graph.tasks[tid].rank, self.m.role[tid]
        self.unfinished[rank][code] -= 1
        if code == COMPUTE and not self.unfinished[rank][COMPUTE]:
            self.rerate_nvlink(rank, now)  # the GPU's last compute task: workers run alone
        if code != RDMA:
            self.done_time[rank][code] += now - self.start_at[tid]
            self.done_count[rank][code] += 1
        if tid in self.draining:  # its SM moved on when the math finished
            self.draining.discard(tid)
            return
        self.claim(rank, code, self.owner[tid], now)

    def flow_end(self, flow: Flow, now: float) -> None:
        self.reflow(self.net.end(flow, now))
        if flow.id < self.n:
            del self.nvl_flows[self.graph.tasks[flow.id].rank][flow.id]
            self.bytes["nvlink"] += self.m.remote[flow.id]
            self.task_end(flow.id, now)
        else:
            self.wire_end(flow.id - self.n, now)

    def signal(self, event: int, now: float) -> None:
        c = self.count[event] + 1
        self.count[event] = c
        table = self.waiters[event]
        if table is None or c not in table:
            return
        missing, owner = self.missing, self.owner
        for tid in table[c]:
            missing[tid] -= 1
            if missing[tid] == 0 and owner[tid] >= 0:
                if self.adaptive and self.m.role[tid] != RDMA:
                    self.wait_count(self.graph.tasks[tid].rank, self.m.role[tid], now, -1)
                self.begin(tid, now)

    # -- the rdma path ------------------------------------------------------------------------
    def try_push(self, tid: int, now: float) -> None:
        """The rdma worker writes the task's commands, or stalls while the FIFO is full."""
        rank, need = self.graph.tasks[tid].rank, self.m.commands[tid]
        # A task with more commands than slots still goes through an empty FIFO; a push waits
        # behind the pushes that stalled before it.
        if self.blocked[rank] or self.fifo_used[rank] + need > max(self.fifo_slots, need):
            self.blocked[rank].append(tid)
            return
        self.fifo_used[rank] += need
        self.at(now + self.m.duration[tid], _PUSH_END, tid)

    def push_end(self, tid: int, now: float) -> None:
        """The worker has published the task's commands: the proxy may take them."""
        rank = self.graph.tasks[tid].rank
        self.record(tid, now)
        self.unfinished[rank][RDMA] -= 1
        self.fifo[rank].append(tid)
        if not self.proxy_busy[rank]:
            self.proxy_round(rank, now)
        self.claim(rank, RDMA, self.owner[tid], now)

    def proxy_round(self, rank: int, now: float) -> None:
        fifo, commands = self.fifo[rank], self.m.commands
        taken: list[int] = []
        n = 0
        while fifo and (not taken or n + commands[fifo[0]] <= self.hw.proxy_batch):
            tid = fifo.popleft()
            taken.append(tid)
            n += commands[tid]
        self.round[rank] = taken
        self.proxy_busy[rank] = True
        self.proxy_rounds += 1
        self.commands += n
        self.proxy_time[rank] += n * self.hw.proxy_command_us * 1e-6
        self.at(now + n * self.hw.proxy_command_us * 1e-6, _PROXY_END, rank)

    def proxy_end(self, rank: int, now: float) -> None:
        """The round's writes are posted (one doorbell) and its FIFO slots freed."""
        m = self.m
        for tid in self.round[rank]:
            self.fifo_used[rank] -= m.commands[tid]
            qp = (rank, m.dst[tid])
            q = self.qps.get(qp)
            if q is None:
                q = self.qps[qp] = deque()
                self.qp_busy[qp] = False
            q.append(TransferRecord(tid, rank, m.dst[tid], m.remote[tid], now))
            if not self.qp_busy[qp]:
                self.qp_busy[qp] = True
                self.at(now + self.hw.rdma_chunk_us * 1e-6, _QP_START, qp)
        self.proxy_busy[rank] = False
        blocked, commands = self.blocked[rank], self.m.commands
        while blocked:  # the stall stays inside each task's record
            need = commands[blocked[0]]
            if self.fifo_used[rank] + need > max(self.fifo_slots, need):
                break
            self.fifo_used[rank] += need
            self.at(now + self.m.duration[blocked[0]], _PUSH_END, blocked.popleft())
        if self.fifo[rank]:
            self.proxy_round(rank, now)

    def qp_start(self, qp: tuple[int, int], now: float) -> None:
        tr = self.qps[qp][0]
        tr.start = now
        src, dst = qp
        ports = ((self.base["nic_out"] + src, 1.0), (self.base["nic_in"] + dst, 1.0))
        flow = Flow(self.n + tr.task, tr.bytes, self.hw.rdma_gbps * 1e9, ports)
        self.reflow(self.net.start(flow, now))

    def wire_end(self, tid: int, now: float) -> None:
        m, lat = self.m, self.hw.rdma_latency_us * 1e-6
        qp = (self.graph.tasks[tid].rank, m.dst[tid])
        tr = self.qps[qp].popleft()
        tr.end, tr.arrive = now, now + lat
        self.transfers.append(tr)
        self.bytes["rdma"] += tr.bytes
        if tr.arrive > self.last:
            self.last = tr.arrive  # the op is done when its last byte has landed
        for e in m.dst_events[tid]:
            self.at(now + lat, _SIGNAL, e)
        for e in m.src_events[tid]:
            self.at(now + 2 * lat, _SIGNAL, e)
        if self.qps[qp]:
            self.at(now + self.hw.rdma_chunk_us * 1e-6, _QP_START, qp)
        else:
            self.qp_busy[qp] = False

    # -- the adaptive controller --------------------------------------------------------------
    def wait_count(self, rank: int, code: int, now: float, delta: int) -> None:
        """An SM of ``code`` starts (+1) or stops (-1) waiting: close the integral's span."""
        self.waited[rank][code] += self.waiting[rank][code] * (now - self.waited_at[rank][code])
        self.waited_at[rank][code] = now
        self.waiting[rank][code] += delta

    def tick(self, rank: int, now: float) -> None:
        heads, queues = self.head[rank], self.queues[rank]
        if heads[COMPUTE] >= len(queues[COMPUTE]) and heads[NVLINK] >= len(queues[NVLINK]):
            return  # nothing left to take: no role can gain from a move
        window = _ns(self.period)
        progress = []
        for code in (COMPUTE, NVLINK):
            self.wait_count(rank, code, now, 0)
            waited = self.waited[rank][code] - self.waited_mark[rank][code]
            self.waited_mark[rank][code] = self.waited[rank][code]
            progress.append(
                RoleProgress(
                    left=len(queues[code]) - heads[code],
                    done=self.done_count[rank][code],
                    run=_ns(self.done_time[rank][code]),
                    wait=_ns(waited),
                    workers=self.assigned[rank][code],
                    prior=max(1, _ns(self.prior(rank, code))),
                )
            )
        target = self.target[rank]
        previous, cap = target[NVLINK], min(self.hw.nvlink_max_sms, MAX_WORKERS)
        split = decide(progress[0], progress[1], window=window, previous=previous, max_comm=cap)
        target[COMPUTE], target[NVLINK] = split
        self.windows.append(
            Window(rank, _ns(now), progress[0], progress[1], window, previous, cap, split)
        )
        self.at(now + self.period, _TICK, rank)

    def prior(self, rank: int, code: int) -> float:
        """Seconds per task before any finished: the model's estimate for the next queued one."""
        queue, h = self.queues[rank][code], self.head[rank][code]
        tid = queue[min(h, len(queue) - 1)]
        m = self.m
        return (
            m.duration[tid]
            if code == COMPUTE or not m.remote[tid]
            else (m.remote[tid] / (m.demand[tid] * self.slowdown(rank)))
        )

    def rebalance(self, rank: int, code: int) -> int:
        """The role a freed compute/nvlink SM takes next: its own, unless the controller wants
        it in the other one or its own queue is exhausted (reference.py's _Pool._next_role moves
        its threads by the same test)."""
        other = NVLINK if code == COMPUTE else COMPUTE
        has_other = self.head[rank][other] < len(self.queues[rank][other])
        if not has_other:
            return code
        assigned, target = self.assigned[rank], self.target[rank]
        exhausted = self.head[rank][code] >= len(self.queues[rank][code])
        if exhausted or (assigned[code] > target[code] and assigned[other] < target[other]):
            assigned[code] -= 1
            assigned[other] += 1
            return other
        return code

    def deadlock(self) -> None:
        blocked = [
            self.graph.tasks[q[h - 1]].name
            for qs, hs in zip(self.queues, self.head, strict=True)
            for q, h in zip(qs, hs, strict=True)
            if 0 < h <= len(q) and self.owner[q[h - 1]] >= 0
        ]
        raise ScheduleError(
            f"simulation stalled after {self.finished} of {self.n} tasks; last claimed tasks: "
            f"{blocked[:6]}",
            hint="the queues deadlock; mgraph.schedule() checks them (Schedule.check())",
        )


def _ns(seconds: float) -> int:
    """Simulated seconds as the controller's integer nanoseconds."""
    return round(seconds * 1e9)
