"""The megakernel's network plan and tables (runtime/megakernel/netplan.py, encode.py): pure CPU."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import mgraph as mg
from mgraph.graph import Region
from mgraph.ops.abi import F_CMD0, F_GID, F_KIND, F_NCMD, F_NSIG
from mgraph.runtime.megakernel import encode_rank, layout
from mgraph.runtime.megakernel.encode import PUSH_ID
from mgraph.runtime.megakernel.netplan import net_plan
from mgraph.runtime.proxy.command import Opcode, Word

CASES = [
    ("gemm_allreduce", "2x1", dict(M=128, N=64, K=128, tile=[32, 32])),
    ("gemm_allreduce", "3x1", dict(M=96, N=64, K=192, tile=[32, 32])),
    ("gemm_allreduce", "3x2", dict(M=192, N=64, K=384, tile=[32, 32])),
    ("allgather_gemm", "2x2", dict(M=128, N=64, K=64, tile=[16, 16])),
    ("gemm_reduce_scatter", "2x1", dict(M=64, N=64, K=128, tile=[16, 32])),
]


def _graph(op, topo, kw):
    return mg.ops.get_op(op)(topology=topo, **kw)


def _raises(plan, graph):
    """(rank, word) -> raises per launch, and -> the set of proxies (source ranks) raising it,
    from the commands themselves."""
    count: Counter = Counter()
    writers: dict = {}
    cmds = [c for cs in plan.commands.values() for c in cs]
    cmds += [c for r in graph.topology.ranks for c in plan.start_commands(r)]
    for c in cmds:
        hits = [(c.dst_rank, c.event)]
        if c.opcode is Opcode.WRITE:
            hits.append((c.src_rank, c.done_event))
        for rank, word in hits:
            if word >= 0:
                count[rank, word] += 1
                writers.setdefault((rank, word), set()).add(c.src_rank)
    return count, writers


@pytest.mark.parametrize("op,topo,kw", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_every_net_word_has_one_proxy_and_its_per_launch_count(op, topo, kw):
    graph = _graph(op, topo, kw)
    plan = net_plan(graph)
    count, writers = _raises(plan, graph)
    for r in graph.topology.ranks:
        assert sorted(plan.words[r].values()) == list(range(len(plan.words[r])))
        for key, w in plan.words[r].items():
            assert count[r, w] == plan.per_launch[r][w] > 0, (r, key)
            assert len(writers[r, w]) == 1, (r, key, writers[r, w])  # one writing proxy
    assert set(count) == {(r, w) for r in graph.topology.ranks for w in plan.words[r].values()}


@pytest.mark.parametrize("op,topo,kw", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_event_words_count_every_rdma_signal(op, topo, kw):
    graph = _graph(op, topo, kw)
    plan = net_plan(graph)
    by_rdma: Counter = Counter()
    for t in graph.tasks:
        if t.role == "rdma":
            by_rdma.update(t.signals)
    for e, n in by_rdma.items():
        rank = graph.events[e].rank
        ws = plan.event_words[e]
        keys = {key: w for key, w in plan.words[rank].items() if w in ws}
        # one "task" word per rdma task that signals it, each raised once per launch
        signallers = {t.id for t in graph.tasks if t.role == "rdma" and e in t.signals}
        assert {k[1] for k in keys if k[0] == "task"} == signallers
        assert sum(plan.per_launch[rank][w] for w in ws) == n


def test_a_chunk_feeding_several_tiles_raises_one_flag():
    graph = _graph("gemm_allreduce", "2x1", dict(M=128, N=256, K=128, tile=[32, 32],
                                                   chunk_bytes=32 * 256 * 4))
    plan = net_plan(graph)
    multi = [t for t in graph.tasks if t.role == "rdma" and len(t.signals) > 1]
    assert multi  # the chunk spans several consumer tiles
    for t in multi:
        (write,) = plan.commands[t.id]  # no SIGNAL per consumer tile
        dst = graph.buffers[t.writes[0].buffer].rank
        assert write.event == plan.words[dst][("task", t.id)]
        for e in t.signals:
            assert write.event in plan.event_words[e]


def test_writes_move_the_task_regions():
    graph = _graph(*CASES[0])
    plan = net_plan(graph)
    for tid, cmds in plan.commands.items():
        t = graph.tasks[tid]
        write = cmds[0]
        assert write.opcode is Opcode.WRITE and write.task == tid
        src_buf = next(b for b, i in plan.buffer_index.items()
                       if i == write.src.buffer and graph.buffers[b].rank == t.rank)
        assert Region(src_buf, *write.src[1:]) == t.reads[0]
        assert write.bytes == graph.region_bytes(t.reads[0])


def test_two_nodes_exchange_starts_with_each_other():
    graph = _graph(*CASES[0])
    plan = net_plan(graph)
    assert plan.peers == [[1], [0]]
    (start,) = plan.start_commands(0)
    assert start.opcode is Opcode.SIGNAL and start.dst_rank == 1
    assert start.event == plan.words[1][("start", 0)]


def test_rdma_tasks_encode_as_pushes():
    graph = _graph(*CASES[0])
    sched = mg.schedule(graph)
    lay = layout(graph)
    for rank in graph.topology.ranks:
        t = encode_rank(sched, rank, net=lay.net)
        starts = lay.net.start_commands(rank)
        assert t.start_cmds == len(starts)
        assert [int(x) for x in t.cmds[: t.start_cmds, Word.EVENT]] == [c.event for c in starts]
        pushes = 0
        for local, tid in enumerate(t.local_tasks):
            row = t.tasks[local]
            if graph.tasks[tid].role != "rdma":
                assert int(row[F_KIND]) != PUSH_ID
                continue
            pushes += 1
            assert int(row[F_KIND]) == PUSH_ID and int(row[F_NSIG]) == 0  # the proxy raises
            c0, n = int(row[F_CMD0]), int(row[F_NCMD])
            assert n == len(lay.net.commands[tid]) and int(row[F_GID]) == tid
            for i, cmd in enumerate(lay.net.commands[tid]):
                words = t.cmds[c0 + i].tolist()
                assert words[0] == int(cmd.opcode)  # the kernel writes the header
                assert words[Word.TASK] == tid and words[Word.DST_RANK] == cmd.dst_rank
        assert pushes == sum(1 for x in graph.tasks if x.rank == rank and x.role == "rdma")
        # the sent and arrive words are waited for at exit, with their counts
        assert {(r, w) for r, w, _ in t.exits} == {
            (rank, w) for k, w in lay.net.words[rank].items() if k[0] in ("sent", "arrive")
        }
        assert all(n == lay.net.per_launch[rank][w] for _, w, n in t.exits)


def test_waits_on_proxy_raised_events_sum_net_words():
    graph = _graph(*CASES[0])
    lay = layout(graph)
    t = encode_rank(mg.schedule(graph), 0, net=lay.net)
    remote = {e for x in graph.tasks if x.role == "rdma" for e in x.signals
              if graph.events[e].rank == 0}
    assert remote
    for slot, e in enumerate(t.event_slots):
        rank, ws = t.event_net[slot]
        assert rank == graph.events[e].rank
        assert bool(ws) == (e in remote)
        if ws:
            assert ws == lay.net.event_words[e]


def test_flag_array_holds_events_start_flag_and_net_words():
    graph = _graph(*CASES[1])
    lay = layout(graph)
    assert lay.net_base == lay.flag_count + 1
    assert lay.flag_words == lay.net_base + lay.net.count
    single = layout(_graph("gemm_allreduce", "1x2", dict(M=64, N=64, K=128, tile=[32, 32])))
    assert single.net is None and single.flag_words == single.flag_count + 1


def test_an_rdma_task_signalling_a_third_rank_is_refused():
    graph = _graph("gemm_allreduce", "3x1", dict(M=96, N=64, K=192, tile=[32, 32]))
    rdma = next(t for t in graph.tasks if t.role == "rdma")
    dst = graph.buffers[rdma.writes[0].buffer].rank
    third = next(r for r in graph.topology.ranks if r not in (rdma.rank, dst))
    rdma.signals.append(next(e.id for e in graph.events if e.rank == third))
    with pytest.raises(mg.ScheduleError, match="third rank"):
        net_plan(graph)


def test_an_rdma_task_must_move_one_region():
    graph = _graph(*CASES[0])
    rdma = next(t for t in graph.tasks if t.role == "rdma")
    rdma.reads.append(rdma.reads[0])
    with pytest.raises(mg.ScheduleError, match="one region"):
        net_plan(graph)


def test_command_rows_are_int64():
    graph = _graph(*CASES[0])
    t = encode_rank(mg.schedule(graph), None, single_program=True)
    assert t.cmds.dtype == torch.int64 and t.cmds.shape[1] == 16 and t.start_cmds == 0
    assert t.starts == []


def test_gpu_flag_mode_is_a_checked_setting(monkeypatch):
    from mgraph.settings import Settings

    assert Settings().gpu_flags == "copy"
    monkeypatch.setenv("MGRAPH_GPU_FLAGS", "memop")
    assert Settings.from_env().gpu_flags == "memop"
    with pytest.raises(ValueError, match="gpu_flags"):
        Settings(gpu_flags="bogus")


def test_native_proxy_carries_the_flag_mode():
    from mgraph.runtime.proxy import CommandFifo, InProcessTransport
    from mgraph.runtime.proxy.native import NativeProxy, available

    if not available():
        pytest.skip("native proxy extension not built")
    transport = InProcessTransport(lambda *a: None)
    for copy in (False, True):
        proxy = NativeProxy(CommandFifo(8), transport, rank=0, flag_copy=copy)
        assert proxy._drain.flag_copy is copy
        proxy.stop()


@pytest.mark.parametrize("op,topo,kw", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_every_net_word_is_raised_from_one_lane(op, topo, kw):
    """A proxy runs lane L on stream L mod streams: a word raised from two lanes could have two
    writing streams and its running count could go backwards, whatever the stream count."""
    graph = _graph(op, topo, kw)
    plan = net_plan(graph, block=1)  # every task its own lane (mod LANES): the hardest case
    lanes: dict = {}
    for r in graph.topology.ranks:
        for c in plan.start_commands(r):
            assert c.lane == 0
            lanes.setdefault((c.dst_rank, c.event), set()).add(c.lane)
    for tid, cmds in plan.commands.items():
        for c in cmds:
            assert c.lane == plan.lanes[tid]
            lanes.setdefault((c.dst_rank, c.event), set()).add(c.lane)
            if c.done_event >= 0:
                lanes.setdefault((c.src_rank, c.done_event), set()).add(c.lane)
    assert lanes and all(len(v) == 1 for v in lanes.values()), lanes
    per_rank = Counter(t.rank for t in graph.tasks if t.role == "rdma")
    if max(per_rank.values()) > 1:  # the check above had several lanes to compare
        assert len(set(plan.lanes.values())) > 1


def test_lanes_go_in_blocks_per_rank():
    from mgraph.runtime.megakernel.netplan import LANE_BLOCK, LANES, lane_of

    graph = mg.ops.gemm_allreduce(M=128, N=128, K=128, tile=[32, 32], chunk_bytes=1024,
                                  topology="2x1")
    lanes = lane_of(graph)
    for r in graph.topology.ranks:
        mine = sorted(t.id for t in graph.tasks if t.role == "rdma" and t.rank == r)
        assert [lanes[t] for t in mine] == [(i // LANE_BLOCK) % LANES for i in range(len(mine))]
    plan = net_plan(graph)
    # per-lane words: one "sent" per lane used on a rank, summed by the exit
    for r in graph.topology.ranks:
        used = {lanes[t.id] for t in graph.tasks if t.role == "rdma" and t.rank == r}
        assert {k[1] for k in plan.words[r] if k[0] == "sent"} == used
