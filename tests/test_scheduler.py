from __future__ import annotations

import json

import networkx as nx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mgraph as mg
from helpers import TOPOLOGIES, rel_err
from mgraph.builder import GraphBuilder
from mgraph.kinds import KINDS, Role
from mgraph.runtime import allocate, gather_outputs, region_view, shard_inputs
from mgraph.scheduler import (
    POLICIES,
    RankSchedule,
    Schedule,
    check_queues,
    policy_input,
    register_policy,
    task_cost,
    task_costs,
)
from mgraph.scheduler.costmodel import remote_bytes

BUILTIN = ["topological", "critical_path", "remote_first"]

# Small shapes per op, as a function of the world size: EVERY built-in op has one
# (test_every_builtin_op_has_a_small_shape fails otherwise), so each runs under every policy.
SMALL = {
    "gemm": lambda w: dict(M=16 * w, N=64, K=32, tile=[8, 32]),
    "matmul": lambda w: dict(M=16 * w, N=64, K=32, tile=[8, 32]),
    "matmul_glu": lambda w: dict(M=16 * w, N=128, K=32, tile=[8, 128]),
    "attention": lambda w: dict(B=2, H=2, S=32, D=16, block=8, causal=True),
    "elementwise": lambda w: dict(rows=16 * w, cols=24, fn="mul", other="full", tile_rows=8),
    "layer_norm": lambda w: dict(rows=16 * w, cols=24, tile_rows=8),
    "rms_norm": lambda w: dict(rows=16 * w, cols=24, tile_rows=8),
    "row_reduce": lambda w: dict(rows=16 * w, cols=24, tile_rows=8),
    "softmax": lambda w: dict(rows=16 * w, cols=24, tile_rows=8),
    "relayout": lambda w: dict(rows=16 * w, cols=24, tile_rows=8),
    "concat": lambda w: dict(rows=16 * w, cols=24, cols_y=8, tile_rows=8),
    "gemm_allreduce": lambda w: dict(M=64, N=96, K=32, tile=[16, 32], chunk_bytes=2048),
    "gemm_reduce_scatter": lambda w: dict(M=128, N=96, K=32, tile=[8, 32], chunk_bytes=2048),
    "allgather_gemm": lambda w: dict(M=16 * w, N=32 * w, K=32, tile=[8, 32], chunk_bytes=2048),
    "ring_attention": lambda w: dict(B=2, H=2, S=64, D=16, block=4, chunk_bytes=1000),
    "moe_dispatch_combine": lambda w: dict(
        T=8 * w, E=2 * w, top_k=2, H=16, F=32, expert_rows=8, combine_cols=8
    ),
}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    # Tiles here are tiny: a second intra-op thread only adds contention (100x slower when the
    # cores are shared with other test processes).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def builtin_ops() -> list[str]:
    """Ops defined by mgraph itself (not ones a test registered with mg.register_op)."""
    return [
        name for name in mg.ops.op_names()
        if mg.ops.get_op(name).lower_fn.__module__ not in ("mgraph.ops.custom",)
        and mg.ops.get_op(name).lower_fn.__module__.startswith("mgraph.ops.")
    ]


def build(op: str, topology: str) -> mg.TaskGraph:
    world = mg.Topology.parse(topology).world_size
    return mg.ops.get_op(op)(topology=topology, **SMALL[op](world))


