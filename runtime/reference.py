"""The CPU reference runtime: runs a Schedule with the GPU's queues, counters and proxy.

Every rank's workers are threads. A worker takes the next task of its role with a fetch-add on the
role queue's head, waits on epoch-tagged counters, runs the kind's CPU tile body and signals.
With ``Settings(adaptive=True)`` a rank's compute and nvlink threads form one pool (``_Pool``)
that the controller re-splits: when a thread finishes a task and ``adaptive_window_us`` has passed,
it calls ``mgraph.scheduler.controller.decide`` on the rank's progress (tasks left, done, their run
time, time blocked on waits, threads per role; ns) and threads move to the role it asks for at
their next task boundary. Only the order of tasks changes, never what a task computes, so outputs
equal the non-adaptive run's bit for bit wherever that run's are deterministic (a region that
three or more tasks add into sums in claim order either way). Decisions are kept in
``ReferenceRuntime.windows``. NVLink tasks read and write peer ranks'
buffers directly (all ranks share this process, as GPUs of one node share NVLink). RDMA tasks are
pushed as commands into the rank's FIFO; a host proxy drains it, moves the data through a
transport and raises the task's events: the same path the GPU megakernel takes.

Counters are never reset: launch ``epoch`` waits for ``(epoch - 1) * signals(event) + count``,
so a schedule relaunches as often as wanted. Every wait is bounded by ``Settings.watchdog_s``; on
expiry all ranks abort and WatchdogTimeout names rank, worker, task, event, value and target.

SPMD: ``ranks=`` (whole nodes) and a torch.distributed ``store`` make this process run only
those ranks, as one process per node does under torchrun; RDMA then goes through the tcp
transport to the processes holding the other nodes, and every process calls ``run`` with the
same global inputs for each launch. A peer that fails or disconnects aborts the launch on both
sides with a ProxyError, within the watchdog bound. ``close()`` ends the connections.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mgraph.errors import MgraphError, TopologyError, WatchdogTimeout
from mgraph.graph import Task
from mgraph.kinds import KINDS, Role
from mgraph.scheduler.controller import MAX_WORKERS, TIME_CAP, RoleProgress, Window, decide
from mgraph.settings import Settings

from .counters import Counters
from .memory import allocate, gather_outputs, region_view, shard_inputs
from .network import Network
from .trace import TaskRecord, Trace

if TYPE_CHECKING:
    from mgraph.scheduler import Schedule

__all__ = ["ReferenceRuntime", "RunResult", "Counters"]  # Counters: re-exported


@dataclass
class RunResult:
    outputs: dict[str, torch.Tensor]
    trace: Trace
    wall_s: float
    epoch: int
    stats: dict[str, int] = field(default_factory=dict)

    def view(self, path: str | None = None, *, schedule: Schedule, **kw):
        """Write the offline HTML viewer with this run's timeline (``schedule``: the schedule
        that ran); returns the file's path (mgraph.viz.view)."""
        from mgraph.viz import view

        return view(self, path, schedule=schedule, **kw)


