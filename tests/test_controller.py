"""The controller's rule (mgraph/scheduler/controller.py): its cases, its kernel-form mirror, the
recorded progress traces it must keep deciding the same way, and the two runtimes that call it.

tests/data/controller_traces.json is recorded by ``python tests/test_controller.py --record``
(simulator and CPU reference runtime, on the GRAPHS below); re-record only when the rule is
meant to change, and say why in the commit.
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mgraph as mg
from mgraph.runtime.reference import ReferenceRuntime
from mgraph.runtime.sim.engine import Engine
from mgraph.scheduler.controller import (
    COST_CAP,
    LEFT_CAP,
    MAX_WORKERS,
    TIME_CAP,
    RoleProgress,
    Split,
    Window,
    decide,
    decide_mirror,
)
from mgraph.settings import Settings

TRACES = Path(__file__).parent / "data" / "controller_traces.json"

# (op, topology, options): graphs with both compute and NVLink tasks on a rank. 2x1 has no NVLink
# role (one GPU per node), so the controller has nothing to split there.
REFERENCE_GRAPHS = [
    ("gemm_allreduce", "2x2", dict(M=64, N=96, K=32, tile=[16, 32], chunk_bytes=2048)),
    ("allgather_gemm", "2x2", dict(M=64, N=64, K=32, tile=[8, 16], chunk_bytes=1024, gather="copy")),
    ("allgather_gemm", "1x2", dict(M=64, N=64, K=32, tile=[8, 16], chunk_bytes=1024, gather="copy")),
]  # fmt: skip
SIM_GRAPHS = [
    ("gemm_allreduce", "2x2", dict(M=8192, N=8192, K=2048, chunk_bytes=65536), 10e-6),
    ("allgather_gemm", "2x2", dict(M=8192, N=8192, K=2048, chunk_bytes=65536, gather="copy"), 10e-6),
    ("allgather_gemm", "1x2", dict(M=8192, N=8192, K=2048, chunk_bytes=65536, gather="copy"), 10e-6),
]  # fmt: skip


def case(w: Window) -> str:
    """Which of the rule's cases decided a window."""
    c, s = w.compute, w.comm
    if c.left == 0 or s.left == 0:
        return "finished"
    pool = c.workers + s.workers
    if max(1, pool - c.left) > min(pool - 1, s.left, w.max_comm):
        return "few"
    stalled = [
        name
        for name, r in (("comm", s), ("compute", c))
        if w.window and r.workers and 2 * r.wait >= r.workers * w.window
    ]
    moved = "move" if w.previous is None or w.split.comm != w.previous else "hold"
    return "+".join([f"stall_{n}" for n in stalled] + [moved])


def mirror(w: Window) -> Split:
    c, s = w.compute, w.comm
    return Split(
        *decide_mirror(
            c.left, c.done, c.run, c.wait, c.workers, c.prior,
            s.left, s.done, s.run, s.wait, s.workers, s.prior,
            w.window, -1 if w.previous is None else w.previous, w.max_comm,
        )
    )  # fmt: skip


def progress(**kw) -> RoleProgress:
    base = dict(left=100, done=10, run=10_000, wait=0, workers=8, prior=0)
    base.update(kw)
    return RoleProgress(**base)


# -- the rule's cases ----------------------------------------------------------------------------
def test_a_finished_role_gives_its_workers_away_at_once():
    done = progress(left=0)
    assert decide(done, progress(), window=1000, previous=1) == Split(0, 16)
    assert decide(progress(), done, window=1000, previous=15) == Split(16, 0)
    # Both finished: nothing to gain from a move, the split stays.
    assert decide(done, done, window=1000, previous=5) == Split(11, 5)
    assert decide(done, progress(left=0, workers=3), window=1000) == Split(8, 3)


def test_target_and_damping():
    # Equal costs, 9000 comm tasks to 1000 compute tasks on 100 workers: target 90, half the gap
    # a step.
    kw = dict(window=1000)
    c = progress(left=1000, workers=99, run=1000, done=1)
    steps, comm = [], 1
    while True:
        nxt = decide(c, progress(left=9000, workers=1, run=1000, done=1), previous=comm, **kw).comm
        if nxt == comm:
            break
        steps.append(nxt)
        comm = nxt
    assert comm == 90 and steps[:4] == [45, 67, 78, 84]
    assert (
        decide(c, progress(left=9000, workers=1, run=1000, done=1), **kw).comm == 90
    )  # no history
    # Compute has 10 tasks left: 89 of its 99 workers would idle, so comm gets them undamped.
    c10 = progress(left=10, workers=99, run=1000, done=1)
    # jumps to 90 (the least that leaves compute no idle worker), then half the gap to 99:
    assert decide(c10, progress(left=9000, workers=1), previous=1, **kw).comm == 94