def assert_runnable(s: Schedule) -> list[int]:
    """Independent of check_queues: the merged order is a permutation the counters allow, and
    every queue is a subsequence of it holding only its own rank's tasks of its role."""
    g = s.graph
    order = s.order()
    assert sorted(order) == list(range(len(g.tasks)))
    pos = [0] * len(order)
    for i, tid in enumerate(order):
        pos[tid] = i
    assert [rs.rank for rs in s.ranks] == list(g.topology.ranks)
    for rs in s.ranks:
        assert set(rs.queues) == {"compute", "nvlink", "rdma"}
        for role, q in rs.queues.items():
            assert [pos[t] for t in q] == sorted(pos[t] for t in q), (rs.rank, role)
            assert all(g.tasks[t].rank == rs.rank and g.tasks[t].role == role for t in q)
            if q:
                assert rs.workers[role] >= 1
        assert sum(rs.workers.values()) <= s.hardware.sms
        flat = [t for b in rs.batches for t in b]
        assert flat == rs.queues["rdma"]
        for batch in rs.batches:
            assert 1 <= len(batch) <= s.hardware.proxy_batch
            dsts = {g.buffers[g.tasks[t].writes[0].buffer].rank for t in batch}
            assert len(dsts) == 1, "a proxy batch goes to one destination"
    count = [0] * len(g.events)
    for tid in order:
        t = g.tasks[tid]
        assert all(count[e] >= c for e, c in t.waits), f"{t.name} runs before its inputs"
        for e in t.signals:
            count[e] += 1
    return order


def run_in_order(g: mg.TaskGraph, order: list[int], inputs: dict) -> dict:
    mem = allocate(g)
    shard_inputs(g, inputs, mem)
    for tid in order:
        t = g.tasks[tid]
        KINDS[t.kind].run_cpu(
            t, [region_view(mem, r) for r in t.reads], [region_view(mem, w) for w in t.writes]
        )
    return gather_outputs(g, mem)


# -- every op, every policy --------------------------------------------------------------------
def test_builtin_policies_registered():
    assert set(BUILTIN) <= set(POLICIES)


@pytest.mark.parametrize("op", sorted(SMALL))
@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_queues_consistent_every_policy(op, topology):
    g = build(op, topology)
    reference = mg.ops.get_op(op)
    inputs = reference.random_inputs(g, seed=1)
    want = reference.run_reference(inputs, g.params)
    for policy in BUILTIN:
        s = mg.schedule(g, policy=policy)
        assert s.policy == policy
        order = assert_runnable(s)
        got = run_in_order(g, order, inputs)  # the schedule's order computes the op
        for name in g.outputs:
            assert rel_err(got[name], want[name]) < 1e-4, (op, topology, policy, name)


def test_every_builtin_op_has_a_small_shape():
    missing = sorted(set(builtin_ops()) - set(SMALL))
    assert not missing, f"add a small shape to SMALL for {missing}: they run under no policy"
    assert len(SMALL) >= 14


def test_topological_is_program_order():
    g = build("gemm_allreduce", "2x4")
    s = mg.schedule(g, policy="topological")
    for rs in s.ranks:
        for q in rs.queues.values():
            assert q == sorted(q)  # the lowering emits producers first, so ids are topological


def _feeds(g: mg.TaskGraph, name_prefix: str) -> set[int]:
    nxg = g.to_networkx()
    return {
        t.id
        for t in g.tasks
        if any(g.tasks[d].name.startswith(name_prefix) for d in nx.descendants(nxg, t.id))
    }


@pytest.mark.parametrize("policy", ["remote_first", "critical_path"])
def test_tiles_that_cross_the_network_go_first(policy):
    g = build("gemm_allreduce", "2x2")
    sent = _feeds(g, "rail-send")
    s = mg.schedule(g, policy=policy)
    for rs in s.ranks:
        gemms = [t for t in rs.queues["compute"] if g.tasks[t].kind == "gemm"]
        flags = [t in sent for t in gemms]
        assert any(flags) and not all(flags)
        assert flags == sorted(flags, reverse=True), f"rank {rs.rank}: {flags}"


