"""Replay a schedule with measured per-kind task times: where the programs of a megakernel wait
(issue 16: the traced Llama layer's tasks spent ~1 ms a program waiting for their inputs).

The model is the megakernel's dynamic queue: per rank and role one queue, taken in order by
that role's programs with a fetch-add (the program that frees first takes the next task), each
program blocked on its task's waits until the counters meet them (head-of-line blocking), then
busy for the task's time, then signalling. A task's time is the scheduler's cost model
(``mgraph.scheduler.task_costs``) scaled per kind so that the kind's mean is the measured
``mean_work_us`` of a traced launch (benchmarks/kind_breakdown.py; by default v12's one-H200
run, ``benchmarks/results/v12/bench_layer_kinds.json``): so a down-projection tile (K = FFN)
stays longer than a q tile (K = hidden), and the kind's total body time is what was measured.
Network and NVLink transfers are not modelled beyond their task times (the layer on one rank
has neither).

Each wait is charged to the stage of the signaller met last (the task that kept the counter
short longest), so the report says which stage boundary stalls: e.g. "linear_4: matmul waits
for rms_norm_1". Stage = the task name before its rank tag, e.g. ``linear_4: matmul`` (the
traced op ``linear_4`` is the 5th linear: q, k, v, o, gate, up, down are linear..linear_6).

    python benchmarks/replay_layer.py                 # the default layer (1 rank), ~10 s on a CPU
    python benchmarks/replay_layer.py --ewise-us 15   # ewise bodies at 15 us a task
    python benchmarks/replay_layer.py --policy topological --policy critical_path --out /tmp/r

It builds the layer as bench_layer does for one rank (mg.compile of the same module and plan,
``topology="1x1"``, on the CPU reference backend: the same graph and schedule as
``backend="triton"``, which only adds its body check; the graph is the one this tree lowers,
v12's run measured one of 12,864 tasks), replays every policy asked for (default:
longest_path and critical_path) and prints per policy the predicted makespan,
the waiting per kind and the top stage boundaries by waiting; ``--out`` writes
``replay_layer.json``. ``--sim`` also runs runtime/sim on each schedule (its own profile costs);
``--oracle`` adds critical_path ordered with the replay's own task times as its costs (what a
cost model that knew the measured times would queue).

``--measure`` (one GPU, a few minutes: one kernel build per policy plus a traced one) then runs
each policy's schedule of the layer on backend="triton" as bench_layer does, times the
megakernel alone and traces one launch (kind_breakdown), so the measured waiting per kind of
each order sits beside the replay's prediction from that trace's own kind times:

    python benchmarks/replay_layer.py --measure --out $OUT
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # kind_breakdown beside it, run as a script or loaded by a test
from kind_breakdown import row_label  # noqa: E402

KINDS_JSON = HERE / "results" / "v12" / "bench_layer_kinds.json"


@dataclass
class Replay:
    """One replay: per task its take, ready, start and end time (seconds) and program."""

    makespan: float
    take: list[float]
    ready: list[float]
    end: list[float]
    program: list[int]
    blocker: list[int]  # the signaller met last (-1: the task waited for nothing)
    busy: dict[str, float] = field(default_factory=dict)  # kind -> summed task time
    wait: dict[str, float] = field(default_factory=dict)  # kind -> summed waiting

    @property
    def total_wait(self) -> float:
        return sum(self.wait.values())


def stage(name: str) -> str:
    """A task's stage: its name before the rank tag (``linear_4: matmul r0 [0:128,...]``)."""
    cut = name.find(" r")
    while cut >= 0 and not name[cut + 2 : cut + 3].isdigit():
        cut = name.find(" r", cut + 1)
    return name[:cut] if cut >= 0 else name


def kind_times_us(path: Path | str = KINDS_JSON) -> dict[str, float]:
    """kind -> measured mean body time (us) from a kind_breakdown JSON."""
    rows = json.loads(Path(path).read_text())
    return {r["kind"]: float(r["mean_work_us"]) for r in rows if "mean_work_us" in r}