def test_measured_cost_wins_over_the_estimate():
    # comm tasks measured 3x as long as compute's: 3/4 of 16 workers; the estimates say otherwise.
    c = progress(done=10, run=10_000, prior=9_000_000, workers=8)
    s = progress(done=10, run=30_000, prior=1, workers=8)
    assert decide(c, s, window=0).comm == 12
    # Nothing finished yet: the estimates decide; a role without one is costed like the other.
    c0, s0 = progress(done=0, run=0, prior=100), progress(done=0, run=0, prior=300)
    assert decide(c0, s0, window=0).comm == 12
    assert decide(c0, progress(done=0, run=0, prior=0), window=0).comm == 8
    assert decide(progress(done=0, prior=0), progress(done=0, prior=0), window=0).comm == 8


def test_a_stalled_role_gains_no_workers():
    # comm's work says 12 of 16, but its 8 workers spent half the window blocked: it stays at 8.
    c = progress(run=10_000, workers=8)
    s_busy = progress(run=30_000, workers=8)
    s_stalled = progress(run=30_000, workers=8, wait=8 * 1000 // 2)
    assert decide(c, s_busy, window=1000, previous=8).comm == 10
    assert decide(c, s_stalled, window=1000, previous=8).comm == 8
    assert decide(c, progress(run=30_000, workers=8, wait=3999), window=1000, previous=8).comm == 10
    # ... but it may lose them: compute's work says 1 of 16 for comm, half the gap is 3.
    assert decide(c, progress(run=1_000, workers=8, wait=8000), window=1000, previous=8).comm == 5
    # A stalled compute gains none either; both stalled: the split holds.
    c_stalled = progress(run=30_000, workers=8, wait=4000)
    assert decide(c_stalled, progress(run=10_000), window=1000, previous=8).comm == 8
    assert decide(c_stalled, s_stalled, window=1000, previous=8).comm == 8
    assert decide(c, s_stalled, window=0, previous=8).comm == 10  # no window: no stall


def test_too_few_tasks_left_to_matter():
    # 3 compute and 2 comm tasks on 16 workers: any split with >= 3 compute and >= 2 comm
    # serves them all, so the split moves only into that range, without damping.
    c, s = progress(left=3, workers=8), progress(left=2, workers=8, run=10**6)
    assert decide(c, s, window=1000, previous=8).comm == 8
    assert decide(c, s, window=1000, previous=1).comm == 2
    assert decide(c, s, window=1000, previous=15).comm == 13
    # No role gets more workers than it has tasks left: 5 comm tasks however costly.
    assert decide(progress(left=1000), progress(left=5, run=10**9), window=0).comm == 5
    assert decide(progress(left=1000), progress(left=5000, run=10**9), window=0, max_comm=3) == (
        Split(13, 3)
    )


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(compute=progress(left=-1)), "compute.left"),
        (dict(comm=progress(run=2**62)), "comm.run"),
        (dict(comm=progress(workers=1.0)), "comm.workers"),
        (dict(compute=progress(done=True)), "compute.done"),
        (dict(compute=progress(workers=1), comm=progress(workers=0)), "pool at least 2"),
        (dict(compute=progress(workers=MAX_WORKERS)), "at most"),
        (dict(window=TIME_CAP + 1), "window"),
        (dict(window=-1), "window"),
        (dict(previous=17), "previous"),
        (dict(previous=-1), "previous"),
        (dict(max_comm=0), "max_comm"),
        (dict(compute={"left": 1}), "RoleProgress"),
    ],
)
def test_invalid_inputs(kw, match):
    args = dict(compute=progress(), comm=progress(), window=1000, previous=8, max_comm=16)
    args.update(kw)
    with pytest.raises(mg.ScheduleError, match=match) as info:
        decide(args.pop("compute"), args.pop("comm"), **args)
    assert "controller.decide" in str(info.value) and info.value.hint