def test_remote_first_beats_a_longer_local_chain():
    # Rank 0: a long local chain of heavy tiles, and one light tile whose result rank 1 needs.
    # critical_path starts the long chain; remote_first starts the tile the network waits for.
    topo = mg.Topology.parse("2x1")
    b = GraphBuilder("two_chains", topo, "float32", {})
    src = b.buffer("src", 0, 4, 4)
    dst = [b.buffer("dst", r, 4, 4) for r in topo.ranks]
    prev = None
    for i in range(3):
        prev = b.task(
            0,
            Role.COMPUTE,
            "copy",
            [src.region((i, i + 1))],
            [dst[0].region((i, i + 1))],
            waits=b.after(0, [prev] if prev else []),
            flops=1e12,
            name=f"local{i}",
        )
    light = b.task(
        0, Role.COMPUTE, "copy", [src.region((3, 4))], [dst[0].region((3, 4))], name="light"
    )
    b.task(
        0,
        Role.RDMA,
        "copy",
        [dst[0].region((3, 4))],
        [dst[1].region((3, 4))],
        waits=b.after(0, [light]),
        name="send",
    )
    g = b.finish()
    first = {
        p: g.tasks[mg.schedule(g, policy=p).queue(0, "compute")[0]].name
        for p in ("critical_path", "remote_first")
    }
    assert first == {"critical_path": "local0", "remote_first": "light"}


# -- random graphs -----------------------------------------------------------------------------
@st.composite
def random_graphs(draw) -> mg.TaskGraph:
    topo = mg.Topology.parse(draw(st.sampled_from(["1x1", "1x2", "2x1", "2x2", "3x2"])))
    n = draw(st.integers(1, 30))
    b = GraphBuilder("random", topo, "float32", {})
    src = [b.buffer("src", r, 1, 4) for r in topo.ranks]
    dst = [b.buffer("dst", r, n, 4) for r in topo.ranks]
    roles = [Role.COMPUTE, Role.NVLINK] + ([Role.RDMA] if topo.nodes > 1 else [])
    tasks = []
    for i in range(n):
        rank = draw(st.integers(0, topo.world_size - 1))
        role = draw(st.sampled_from(roles))
        target = rank
        if role == Role.RDMA:
            other = (topo.node_of(rank) + 1) % topo.nodes
            target = topo.rail_peer(rank, other)
        preds = draw(st.lists(st.integers(0, i - 1), max_size=3, unique=True)) if i else []
        producers = [tasks[p] for p in preds]
        if len(producers) >= 2 and draw(st.booleans()):
            # "any k of n": a partial wait, met before some of its signalers run.
            ev = b.event(rank, f"any#{i}")
            for p in producers:
                p.signals.append(ev)
            waits = [(ev, draw(st.integers(1, len(producers))))]
        else:
            waits = b.after(rank, producers)
        tasks.append(
            b.task(
                rank,
                role,
                "copy",
                [src[rank].region()],
                [dst[target].region((i, i + 1))],
                waits=waits,
                flops=draw(st.floats(0, 1e9)),
                name=f"t{i}",
            )
        )
    return b.finish()


FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(random_graphs())
def test_random_graphs_every_policy(g):
    for policy in BUILTIN:
        assert_runnable(mg.schedule(g, policy=policy))


@FAST
@given(random_graphs(), st.randoms(use_true_random=False))
def test_random_topological_queues_pass(g, rnd):
    # Any topological order cut into queues is accepted (a random Kahn order of the counters).
    order = _random_topo(g, rnd)
    ranks = _cut(g, order)
    merged = check_queues(g, ranks)
    assert sorted(merged) == list(range(len(g.tasks)))
    s = Schedule(graph=g, hardware=mg.H200, policy="custom", ranks=ranks)
    assert_runnable(s.check())


def _random_topo(g: mg.TaskGraph, rnd) -> list[int]:
    count = [0] * len(g.events)
    done: set[int] = set()
    order = []
    while len(order) < len(g.tasks):
        ready = [
            t.id for t in g.tasks if t.id not in done and all(count[e] >= c for e, c in t.waits)
        ]
        tid = rnd.choice(ready)
        done.add(tid)
        order.append(tid)
        for e in g.tasks[tid].signals:
            count[e] += 1
    return order