def task_times(graph, kind_us: dict[str, float], hardware=None) -> list[float]:
    """Seconds per task: the cost model's, scaled per kind to the kind's measured mean (kinds
    without a measurement keep the cost model's time)."""
    from mgraph.hardware import H200
    from mgraph.scheduler import task_costs

    costs = task_costs(graph, hardware or H200)
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    # a task counts in its row (kind_breakdown.row_label) where that row was measured, else in
    # its kind's row where that was (measurements by kind alone keep the model's proportions)
    labels = []
    for t in graph.tasks:
        label = row_label(t.kind, t)
        labels.append(t.kind if label not in kind_us and t.kind in kind_us else label)
    for t, k in zip(graph.tasks, labels, strict=True):
        total[k] += costs[t.id]
        count[k] += 1
    scale = {
        k: kind_us[k] * 1e-6 * count[k] / total[k] for k in total if k in kind_us and total[k] > 0
    }
    # a label never measured (an ewise or gemm tile shape of another lowering) takes its kind's
    # measured mean, or the mean over the kind's measured rows, else the cost model's time
    for k in total:
        kind = k.split(" ")[0]
        if k in scale or kind == k or total[k] <= 0:
            continue
        means = [kind_us[kind]] if kind in kind_us else [
            v for m, v in kind_us.items() if m.startswith(kind + " ")]
        if means:
            scale[k] = sum(means) / len(means) * 1e-6 * count[k] / total[k]
    return [costs[t.id] * scale.get(k, 1.0) for t, k in zip(graph.tasks, labels, strict=True)]



def replay(schedule, times: list[float]) -> Replay:
    """The queue model of the module docstring, on every rank and role of ``schedule``.

    Each step places the head task of the queue whose program frees first among the queues
    whose head has all its waits' signallers placed (the queues are cut from one topological
    order, so some head always has), so every wait's time is known when its task is taken. A
    wait for fewer than all of an event's signals is met by the placed signallers only: exact
    when, as in the traced layer, a task waits for all of them."""
    graph = schedule.graph
    tasks = graph.tasks
    n = len(tasks)
    ends_of: dict[int, list[tuple[float, int]]] = defaultdict(list)  # event -> placed signals
    take, ready, end = [0.0] * n, [0.0] * n, [0.0] * n
    program, blocker = [-1] * n, [-1] * n
    queues = []  # [queue, head, heap of (free time, program)] per (rank, role) with tasks
    for rs in schedule.ranks:
        for role, q in rs.queues.items():
            if q:
                w = rs.workers.get(role, 0)
                assert w > 0, f"rank {rs.rank} {role} has tasks but no workers"
                queues.append([q, 0, [(0.0, p) for p in range(w)]])
    remaining = sum(len(q[0]) for q in queues)
    while remaining:
        best = None
        for qi, (q, head, free) in enumerate(queues):
            if head < len(q) and all(len(ends_of[e]) >= c for e, c in tasks[q[head]].waits):
                if best is None or free[0][0] < queues[best][2][0][0]:
                    best = qi
        assert best is not None, "the queues are cut from one topological order"
        q, head, free = queues[best]
        tid = q[head]
        queues[best][1] = head + 1
        remaining -= 1
        at, prog = heapq.heappop(free)
        met, by = 0.0, -1
        for e, c in tasks[tid].waits:
            t_met, s = sorted(ends_of[e])[c - 1]
            if t_met > met:
                met, by = t_met, s
        take[tid], ready[tid] = at, max(at, met)
        end[tid] = ready[tid] + times[tid]
        program[tid], blocker[tid] = prog, by if met > at else -1
        heapq.heappush(free, (end[tid], prog))
        for e in tasks[tid].signals:
            ends_of[e].append((end[tid], tid))
    busy: dict[str, float] = defaultdict(float)
    wait: dict[str, float] = defaultdict(float)
    for t in tasks:
        busy[t.kind] += end[t.id] - take[t.id]
        wait[t.kind] += ready[t.id] - take[t.id]
    return Replay(max(end, default=0.0), take, ready, end, program, blocker, dict(busy), dict(wait))


def boundaries(graph, rep: Replay, top: int = 8) -> list[dict]:
    """Waiting summed per (waiting stage, stage of the signaller met last), largest first."""
    names = [stage(t.name) for t in graph.tasks]
    wait: dict[tuple[str, str], float] = defaultdict(float)
    count: dict[tuple[str, str], int] = defaultdict(int)
    for t in graph.tasks:
        b = rep.blocker[t.id]
        if b >= 0:
            key = (names[t.id], names[b])
            wait[key] += rep.ready[t.id] - rep.take[t.id]
            count[key] += 1
    rows = [
        {"waiter": w, "waits_for": b, "tasks": count[w, b], "wait_ms": round(v * 1e3, 3)}
        for (w, b), v in sorted(wait.items(), key=lambda kv: -kv[1])
    ]
    return rows[:top]