# -- properties and the mirror on random inputs --------------------------------------------------
@st.composite
def windows(draw):
    big = st.one_of(st.integers(0, 10**6), st.sampled_from([0, 1, COST_CAP, 2**40, 2**61]))
    pool = draw(st.integers(2, 300))
    cw = draw(st.integers(0, pool))

    def role(workers):
        return RoleProgress(
            left=draw(st.one_of(st.integers(0, 400), st.sampled_from([0, 1, LEFT_CAP, 2**30]))),
            done=draw(st.one_of(st.integers(0, 50), big)),
            run=draw(big),
            wait=draw(big),
            workers=workers,
            prior=draw(big),
        )

    return Window(
        rank=0,
        time=0,
        compute=role(cw),
        comm=role(pool - cw),
        window=draw(st.one_of(st.integers(0, 5000), st.just(TIME_CAP))),
        previous=draw(st.one_of(st.none(), st.integers(0, pool))),
        max_comm=draw(st.integers(1, MAX_WORKERS)),
        split=Split(0, 0),
    )


@settings(max_examples=250, deadline=None)
@given(windows())
def test_mirror_equals_the_rule(w):
    assert mirror(w) == w.replay()


@settings(max_examples=250, deadline=None)
@given(windows())
def test_bounds_and_damping(w):
    got = w.replay()
    c, s = w.compute, w.comm
    pool = c.workers + s.workers
    assert got.compute + got.comm == pool and 0 <= got.comm <= pool
    if not (c.left and s.left):
        return
    lo, hi = max(1, pool - c.left), min(pool - 1, s.left, w.max_comm)
    if lo > hi:
        assert hi <= got.comm <= lo
        return
    assert lo <= got.comm <= hi  # each role keeps a worker, the cap and the task counts hold
    undamped = decide(c, s, window=0, max_comm=w.max_comm).comm
    if w.previous is not None:
        cur = min(max(w.previous, lo), hi)
        stalled = w.window and any(r.workers and 2 * r.wait >= r.workers * w.window for r in (c, s))
        if not stalled:  # a damped step toward the target: never past it, at least one worker
            assert min(cur, undamped) <= got.comm <= max(cur, undamped)
            assert (got.comm == cur) == (cur == undamped)
            assert abs(got.comm - cur) <= max(1, abs(undamped - cur) // 2)


def test_mirror_on_random_inputs_with_edges():
    rng = random.Random(7)
    edges = [0, 1, 2, 3, COST_CAP, COST_CAP + 1, LEFT_CAP + 1, 2**40, 2**61]
    for _ in range(20_000):
        pick = lambda hi: rng.choice(edges) if rng.random() < 0.2 else rng.randint(0, hi)  # noqa: E731
        pool = rng.randint(2, 200)
        cw = rng.randint(0, pool)
        roles = [
            RoleProgress(pick(300), pick(40), pick(10**7), pick(10**5), n, pick(10**5))
            for n in (cw, pool - cw)
        ]
        prev = rng.choice([None, rng.randint(0, pool)])
        w = Window(0, 0, *roles, rng.randint(0, 10**5), prev, rng.randint(1, 300), Split(0, 0))
        assert mirror(w) == w.replay(), w


# -- recorded traces ------------------------------------------------------------------------------
def load_traces() -> list[tuple[str, Window]]:
    doc = json.loads(TRACES.read_text())
    return [(src["runtime"], Window.from_json(w)) for src in doc["sources"] for w in src["windows"]]


def test_recorded_traces_decide_the_same():
    traces = load_traces()
    assert {rt for rt, _ in traces} == {"sim", "reference"}
    for runtime, w in traces:
        assert w.replay() == w.split, (runtime, w)
        assert mirror(w) == w.split, (runtime, w)


def test_recorded_traces_cover_every_case():
    cases = Counter(case(w) for _, w in load_traces())
    seen = {part for c in cases for part in c.split("+")}
    assert {"finished", "few", "stall_comm", "stall_compute", "move", "hold"} <= seen, cases


# -- the runtimes call the rule ----------------------------------------------------------------
def build(op: str, topology: str, options: dict, dtype=torch.float32) -> mg.TaskGraph:
    return mg.ops.get_op(op)(topology=topology, dtype=dtype, **options)


def sim_windows(op, topology, options, period) -> tuple[Engine, list[Window]]:
    sched = mg.schedule(build(op, topology, options, torch.bfloat16))
    engine = Engine(sched, sched.hardware, adaptive=True, period=period)
    engine.run()
    return engine, engine.windows


@pytest.mark.parametrize(
    "op,topology,options",
    [
        ("gemm_allreduce", "2x2", dict(M=2048, N=2048, K=1024, chunk_bytes=65536)),
        ("allgather_gemm", "2x2", dict(M=4096, N=4096, K=2048, chunk_bytes=65536, gather="copy")),
    ],
)
def test_simulator_decides_by_the_rule_and_moves_sms(op, topology, options):
    engine, wins = sim_windows(op, topology, options, 2e-6)
    assert wins
    moved = False
    for w in wins:
        assert w.replay() == w.split
        moved |= w.previous is not None and w.split.comm != w.previous
    assert moved
    # The SMs follow: one SM ran tasks of both roles, and each rank keeps its pool's size.
    for rank in range(len(engine.workers)):
        assert sum(engine.assigned[rank][:2]) == sum(engine.workers[rank][:2])
    roles = defaultdict(set)
    for r in engine.records:
        if r.role != "rdma":
            roles[(r.rank, r.worker)].add(r.role)
    assert any(len(v) == 2 for v in roles.values())


def run_reference(sched, inputs, **kw):
    with ReferenceRuntime(sched, Settings(**kw)) as rt:
        first = rt.run(inputs)
        windows = list(rt.windows)
        again = rt.run(inputs)  # a relaunch: epoch 2, counters not reset
    return first, again, windows


@pytest.mark.parametrize("op,topology,options", REFERENCE_GRAPHS)
def test_reference_adaptive_is_bit_identical_and_decides_by_the_rule(op, topology, options):
    graph = build(op, topology, options)
    sched = mg.schedule(graph)
    inputs = mg.ops.get_op(op).random_inputs(graph, seed=3)
    base, _, none = run_reference(sched, inputs)
    assert none == []
    want = mg.ops.get_op(op).run_reference(inputs, graph.params)
    for window_us in (1.0, 50.0):
        first, again, wins = run_reference(
            sched, inputs, adaptive=True, adaptive_window_us=window_us
        )
        for out in (first, again):
            for name in graph.outputs:
                assert torch.equal(out.outputs[name], base.outputs[name]), (name, window_us)
                torch.testing.assert_close(out.outputs[name], want[name], rtol=1e-4, atol=1e-4)
        assert wins and all(w.replay() == w.split for w in wins)
        assert all(w.window >= window_us * 1e3 for w in wins)
        # Threads changed role at task boundaries: one thread ran both compute and nvlink tasks.
        roles = defaultdict(set)
        for r in first.trace.records:
            if r.role != "rdma":
                roles[(r.rank, r.worker)].add(r.role)
        assert any(len(v) == 2 for v in roles.values()), dict(roles)


# -- recording the traces -------------------------------------------------------------------------
def _pick(wins: list[Window], n: int) -> list[Window]:
    """Up to ``n`` windows: the first two of every case, then evenly spaced ones."""
    chosen, per = [], Counter()
    for i, w in enumerate(wins):
        if per[case(w)] < 2:
            per[case(w)] += 1
            chosen.append(i)
    rest = [i for i in range(len(wins)) if i not in set(chosen)]
    step = max(1, len(rest) // max(1, n - len(chosen)))
    chosen += rest[::step][: max(0, n - len(chosen))]
    return [wins[i] for i in sorted(set(chosen))]


def record() -> dict:
    sources = []
    for op, topology, options, period in SIM_GRAPHS:
        _, wins = sim_windows(op, topology, options, period)
        sources.append(
            dict(runtime="sim", op=op, topology=topology, options=options, period_us=period * 1e6,
                 windows=[w.to_json() for w in _pick(wins, 40)])
        )  # fmt: skip
    for op, topology, options in REFERENCE_GRAPHS:
        graph = build(op, topology, options)
        inputs = mg.ops.get_op(op).random_inputs(graph, seed=3)
        _, _, wins = run_reference(mg.schedule(graph), inputs, adaptive=True, adaptive_window_us=50)
        sources.append(
            dict(runtime="reference", op=op, topology=topology, options=options,
                 window_us=50.0, windows=[w.to_json() for w in _pick(wins, 30)])
        )  # fmt: skip
    return {
        "about": "controller.decide's inputs and decisions as the simulator (bf16 graphs, H200 "
        "profile) and the CPU reference runtime (fp32) recorded them; times in ns. Recorded by "
        "python tests/test_controller.py --record",
        "sources": sources,
    }


if __name__ == "__main__" and "--record" in sys.argv:
    doc = record()
    TRACES.parent.mkdir(exist_ok=True)
    TRACES.write_text(json.dumps(doc, indent=None, separators=(",", ":")) + "\n")
    for src in doc["sources"]:
        cases = Counter(case(Window.from_json(w)) for w in src["windows"])
        print(src["runtime"], src["op"], src["topology"], len(src["windows"]), dict(cases))


# -- the mirror as Triton runs it ------------------------------------------------------------------
# decide_mirror transcribed into a Triton program, one window per lane (so every case is taken in
# some lane and the where-selects matter), run under TRITON_INTERPRET=1 in a subprocess.
TRITON_MIRROR = """
import json, sys
import torch
import triton
import triton.language as tl

from mgraph.runtime.megakernel.control import decide  # the megakernel's copy of the rule


@triton.jit
def controller(inp, out, n, BLOCK: tl.constexpr):
    lane = tl.arange(0, BLOCK)
    m = lane < n
    row = inp + lane * 15
    comm = decide(*[tl.load(row + f, mask=m, other=1 if f == 14 else 0) for f in range(15)])
    tl.store(out + lane, comm, mask=m)


rows = json.loads(sys.stdin.read())
inp = torch.tensor(rows, dtype=torch.int64)
out = torch.full((len(rows),), -7, dtype=torch.int64)
controller[(1,)](inp, out, len(rows), BLOCK=triton.next_power_of_2(len(rows)))
print(json.dumps(out.tolist()))
"""


def test_mirror_runs_as_a_triton_program(tmp_path):
    """The megakernel's copy of the rule (control.decide), one window per lane, matches the
    rule. Damping and stall fractions are 1/2 here, as DAMP_* and STALL_* say."""
    import os

    from helpers import run_interpreted
    from mgraph.scheduler import controller as ctl

    pytest.importorskip("triton")
    assert (ctl.DAMP_NUM, ctl.DAMP_DEN, ctl.STALL_NUM, ctl.STALL_DEN) == (1, 2, 1, 2)
    wins = [w for _, w in load_traces()]
    rng = random.Random(11)
    for _ in range(200):
        pool = rng.randint(2, 160)
        cw = rng.randint(0, pool)
        roles = [
            RoleProgress(
                rng.choice([0, 1, 3, rng.randint(0, 400), LEFT_CAP + 5]),
                rng.choice([0, rng.randint(1, 50)]),
                rng.choice([0, rng.randint(0, 10**7), 2**50]),
                rng.randint(0, 200 * n * 1000),
                n,
                rng.choice([0, rng.randint(1, 10**5)]),
            )
            for n in (cw, pool - cw)
        ]
        prev = rng.choice([None, rng.randint(0, pool)])
        wins.append(Window(0, 0, *roles, 1000, prev, rng.randint(1, 200), Split(0, 0)))
    rows = [
        [w.compute.left, w.compute.done, w.compute.run, w.compute.wait, w.compute.workers,
         w.compute.prior, w.comm.left, w.comm.done, w.comm.run, w.comm.wait, w.comm.workers,
         w.comm.prior, w.window, -1 if w.previous is None else w.previous, w.max_comm]
        for w in wins
    ]  # fmt: skip
    script = tmp_path / "controller_interp.py"
    script.write_text(TRITON_MIRROR)
    proc = run_interpreted([str(script)], dict(os.environ, TRITON_INTERPRET="1"), timeout=300,
                           input=json.dumps(rows))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == [w.replay().comm for w in wins]


def test_reference_pool_never_integrates_wait_time_backwards():
    """Threads read the clock before taking the pool's lock, so wait updates can arrive out of
    time order; the wait handed to the rule must stay non-negative (a negative one is a
    ScheduleError from decide, which a loaded CI machine once hit)."""
    from mgraph.runtime.reference import _Pool

    log: list = []
    pool = _Pool(0, [list(range(8)), list(range(8, 16))], [2, 2], window=100, max_comm=4, log=log)
    pool.wait_count(1, 1_000, +1)  # two nvlink threads start waiting
    pool.wait_count(1, 1_500, +1)
    pool.take(0, 2_000)  # a decision at t=2000
    pool.wait_count(1, 1_600, -1)  # a thread whose clock read (t=1600) lost the race to the lock
    pool.take(0, 2_200)  # the next decision: its wait must not be negative (decide would raise)
    assert len(log) == 2 and all(w.comm.wait >= 0 and w.compute.wait >= 0 for w in log), log