def _cut(g: mg.TaskGraph, order: list[int]) -> list[RankSchedule]:
    ranks = []
    for r in g.topology.ranks:
        queues = {
            role: [t for t in order if g.tasks[t].rank == r and g.tasks[t].role == role]
            for role in ("compute", "nvlink", "rdma")
        }
        ranks.append(
            RankSchedule(
                rank=r,
                workers={role: 1 if q else 0 for role, q in queues.items()},
                queues=queues,
                batches=[[t] for t in queues["rdma"]],
            )
        )
    return ranks


# -- errors ------------------------------------------------------------------------------------
def test_unknown_policy_lists_valid_ones():
    g = build("gemm_allreduce", "1x2")
    with pytest.raises(mg.UnknownNameError) as info:
        mg.schedule(g, policy="fastest")
    msg = str(info.value)
    assert "fastest" in msg and all(p in msg for p in BUILTIN)


def test_out_of_order_queue_is_rejected():
    g = build("gemm_allreduce", "2x2")
    s = mg.schedule(g)
    queue = s.ranks[0].queues["compute"]
    # A node-reduce waits (through its event) on this rank's GEMM of the same tile, which is
    # later in the same queue once the reduce is moved to the front.
    reduce = next(t for t in queue if g.tasks[t].name.startswith("node-reduce"))
    queue.remove(reduce)
    queue.insert(0, reduce)
    with pytest.raises(mg.ScheduleError) as info:
        s.check()
    msg = str(info.value)
    assert "deadlock" in msg and g.tasks[reduce].name in msg and "rank 0 compute" in msg


def test_user_policy_must_return_a_topological_order(monkeypatch):
    def backwards(graph, facts):
        return list(reversed(facts.order))

    monkeypatch.setitem(POLICIES, "backwards", backwards)
    with pytest.raises(mg.ScheduleError, match="deadlock"):
        mg.schedule(build("gemm_allreduce", "2x1"), policy="backwards")
    with pytest.raises(mg.RegistrationError):
        register_policy("topological")(backwards)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda rs: rs[0].queues["compute"].append(rs[0].queues["compute"][0]), "twice"),
        (lambda rs: rs[0].queues["compute"].pop(), "in no queue"),
        (
            lambda rs: rs[1].queues["compute"].append(rs[0].queues["compute"].pop()),
            "runs on rank 0",
        ),
        (lambda rs: rs[0].queues.pop("rdma"), "need exactly"),
        (lambda rs: rs.pop(), "do not match topology"),
        (lambda rs: rs[0].workers.update(compute=0), "no compute worker"),
        (lambda rs: rs[0].workers.update(compute=500), "SMs"),
        (lambda rs: rs[0].workers.update(tensor=1), "unknown role"),
        (lambda rs: rs[0].batches.append([rs[0].queues["rdma"][0]]), "batches"),
        (lambda rs: rs[0].batches.__setitem__(0, []), "batch"),
    ],
)
def test_broken_schedules_are_named(mutate, match):
    s = mg.schedule(build("gemm_allreduce", "2x2"))
    broken = Schedule.from_json(s.to_json())
    mutate(broken.ranks)
    with pytest.raises(mg.ScheduleError, match=match):
        broken.check()


def test_long_batches_are_split():
    g = build("gemm_allreduce", "2x1")
    hw = mg.H200.model_copy(update={"proxy_batch": 2})
    s = mg.schedule(g, hardware=hw)
    assert_runnable(s)
    assert max(len(b) for rs in s.ranks for b in rs.batches) == 2
    assert sum(len(rs.batches) for rs in s.ranks) > len(s.ranks)