def tail_idle(sched, rep: Replay) -> float:
    """Compute program-seconds idle after each program's last task until the makespan (a
    program that ran nothing: the whole makespan), over every rank."""
    tasks = sched.graph.tasks
    last: dict[tuple[int, int], float] = {}
    for t in tasks:
        if t.role == "compute":
            key = (t.rank, rep.program[t.id])
            last[key] = max(last.get(key, 0.0), rep.end[t.id])
    programs = sum(rs.workers.get("compute", 0) for rs in sched.ranks)
    return sum(rep.makespan - v for v in last.values()) + (programs - len(last)) * rep.makespan


# -- the layer ---------------------------------------------------------------------------------
def layer_program(
    hidden: int, heads: int, kv_heads: int, ffn: int, seq: int, dtype: str, topology: str = "1x1"
):
    """mg.compile of bench_layer's module and plan on ``topology`` (CPU reference backend)."""
    import torch

    sys.path.insert(0, str(HERE))
    import bench_layer

    import mgraph as mg

    args = argparse.Namespace(
        hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, dtype=getattr(torch, dtype)
    )
    layer = bench_layer.build_layer(args, torch.device("cpu"))
    x = torch.randn(1, seq, hidden, dtype=args.dtype)
    return mg.compile(layer, (x,), plan=bench_layer.mgraph_plan(), topology=topology)


def oracle_schedule(graph, times: list[float], hardware=None):
    """``critical_path``'s schedule with ``times`` as its task costs (what it would queue with
    a cost model that knew the measured times); the SM partition is the default one."""
    from mgraph.hardware import H200
    from mgraph.scheduler import RankSchedule, Schedule, policy_input, static_partition
    from mgraph.scheduler.policies import critical_path

    hw = hardware or H200
    world = graph.topology.world_size
    partition = static_partition(graph, hw)
    workers = [partition[r] for r in range(world)]
    order = critical_path(graph, policy_input(graph, list(times), None, workers))
    queues: list[dict[str, list[int]]] = [
        {"compute": [], "nvlink": [], "rdma": []} for _ in range(world)
    ]
    for tid in order:
        t = graph.tasks[tid]
        queues[t.rank][t.role].append(tid)
    ranks = [
        RankSchedule(rank=r, workers=workers[r], queues=queues[r], batches=[]) for r in range(world)
    ]
    sched = Schedule(graph=graph, hardware=hw, policy="critical_path (oracle costs)", ranks=ranks)
    sched.check()
    return sched


def report(graph, sched, times: list[float], label: str, top: int) -> dict:
    rep = replay(sched, times)
    return {
        "policy": label,
        "makespan_ms": round(rep.makespan * 1e3, 3),
        "wait_ms": round(rep.total_wait * 1e3, 2),
        "wait_ms_per_kind": {k: round(v * 1e3, 2) for k, v in sorted(rep.wait.items())},
        "busy_ms_per_kind": {k: round(v * 1e3, 2) for k, v in sorted(rep.busy.items())},
        "tail_idle_ms": round(tail_idle(sched, rep) * 1e3, 2),
        "boundaries": boundaries(graph, rep, top),
    }


