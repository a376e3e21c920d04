"""Ranks sharing one GPU (a correctness run of a multi-node graph on one device): the host
proxy's copies need an SM that the rank's OWN megakernel has left free.

Why. On two GPUs a proxy WRITE is a peer copy, done by a copy engine: it runs while every SM
spins in the persistent kernel. When the ranks share a GPU (ipc_share.py) the same WRITE is a
device-to-device copy on ONE device, which the driver runs as a copy kernel on the SMs, in the
proxy's process, so in the context of the rank's own megakernel (the processes' kernels
time-slice; within a slice only that process's blocks run). The megakernel's blocks take a
whole SM each (255 registers a thread, 8 warps: the register file), so such a copy starts only
on an SM the grid does not use or once one of its programs has ended.
benchmarks/share_copy_probe.py measured it on an H200 (v20 call 3, share_copy_probe.json):
with every SM's registers taken, 256 KiB - 32 MiB device-to-device copies and a torch kernel do
NOT run until the spinning kernel ends; 4-byte host-to-device copies (the flag raises) do.

So a schedule can deadlock there and nowhere else: the 2x1 GEMM+AllReduce at 4096x4096x2048
keeps each rank's 131 compute programs on its 256 rail-reduces (each waits for a chunk the
PEER's proxy sends) and its one rdma program on its first rail-gather (which waits for those
reduces), so no program of either rank ends and neither proxy's sends ever run. On the GPU
(v20 calls 2-3, watchdogs 5, 20, 60 s, batches of 8 and of 1) each time one rank timed out on
a rail-reduce ("value 1, target 2": the local node-reduce counted, the peer's chunk not) and the
other finished its queue the moment that kernel ended, then timed out one watchdog later at
its exit wait. The same model says the cases that passed there do not deadlock: GEMM+RS and
AG+GEMM at 4096 (their rdma program ends after its sends) and GEMM+AR 1024x768 (fewer dynamic
tasks than programs).

``starved`` runs that model on a schedule; ``check_shared_gpu`` refuses, before any launch, a
schedule it deadlocks, naming the tasks left waiting, instead of a watchdog timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from mgraph.errors import ScheduleError

if TYPE_CHECKING:
    from mgraph.scheduler.model import Schedule

__all__ = ["starved", "check_shared_gpu", "SHARED", "COPY_KERNEL"]

# Why a proxy copy is a kernel (check_shared_gpu's ``why``)
SHARED = "ranks share one GPU, so each proxy WRITE is a same-device copy that runs as a kernel"
COPY_KERNEL = "MGRAPH_PROXY_COPY_KERNEL_BYTES makes a proxy WRITE a copy-and-flag kernel"


def starved(schedule: Schedule, spare_sms: Sequence[int]) -> list[tuple[int, int]]:
    """(rank, task id) held by a program when nothing can progress, or [] when every queue
    drains. The model: each rank's programs take their role's queue in order (a ticket each, as
    the kernel's fetch-add) and hold a task until its waits are met; a finished rdma task's
    chunk lands (raising its signals) only while the rank has a free SM: ``spare_sms[rank]``
    (SMs its grid leaves unused) plus its programs that ended. Fixed roles (no controller)."""
    graph = schedule.graph
    tasks = graph.tasks
    count: dict[int, int] = {}
    ranks = []
    for rs in schedule.ranks:
        programs = [role for role, n in rs.workers.items() for _ in range(n)]
        ranks.append({
            "queues": rs.queues, "programs": programs, "held": [None] * len(programs),
            "ended": [False] * len(programs), "head": dict.fromkeys(rs.queues, 0),
            "free": spare_sms[rs.rank], "queued": [],
        })

    def ready(t: int) -> bool:
        return all(count.get(e, 0) >= c for e, c in tasks[t].waits)

    def land(t: int) -> None:
        for e in tasks[t].signals:
            count[e] = count.get(e, 0) + 1

    moved = True
    while moved:
        moved = False
        for r in ranks:
            for p, role in enumerate(r["programs"]):
                while not r["ended"][p]:
                    if r["held"][p] is None:
                        queue, head = r["queues"][role], r["head"][role]
                        if head >= len(queue):
                            r["ended"][p] = True
                            r["free"] += 1
                            moved = True
                            break
                        r["held"][p] = queue[head]
                        r["head"][role] = head + 1
                    t = r["held"][p]
                    if not ready(t):
                        break
                    if tasks[t].role == "rdma":
                        r["queued"].append(t)  # pushed: the proxy's copy waits for an SM
                    else:
                        land(t)
                    r["held"][p] = None
                    moved = True
            if r["queued"] and r["free"] > 0:
                for t in r["queued"]:
                    land(t)
                r["queued"] = []
                moved = True
    return [(rs.rank, t) for rs, r in zip(schedule.ranks, ranks, strict=True)
            for t, ended in zip(r["held"], r["ended"], strict=True) if t is not None and not ended]


def check_shared_gpu(schedule: Schedule, sms: int, why: str = SHARED) -> None:
    """ScheduleError if ``schedule``, run on GPUs of ``sms`` SMs whose proxy copies are kernels
    (ranks sharing one GPU, or the copy-and-flag kernel: ``why``), deadlocks because those
    copies find no free SM (module docstring)."""
    spare = [max(0, sms - sum(rs.workers.values())) for rs in schedule.ranks]
    stuck = starved(schedule, spare)
    if not stuck:
        return
    rank, task = stuck[0]
    programs = max(sum(rs.workers.values()) for rs in schedule.ranks)
    raise ScheduleError(
        f"{schedule.graph.op}: {why} on an SM its own megakernel left free; with {programs} "
        f"programs on {sms} SMs no program of any rank ends before a peer's chunk lands, so no chunk ever "
        f"does: {len(stuck)} tasks would wait at the watchdog, first rank {rank}'s "
        f"{schedule.graph.tasks[task].name!r} (runtime/megakernel/shared_gpu.py). On separate "
        "GPUs, without the copy-and-flag kernel, the copy is a copy-engine peer copy and this "
        "schedule runs",
        hint="leave an SM free: mg.schedule(graph, workers={...}) with one compute worker fewer "
        "than the default split (tests/gpu_workers.py does so on a shared GPU)",
    )