# -- workers -----------------------------------------------------------------------------------
def test_static_partition_h200():
    g = build("gemm_allreduce", "2x4")
    s = mg.schedule(g)
    for rs in s.ranks:
        assert rs.workers["rdma"] == 1
        assert 1 <= rs.workers["nvlink"] <= mg.H200.nvlink_max_sms
        assert sum(rs.workers.values()) == mg.H200.sms  # nobody idles while compute has work
    one_node = mg.schedule(build("gemm_allreduce", "1x2"))
    assert all(rs.workers["rdma"] == 0 for rs in one_node.ranks)


def test_workers_override():
    g = build("gemm_allreduce", "2x2")
    s = mg.schedule(g, workers={Role.COMPUTE: 3, "nvlink": 2, "rdma": 1})
    assert all(rs.workers == {"compute": 3, "nvlink": 2, "rdma": 1} for rs in s.ranks)
    assert_runnable(s)
    with pytest.raises(mg.ScheduleError, match="rdma=0") as info:
        mg.schedule(g, workers={"compute": 3, "nvlink": 2})
    assert info.value.hint and "rdma" in info.value.hint
    with pytest.raises(mg.ScheduleError, match="132 SMs"):
        mg.schedule(g, workers={"compute": 130, "nvlink": 2, "rdma": 1})
    with pytest.raises(mg.ScheduleError, match="non-negative"):
        mg.schedule(g, workers={"compute": -1, "nvlink": 2, "rdma": 1})
    with pytest.raises(mg.UnknownNameError, match="tensor"):
        mg.schedule(g, workers={"tensor": 1})


# -- JSON, summary, cost model ------------------------------------------------------------------
@pytest.mark.parametrize("policy", BUILTIN)
def test_json_round_trip_lossless(policy, tmp_path):
    s = mg.schedule(build("gemm_allreduce", "2x4"), policy=policy)
    text = s.to_json()
    again = Schedule.from_json(text)
    assert again.to_json() == text
    assert again.ranks == s.ranks and again.hardware == s.hardware and again.policy == policy
    assert again.graph.to_text() == s.graph.to_text()
    assert again.order() == s.order()
    assert "graph" not in s.model_dump()
    path = tmp_path / "schedule.json"
    s.save(str(path))
    assert Schedule.load(str(path)).to_json() == text


def test_bad_json_is_a_schedule_error():
    s = mg.schedule(build("gemm_allreduce", "1x2"))
    doc = json.loads(s.to_json())
    with pytest.raises(mg.ScheduleError):
        Schedule.from_json("{not json")
    with pytest.raises(mg.ScheduleError, match="format"):
        Schedule.from_json(json.dumps({**doc, "format": "mgraph.schedule/0"}))
    with pytest.raises(mg.ScheduleError):
        Schedule.from_json(json.dumps({k: v for k, v in doc.items() if k != "ranks"}))
    with pytest.raises(mg.ScheduleError, match="graph"):
        Schedule.from_json(json.dumps({k: v for k, v in doc.items() if k != "graph"}))


def test_summary_rows():
    g = build("gemm_allreduce", "2x4")
    s = mg.schedule(g)
    rows = s.summary()
    assert [r["rank"] for r in rows] == list(range(8))
    assert sum(r[f"{role}_tasks"] for r in rows for role in ("compute", "nvlink", "rdma")) == len(
        g.tasks
    )
    for r, rs in zip(rows, s.ranks, strict=True):
        assert r["batches"] == len(rs.batches) and r["compute_workers"] == rs.workers["compute"]
    assert "gemm_allreduce" in repr(s)


def test_cost_model():
    g = build("gemm_allreduce", "2x2")
    costs = task_costs(g, mg.H200)
    assert costs == [task_cost(t, mg.H200, g) for t in g.tasks]
    assert all(c > 0 for c in costs)
    gemm = next(t for t in g.tasks if t.kind == "gemm")
    per_sm = mg.H200.tile_gemm_tflops * 1e12 / mg.H200.sms
    assert task_cost(gemm, mg.H200, g) >= gemm.flops / per_sm
    facts = policy_input(g, costs)
    assert sorted(facts.order) == list(range(len(g.tasks)))