class ReferenceRuntime:
    """Holds one schedule's memory, counters and proxies across launches."""

    def __init__(
        self,
        schedule: Schedule,
        settings: Settings | None = None,
        *,
        ranks: Sequence[int] | None = None,
        store: object = None,
        tag: str = "mgraph",
    ) -> None:
        self.schedule = schedule
        self.graph = schedule.graph
        self.settings = settings or Settings.from_env()
        topo = self.graph.topology
        self.local_ranks = sorted(set(topo.ranks if ranks is None else ranks))
        self._check_local_ranks()
        self.processes = topo.world_size // len(self.local_ranks)
        self.memory = allocate(self.graph)
        atomic_add = None
        if self.settings.proxy == "native":  # a native writer exists: adds must be atomic
            from .proxy.native import load

            atomic_add = load().atomic_add
        self.counters = Counters(self.graph, atomic_add)
        self.total_signals = [0] * len(self.graph.events)
        for t in self.graph.tasks:
            for e in t.signals:
                self.total_signals[e] += 1
        self.signalers = self.graph.signalers()
        self.epoch = 0
        self.errors: list[BaseException] = []
        self.windows: list[Window] = []  # the last launch's controller decisions (adaptive)
        self.network = Network(self, self.settings, store=store, tag=tag)

    def _check_local_ranks(self) -> None:
        topo = self.graph.topology
        for r in self.local_ranks:
            topo.check_rank(r)
            node = topo.node_ranks(topo.node_of(r))
            if not set(node) <= set(self.local_ranks):
                raise TopologyError(
                    f"ReferenceRuntime(ranks={self.local_ranks}): rank {r} is here but not all "
                    f"of its node {topo.node_of(r)} ({node}) is",
                    hint="a process runs whole nodes (NVLink tasks reach every GPU of a node)",
                )
        if topo.world_size % len(self.local_ranks):
            raise TopologyError(
                f"ReferenceRuntime(ranks={self.local_ranks}): {topo.world_size} ranks do not "
                "split evenly into processes of this size",
                hint="give every process the same number of nodes",
            )

    @property
    def spmd(self) -> bool:
        """Whether other processes hold some of the ranks."""
        return len(self.local_ranks) < self.graph.topology.world_size

    def close(self) -> None:
        """End the network (connections to other processes) and the counters' waker."""
        self.network.close()
        self.counters.close()

    def __enter__(self) -> ReferenceRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- one launch ---------------------------------------------------------------------------
    def run(self, inputs: dict[str, torch.Tensor]) -> RunResult:
        graph = self.graph
        shard_inputs(graph, inputs, self.memory)  # checks names, shapes, dtypes first
        for buf in graph.buffers.values():
            if buf.zeroed:  # tasks accumulate into it (graph.Buffer)
                self.memory[buf.id].zero_()
            elif buf.role != "input":  # stale results of the last launch must not pass as new
                self.memory[buf.id].fill_(float("nan"))
        self.epoch += 1
        self.counters.aborted = False
        self.errors = []
        self.done = [False] * len(graph.tasks)
        self.records: list[TaskRecord] = []
        self.record_lock = threading.Lock()
        network = self.network
        network.launch(self.epoch)
        self.t0 = time.perf_counter()
        self.windows = []
        threads = []
        for rs in self.schedule.ranks:
            if rs.rank not in self.local_ranks:
                continue
            pool = self._pool(rs) if self.settings.adaptive else None
            for role in Role:
                queue = rs.queues.get(role.value, [])
                if not queue:
                    continue
                head = itertools.count()  # next() on a count is atomic under the GIL: fetch-add
                n = min(max(rs.workers.get(role.value, 1), 1), self.settings.threads_per_role)
                for w in range(n):
                    if pool is not None and role is not Role.RDMA:
                        code = _POOLED.index(role.value)
                        target, args = self._pool_worker, (pool, code, len(threads))
                    else:
                        target, args = self._worker, (rs.rank, role.value, w, queue, head)
                    th = threading.Thread(
                        target=target, args=args, name=f"r{rs.rank}-{role.value}-{w}", daemon=True
                    )
                    threads.append(th)
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        try:
            network.finish(drain=not self.errors)
        except MgraphError as exc:
            self.fail(exc)
        if self.errors:
            self.counters.abort()
            raise self.errors[0]
        wall = time.perf_counter() - self.t0
        if self.spmd:
            outputs = gather_outputs(graph, self.memory, ranks=self.local_ranks, partial=True)
        else:
            outputs = gather_outputs(graph, self.memory)
        self.windows.sort(key=lambda w: (w.time, w.rank))
        trace = Trace(sorted(self.records, key=lambda r: r.start), backend="reference")
        return RunResult(outputs, trace, wall, self.epoch, network.stats())

    # -- workers ------------------------------------------------------------------------------
    def _worker(self, rank: int, role: str, worker: int, queue: list[int], head) -> None:
        tasks = self.graph.tasks
        try:
            while not self.counters.aborted:
                i = next(head)
                if i >= len(queue):
                    return
                task = tasks[queue[i]]
                if not self._await(rank, role, worker, task):
                    return
                start = time.perf_counter() - self.t0
                if role == Role.RDMA.value:
                    self.network.submit(task, worker, start)
                    continue
                self.execute(task)
                self.finish(task, worker, start)
        except BaseException as exc:  # a failing tile body aborts every rank
            self.fail(exc)

    def _await(self, rank: int, role: str, worker: int, task: Task) -> bool:
        """Wait for the task's events; False when the launch aborts or the watchdog fires."""
        for event, count in task.waits:
            target = (self.epoch - 1) * self.total_signals[event] + count
            if not self.counters.wait(event, target, self.settings.watchdog_s):
                if not self.counters.aborted:
                    self.fail(self._timeout(rank, role, worker, task, event, count, target))
                return False
        return True

    def _pool(self, rs) -> _Pool | None:
        """The rank's controller pool, when it has both compute and nvlink tasks."""
        queues = [rs.queues.get(name, []) for name in _POOLED]
        if not all(queues):
            return None
        n = [
            min(max(rs.workers.get(name, 1), 1), self.settings.threads_per_role) for name in _POOLED
        ]
        cap = min(self.schedule.hardware.nvlink_max_sms, MAX_WORKERS)
        window = round(self.settings.adaptive_window_us * 1e3)
        return _Pool(rs.rank, queues, n, window, cap, self.windows)

    def _pool_worker(self, pool: _Pool, code: int, worker: int) -> None:
        """A compute/nvlink thread under the controller: its role may change between tasks."""
        tasks = self.graph.tasks
        try:
            while not self.counters.aborted:
                code, tid = pool.take(code, self._clock_ns())
                if tid < 0:
                    return
                task = tasks[tid]
                if task.waits:
                    pool.wait_count(code, self._clock_ns(), 1)
                    ok = self._await(pool.rank, _POOLED[code], worker, task)
                    pool.wait_count(code, self._clock_ns(), -1)
                    if not ok:
                        return
                start_ns = self._clock_ns()
                self.execute(task)
                self.finish(task, worker, start_ns * 1e-9)
                pool.finished(code, self._clock_ns() - start_ns)
        except BaseException as exc:  # a failing tile body aborts every rank
            self.fail(exc)

    def _clock_ns(self) -> int:
        return round((time.perf_counter() - self.t0) * 1e9)

    def execute(self, task: Task) -> None:
        reads = [region_view(self.memory, r) for r in task.reads]
        writes = [region_view(self.memory, w) for w in task.writes]
        try:
            KINDS[task.kind].run_cpu(task, reads, writes)
        except MgraphError:
            raise
        except Exception as exc:
            raise MgraphError(
                f"task {task.name!r} (rank {task.rank}, {task.role} {task.kind}) failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc

    def record(self, task: Task, worker: int, start: float) -> None:
        end = time.perf_counter() - self.t0
        with self.record_lock:
            self.records.append(
                TaskRecord(task.id, task.name, task.kind, task.rank, task.role, worker, start, end)
            )
        self.done[task.id] = True

    def finish(self, task: Task, worker: int, start: float) -> None:
        """Record the task and signal its events (after its writes: release order)."""
        self.record(task, worker, start)
        for e in task.signals:
            self.counters.add(e)

    def fail(self, exc: BaseException) -> None:
        with self.record_lock:
            self.errors.append(exc)
        self.counters.abort()

    def _timeout(self, rank, role, worker, task, event, count, target) -> WatchdogTimeout:
        ev = self.graph.events[event]
        value = self.counters.values[event]
        names = [
            f"{self.graph.tasks[s].name!r} ({'done' if self.done[s] else 'not done'})"
            for s in self.signalers[event]
        ]
        return WatchdogTimeout(
            f"watchdog: rank {rank}, {role} worker {worker}, task {task.name!r} waited "
            f"{self.settings.watchdog_s:g} s for event {ev.name!r} (id {event}, rank {ev.rank}): "
            f"value {value}, target {target} (count {count}, epoch {self.epoch}); tasks that "
            f"signal it: {', '.join(names) if names else 'none'}",
            hint="a signal is missing or a producer never ran; check those tasks' waits",
        )


_POOLED = (Role.COMPUTE.value, Role.NVLINK.value)  # the roles the controller re-splits


class _Pool:
    """One rank's compute (code 0) and nvlink (code 1) threads under the controller.

    Every method runs under the pool's lock, so taking a ticket, counting a wait and deciding are
    atomic with respect to each other. A thread leaves its role only when that role has no task
    left to take or has more threads than the controller's split (which keeps at least one in a
    role with tasks left), so no queue loses its last worker: the schedule's deadlock freedom
    holds (the simulator's Engine.rebalance moves SMs by the same test).
    """

    def __init__(
        self,
        rank: int,
        queues: list[list[int]],
        workers: list[int],
        window: int,
        max_comm: int,
        log: list[Window],
    ) -> None:
        self.rank, self.queues, self.window, self.max_comm, self.log = (
            rank, queues, window, max_comm, log
        )  # fmt: skip
        self.lock = threading.Lock()
        self.head = [0, 0]
        self.assigned = list(workers)  # threads per role now
        self.target = list(workers)  # the controller's last split
        self.done = [0, 0]
        self.run_ns = [0, 0]
        self.waiting = [0, 0]  # threads of the role blocked on waits now
        self.waited = [0, 0]  # integral of ``waiting`` over time (thread-ns)
        self.waited_at = [0, 0]
        self.waited_mark = [0, 0]  # ``waited`` at the last decision
        self.decided_at = 0

    def take(self, code: int, now: int) -> tuple[int, int]:
        """(role, task id) for a thread of ``code`` at a task boundary; task -1: nothing left."""
        with self.lock:
            if now - self.decided_at >= self.window:
                self._decide(now)
            code = self._next_role(code)
            h = self.head[code]
            if h >= len(self.queues[code]):
                return code, -1  # both queues are taken (_next_role would have moved it)
            self.head[code] = h + 1
            return code, self.queues[code][h]

    def _next_role(self, code: int) -> int:
        other = 1 - code
        if self.head[other] >= len(self.queues[other]):
            return code
        exhausted = self.head[code] >= len(self.queues[code])
        assigned, target = self.assigned, self.target
        if exhausted or (assigned[code] > target[code] and assigned[other] < target[other]):
            assigned[code] -= 1
            assigned[other] += 1
            return other
        return code

    def wait_count(self, code: int, now: int, delta: int) -> None:
        with self.lock:
            self._integrate(code, now)
            self.waiting[code] += delta

    def finished(self, code: int, run_ns: int) -> None:
        with self.lock:
            self.done[code] += 1
            self.run_ns[code] += run_ns

    def _integrate(self, code: int, now: int) -> None:
        # Threads read the clock before taking the lock, so a ``now`` may be older than the
        # last one integrated: never integrate backwards (the wait time stays non-negative).
        if now > self.waited_at[code]:
            self.waited[code] += self.waiting[code] * (now - self.waited_at[code])
            self.waited_at[code] = now

    def _decide(self, now: int) -> None:
        if all(h >= len(q) for h, q in zip(self.head, self.queues, strict=True)):
            return  # nothing left to take: no role can gain from a move
        progress = []
        for code in (0, 1):
            self._integrate(code, now)
            progress.append(
                RoleProgress(
                    left=len(self.queues[code]) - self.head[code],
                    done=self.done[code],
                    run=self.run_ns[code],
                    wait=self.waited[code] - self.waited_mark[code],
                    workers=self.assigned[code],
                    prior=0,  # the cost model's estimates are GPU times: no CPU estimate
                )
            )
            self.waited_mark[code] = self.waited[code]
        window = min(now - self.decided_at, TIME_CAP)
        previous = self.target[1]
        split = decide(
            progress[0], progress[1], window=window, previous=previous, max_comm=self.max_comm
        )
        self.target = list(split)
        self.decided_at = now
        self.log.append(
            Window(self.rank, now, progress[0], progress[1], window, previous, self.max_comm, split)
        )