def measure(args: argparse.Namespace, policies: list[str]) -> dict:
    """--measure (one GPU): each policy's schedule of the layer run as bench_layer runs it
    (backend="triton", one rank) and checked against the fp32 layer (bench_layer's bound),
    timed in two rounds that alternate the orders (the megakernel relaunched alone, CUDA
    events, median) and traced once (kind_breakdown: measured waiting per kind), with the
    replay's prediction from THAT trace's kind times beside it. ``--interpret`` runs it in
    Triton's interpreter on the CPU (a smoke check of this path: fp32, no clock, no times)."""
    import os
    import statistics

    import torch

    sys.path.insert(0, str(HERE))
    import bench_layer
    from kind_breakdown import kind_breakdown

    import mgraph as mg

    if args.interpret:
        device = torch.device("cpu")  # TRITON_INTERPRET=1 was set by main(), before imports
    else:
        # Read when CUDA starts (below), as bench_layer does (GPU.md: lazy loading can hang)
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    ns = argparse.Namespace(
        hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads, ffn=args.ffn, dtype=dtype
    )
    torch.manual_seed(1)
    x = torch.randn(1, args.seq, args.hidden, dtype=dtype).to(device)
    with torch.no_grad():
        want = bench_layer.build_layer(ns, device).float()(x.float())
    layer = bench_layer.build_layer(ns, device)
    progs: dict[str, object] = {}
    rows: dict[str, dict] = {}
    for policy in policies:  # compile and check every order first: their runtimes stay alive
        try:
            prog = mg.compile(
                layer,
                (x,),
                plan=bench_layer.mgraph_plan(),
                topology="1x1",
                backend="triton",
                policy=policy,
                backend_options={"interpret": True} if args.interpret else None,
            )
            with torch.no_grad():
                err = bench_layer.rel(prog(x), want)  # the first call builds the kernel
            ok = err < bench_layer.TOL
            rows[policy] = {"policy": policy, "status": "ok" if ok else "FAIL (error)",
                            "error": err, "times_ms": []}  # fmt: skip
            progs[policy] = prog
        except Exception as exc:  # noqa: BLE001 - one failing order must not hide the others
            rows[policy] = {"policy": policy, "status": f"FAIL {type(exc).__name__}: {exc}"[:400]}
    if not args.interpret:
        # Rounds that time every order in turn (bench_layer: the first timed in a run measured
        # slower than later ones); the megakernel relaunched alone, as bench_layer's
        # mgraph_kernel row (Program has no public accessor for its runtime)
        for _ in range(2):
            for policy, prog in progs.items():
                runtime = prog._runtime
                for _ in range(3):
                    runtime.launch()
                for _ in range(args.reps):
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    runtime.launch()
                    end.record()
                    torch.cuda.synchronize()
                    rows[policy]["times_ms"].append(start.elapsed_time(end))
                runtime.check()
    for policy, prog in progs.items():
        row = rows[policy]
        times = row.pop("times_ms")
        row["kernel_ms"] = round(statistics.median(times), 4) if times else None
        try:
            kinds = kind_breakdown(prog._runtime)
        except Exception as exc:  # noqa: BLE001 - the timed rows stand without a trace
            row["status"] = f"FAIL tracing: {type(exc).__name__}: {exc}"[:400]
            continue
        kind_us = {r["kind"]: float(r["mean_work_us"]) for r in kinds}
        graph = prog.graph
        predicted = report(graph, prog.schedule, task_times(graph, kind_us), policy, args.top)
        row.update(
            traced_makespan_ms=kinds[0]["makespan_ms"] if kinds else None,
            measured_wait_ms=round(sum(r["wait_ms"] for r in kinds), 3),
            measured_wait_ms_per_kind={r["kind"]: r["wait_ms"] for r in kinds},
            kinds=kinds,
            replay=predicted,
        )
    for row in rows.values():
        if "replay" not in row:
            print(f"{row['policy']}: {row['status']}", flush=True)
            continue
        print(
            f"{row['policy']}: {row['status']}, kernel {row['kernel_ms']} ms (traced "
            f"{row['traced_makespan_ms']} ms), error {row['error']:.2e}, measured waiting "
            f"{row['measured_wait_ms']} ms {row['measured_wait_ms_per_kind']}; replay with this "
            f"trace's kind times: {row['replay']['makespan_ms']} ms, waiting "
            f"{row['replay']['wait_ms']} ms",
            flush=True,
        )
    return {
        "measured": list(rows.values()),
        "device": str(device),
        "interpret": bool(args.interpret),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument(
        "--topology",
        default="1x1",
        help="replay the layer lowered for this topology (one node: e.g. 1x2, as bench_layer on "
        "2 GPUs; the kind times stay the 1-rank measurement's)",
    )
    p.add_argument("--kinds", default=str(KINDS_JSON), help="kind_breakdown JSON (measured)")
    p.add_argument(
        "--ewise-us",
        type=float,
        action="append",
        default=[],
        help="also replay with ewise tasks at this mean (us); repeatable",
    )
    p.add_argument("--policy", action="append", help="default: longest_path and critical_path")
    p.add_argument(
        "--oracle",
        action="store_true",
        help="also critical_path ordered with the replay's own task times as costs",
    )
    p.add_argument("--sim", action="store_true", help="also runtime/sim on each schedule")
    p.add_argument("--top", type=int, default=6, help="stage boundaries shown per replay")
    p.add_argument("--out", help="write replay_layer.json here")
    p.add_argument(
        "--measure",
        action="store_true",
        help="one GPU: run, time and trace each policy's schedule (measure())",
    )
    p.add_argument(
        "--interpret",
        action="store_true",
        help="with --measure: Triton's interpreter on the CPU (a smoke check)",
    )
    p.add_argument("--reps", type=int, default=10, help="with --measure: timed launches")
    args = p.parse_args(argv)
    if args.measure and args.topology != "1x1":
        p.error("--measure runs one GPU: --topology 1x1")
    if args.interpret and not args.measure:
        p.error("--interpret goes with --measure")
    if args.interpret:  # read when triton is imported: before mgraph is
        import os

        os.environ["TRITON_INTERPRET"] = "1"

    from mgraph.scheduler import schedule

    t0 = time.perf_counter()
    prog = layer_program(
        args.hidden, args.heads, args.kv_heads, args.ffn, args.seq, args.dtype, args.topology
    )
    graph = prog.graph
    print(f"layer: {len(graph.tasks)} tasks, built in {time.perf_counter() - t0:.1f} s")
    measured = json.loads(Path(args.kinds).read_text())
    kind_us = {r["kind"]: float(r["mean_work_us"]) for r in measured}
    print(
        "measured ("
        + Path(args.kinds).name
        + "): "
        + ", ".join(
            f"{r['kind']} {r['mean_work_us']} us/task, waiting {r['wait_ms']} ms" for r in measured
        )
        + f"; makespan {measured[0].get('makespan_ms')} ms"
    )
    here = defaultdict(int)
    for t in graph.tasks:
        here[row_label(t.kind, t)] += 1
    moved = {r["kind"]: (r["tasks"], here[r["kind"]]) for r in measured if "tasks" in r}
    moved = {k: v for k, v in moved.items() if v[0] != v[1]}
    if moved:  # a lowering changed since the measurement: its per-task means are a guess here
        print("note: tasks per kind measured -> here: " + ", ".join(
            f"{k} {a} -> {b}" for k, (a, b) in sorted(moved.items())
        ) + " (each task keeps the measured kind's mean; --measure re-measures)")  # fmt: skip
    out_moved = {k: list(v) for k, v in moved.items()}
    policies = args.policy or ["longest_path", "critical_path"]
    scheds = {name: schedule(graph, policy=name) for name in policies}
    out: dict = {"tasks": len(graph.tasks), "kinds": args.kinds, "cases": []}
    out["tasks_per_kind_measured_vs_here"] = out_moved
    code = 0
    for ewise in [None, *args.ewise_us]:
        us = dict(kind_us) if ewise is None else {**kind_us, "ewise": ewise}
        times = task_times(graph, us)
        # compute work over compute programs (every policy gets the same static partition)
        programs = sum(rs.workers.get("compute", 0) for rs in next(iter(scheds.values())).ranks)
        work = sum(times[t.id] for t in graph.tasks if t.role == "compute")
        bound = work / max(programs, 1)
        case = {"ewise_us": us.get("ewise"), "work_bound_ms": round(bound * 1e3, 3), "rows": []}
        title = "measured kind times" if ewise is None else f"ewise at {ewise:g} us a task"
        print(f"\n== {title}: compute work / compute programs = {bound * 1e3:.3f} ms")
        runs = list(scheds.items())
        if args.oracle:
            runs.append(("critical_path (oracle costs)", oracle_schedule(graph, times)))
        for name, sched in runs:
            row = report(graph, sched, times, name, args.top)
            if args.sim:
                from mgraph.runtime.sim import simulate

                row["sim_ms"] = round(simulate(sched, baselines=False).predicted_s * 1e3, 3)
            case["rows"].append(row)
            sim = f", runtime/sim {row['sim_ms']} ms" if "sim_ms" in row else ""
            print(
                f"{name}: makespan {row['makespan_ms']} ms, waiting {row['wait_ms']} ms "
                f"{row['wait_ms_per_kind']}, idle after last task {row['tail_idle_ms']} ms{sim}"
            )
            for b in row["boundaries"]:
                print(
                    f"    {b['waiter']:40s} waits for {b['waits_for']:40s} "
                    f"{b['tasks']:5d} tasks {b['wait_ms']:8.2f} ms"
                )
        out["cases"].append(case)
    if args.measure:
        out.update(measure(args, policies))
        if any(r["status"] != "ok" for r in out["measured"]):
            code = 1
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "replay_layer.json").write_text(json.dumps(out, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