@pytest.mark.parametrize("op", ["gemm_allreduce", "allgather_gemm", "ring_attention"])
def test_scheduler_and_simulator_cost_a_task_alike(op):
    """One profile: a task alone on its worker costs the scheduler what it costs the simulator
    (compute: math + epilogue wait; nvlink: remote bytes at the measured per-worker rate, scaled
    by ``nvlink_beside_compute`` on a rank with compute tasks: the scheduler always, the
    simulator's engine while the GPU has compute left, from the task model's alone demand)."""
    from mgraph.runtime.sim.model import COMPUTE, NVLINK, task_model
    from mgraph.scheduler.costmodel import compute_ranks

    g = build(op, "2x4")
    costs = task_costs(g, mg.H200)
    m = task_model(g, mg.H200)
    assert compute_ranks(g) == frozenset(g.topology.ranks)  # fused: compute on every rank
    beside = mg.H200.nvlink_beside_compute
    assert 0 < beside < 1
    checked = {COMPUTE: 0, NVLINK: 0}
    for t in g.tasks:
        role = m.role[t.id]
        if role == COMPUTE:
            assert m.duration[t.id] == pytest.approx(costs[t.id], rel=1e-12)
        elif role == NVLINK and m.remote[t.id]:
            assert m.remote[t.id] / (m.demand[t.id] * beside) == pytest.approx(
                costs[t.id], rel=1e-12
            )
        else:
            continue
        checked[role] += 1
    assert checked[COMPUTE] and checked[NVLINK]
    # pulls (reads from peers) at the pull rate, pushes (writes into peers) at the push rate
    pull, push = mg.H200.nvlink_worker_gbps * 1e9, mg.H200.nvlink_worker_push_gbps * 1e9
    reads, writes = remote_bytes(g)
    for t in g.tasks:
        if m.role[t.id] == NVLINK and m.remote[t.id]:
            r, w = reads[t.id], writes[t.id]
            assert m.demand[t.id] == pytest.approx((r + w) / (r / pull + w / push), rel=1e-12)


def test_first_pushes_rotate_over_the_node():
    """Each rank of a 1x4 node writes one tile into every peer, emitted peer 0 first: under
    critical_path and remote_first rank r pushes first to GPU r+1 (no incast), topological keeps
    the program order (every rank starts with GPU 0, or 1 for rank 0)."""
    b = GraphBuilder("hand", mg.Topology.parse("1x4"), "float32", {})
    src = [b.buffer("x", r, 64, 64) for r in range(4)]
    dst = {(r, p): b.buffer(f"y{r}", p, 64, 64) for r in range(4) for p in range(4) if p != r}
    for r in range(4):
        for p in range(4):
            if p != r:
                b.task(r, Role.NVLINK, "copy", [src[r].region()], [dst[r, p].region()])
    g = b.finish().validate()

    def first_target(s, r):
        t = g.tasks[s.ranks[r].queues["nvlink"][0]]
        return g.buffers[t.writes[0].buffer].rank

    for policy in ("critical_path", "remote_first"):
        s = mg.schedule(g, policy=policy)
        assert [first_target(s, r) for r in range(4)] == [1, 2, 3, 0]
    s = mg.schedule(g, policy="topological")
    assert [first_target(s, r) for r in range(4)] == [1, 0, 0, 0]


def test_schedule_2x8_large():
    """A 45k-task graph schedules with proxy batches within the profile's limit (its time is a
    benchmark's business, not a test's: timed CPU tests fail under load)."""
    g = mg.ops.gemm_allreduce(M=8192, N=8192, K=4096, topology="2x8", dtype=torch.bfloat16)
    assert len(g.tasks) > 40_000
    s = mg.schedule(g)
    assert sum(len(q) for rs in s.ranks for q in rs.queues.values()) == len(g.tasks)
    assert all(len(b) <= mg.H200.proxy_batch for rs in s.ranks for b in rs.batches)


# -- critical_path on the workers (placement.py) -----------------------------------------------
def causal_stages(rows: int = 16, heads: int = 4, wide: int = 16) -> mg.TaskGraph:
    """Attention-like chains of uneven length (row r: ``heads`` chains of r+1 blocks, as a
    causal attention's query blocks), then per row a wide stage of ``wide`` tiles (a
    projection) waiting for the row's chains, then one task per row waiting for its tiles."""
    b = GraphBuilder("causal_stages", mg.Topology.parse("1x1"), "float32", {})
    src = b.buffer("src", 0, 1, 4)
    dst = b.buffer("dst", 0, rows * (heads * rows + wide + 1), 4)
    made = 0

    def task(name, producers):
        nonlocal made
        made += 1
        return b.task(0, Role.COMPUTE, "copy", [src.region((0, 1))],
                      [dst.region((made - 1, made))], waits=b.after(0, producers),
                      flops=1e9, name=name)  # fmt: skip

    for r in range(rows):
        ends = []
        for h in range(heads):
            prev = []
            for j in range(r + 1):
                prev = [task(f"attn{r}.{h}.{j}", prev)]
            ends += prev
        tiles = [task(f"proj{r}.{j}", ends) for j in range(wide)]
        task(f"norm{r}", tiles)
    return b.finish().validate()


def queue_makespan(s: Schedule) -> float:
    """The queue model's makespan of a one-rank, compute-only schedule (its compute queue is
    the global order it was cut from)."""
    from mgraph.scheduler.placement import Pools, queue_times

    g = s.graph
    pools = Pools(g, [rs.workers for rs in s.ranks])
    return max(queue_times(g, pools, s.queue(0, "compute"), task_costs(g, mg.H200))[2])


def test_critical_path_starts_a_stage_on_the_rows_that_are_done():
    """Path lengths with a worker per task rank every projection tile below the chains still
    running (each chain block's path is longer), so the projection waits for the last chain;
    placed on 32 workers, the tiles of the rows whose chains are done fill the workers while
    the long chains finish: the queue model and runtime/sim both predict it ~10% shorter
    (4.67 -> 4.19 ms)."""
    from mgraph.runtime.sim import simulate

    g = causal_stages()
    workers = {"compute": 32}
    plain = mg.schedule(g, policy="longest_path", workers=workers)
    placed = mg.schedule(g, workers=workers)
    assert placed.policy == "critical_path"
    q_plain, q_placed = queue_makespan(plain), queue_makespan(placed)
    assert q_placed < 0.93 * q_plain, (q_placed, q_plain)
    s_plain = simulate(plain, baselines=False).predicted_s
    s_placed = simulate(placed, baselines=False).predicted_s
    assert s_placed < 0.93 * s_plain, (s_placed, s_plain)
    # longest_path queues every chain block before the first projection tile; placed, the
    # tiles of rows whose chains are done come long before the last chain block
    for s, interleaved in ((plain, False), (placed, True)):
        names = [g.tasks[t].name for t in s.queue(0, "compute")]
        first_tile = min(i for i, n in enumerate(names) if n.startswith("proj"))
        last_block = max(i for i, n in enumerate(names) if n.startswith("attn"))
        assert (first_tile < last_block - 100) == interleaved, (s.policy, first_tile, last_block)


def test_critical_path_without_a_partition_is_longest_path():
    """A caller that passes no workers (policy_input's default) gets longest_path's order."""
    from mgraph.scheduler import policies

    g = causal_stages(rows=6)
    facts = policy_input(g, task_costs(g, mg.H200))
    assert facts.workers is None
    assert policies.critical_path(g, facts) == policies.longest_path(g, facts)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_placed_lengths_with_a_worker_per_task_are_path_lengths(data):
    """The backward list schedule with unlimited workers is the longest path to the end (partial
    waits included, by the same rule), so critical_path generalises the plain priority."""
    from mgraph.scheduler.placement import Pools, constrained_lengths
    from mgraph.scheduler.policies import critical_path_lengths

    g = data.draw(random_graphs())
    costs = task_costs(g, mg.H200)
    many = [{r.value: len(g.tasks) for r in Role} for _ in range(g.topology.world_size)]
    facts = policy_input(g, costs, None, many)
    placed = constrained_lengths(g, Pools(g, many), costs, facts.order, facts.pos, facts.full,
                                 facts.partial, list(range(len(g.tasks))))  # fmt: skip
    assert placed == critical_path_lengths(facts)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_critical_path_on_few_workers_is_runnable_and_never_predicted_slower(data):
    """On one or two workers per role (where placing matters most) critical_path's queues are
    runnable (checked by running them), and the queue model never predicts them slower than
    longest_path's: the placed order is kept only when it is shorter."""
    from mgraph.scheduler.placement import Pools, queue_times
    from mgraph.scheduler.policies import critical_path, longest_path

    g = data.draw(random_graphs())
    n = data.draw(st.integers(1, 2))
    workers = {"compute": n, "nvlink": n, "rdma": 1}
    s = mg.schedule(g, workers=workers)
    assert_runnable(s)
    costs = task_costs(g, mg.H200)
    per_rank = [dict(workers) for _ in range(g.topology.world_size)]
    facts = policy_input(g, costs, None, per_rank)
    pools = Pools(g, per_rank)
    chosen = max(queue_times(g, pools, critical_path(g, facts), costs)[2], default=0.0)
    plain = max(queue_times(g, pools, longest_path(g, facts), costs)[2], default=0.0)
    assert chosen <= plain


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_queue_makespan_is_the_queue_models_last_end(data):
    """placement.queue_makespan (what critical_path compares) is queue_times' latest end."""
    from mgraph.scheduler.placement import Pools, queue_makespan, queue_times
    from mgraph.validate import topo_order

    g = data.draw(random_graphs())
    n = data.draw(st.integers(1, 3))
    workers = [{"compute": n, "nvlink": n, "rdma": 1}] * g.topology.world_size
    order = topo_order(g)
    costs = task_costs(g, mg.H200)
    pools = Pools(g, workers)
    assert queue_makespan(g, pools, order, costs) == max(queue_times(g, pools, order, costs)[2])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_queue_makespan_with_a_limit_stops_only_where_the_order_cannot_beat_it(data):
    """queue_makespan's ``limit`` and ``tail`` (critical_path's network choice stops the
    staged order's model with them): below the limit it is the makespan itself, above it
    some value above the limit; the list simulation given as an iterator gives the same."""
    from mgraph.scheduler.placement import Pools, queue_makespan
    from mgraph.scheduler.policies import (
        Columns,
        critical_path_lengths,
        list_order,
        list_order_steps,
    )

    g = data.draw(random_graphs())
    n = data.draw(st.integers(1, 3))
    workers = [{"compute": n, "nvlink": n, "rdma": 1}] * g.topology.world_size
    costs = task_costs(g, mg.H200)
    facts = policy_input(g, costs, None, workers)
    length = critical_path_lengths(facts, partial_waits=False)
    tail = [x - c for x, c in zip(length, costs, strict=True)]
    priority = Columns([data.draw(st.integers(0, 3)) for _ in g.tasks])
    order = list_order(g, priority, facts)
    pools = Pools(g, workers)
    full = queue_makespan(g, pools, order, costs, mg.H200)
    limit = full * data.draw(st.sampled_from([0.0, 0.5, 0.99, 1.0, 1.01, 2.0]))
    taken: list[int] = []
    steps = list_order_steps(g, priority, facts, taken)
    got = queue_makespan(g, pools, steps, costs, mg.H200, limit=limit, tail=tail)
    if full < limit:
        assert got == full and taken == order
    else:
        assert got > limit or got == full == limit
        assert taken == order[: len(taken)]
