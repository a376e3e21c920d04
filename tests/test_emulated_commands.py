"""The exact command stream of one rank of the emulated 2x1 GEMM+AllReduce through the native
proxy's cuda path on a CPU (tests/fake_cuda): the case that hung on one shared H200 (uncapped,
4096x4096x2048: rank 0 waited for rank 1's chunk 'value 1, target 2').

Rank 1's proxy as net.py builds it (one copy stream, copy-engine flags, batches of 8, coalescing
on, no pacing) gets what rank 1's kernel pushes in one launch: the start SIGNAL, then the 32
WRITEs of its rdma queue (16 rail-sends into rank 0's from_node1, 16 rail-gathers into rank 0's
output, lanes 0-3 of netplan.py, neighbours coalescing across lanes), at the graph's scaled-down
shape with the same tile counts and chunks (one tile row each). Three launches on one proxy
(running counts over epochs), pushed all before the loop starts (full batches, the largest
coalesced copies), one at a time while it runs, or one at a time onto a stream that executes
each operation 300 us late (batches form while the loop waits on nothing). Every net word the proxy raises must reach
epoch x its raises per launch and every chunk must land."""

from __future__ import annotations

import shutil

import pytest
import torch
from fake_cuda import FakeCuda

import mgraph as mg
from mgraph.runtime.proxy import CommandFifo
from mgraph.runtime.proxy.command import encode
from mgraph.runtime.proxy.native import NativeProxy, add_tensor, available, load

if shutil.which("gcc") is None:
    pytest.skip("needs gcc to build the fake CUDA libraries", allow_module_level=True)
if not available():
    pytest.skip("the native proxy extension is not built", allow_module_level=True)

native = load()
SRC = 1  # the rank whose proxy runs here


class _Transport:
    """What CudaIpcTransport.attach_native registers in rank 1's process: both ranks' buffers
    and net words as CUDA memory of the one device (ranks sharing a GPU), with host shadows."""

    name = "fake_cuda_ipc"

    def __init__(self, fake: FakeCuda, graph, plan) -> None:
        gen = torch.Generator().manual_seed(0)
        self.libs = ([str(fake.runtime)], [str(fake.driver)])
        self.buffers = {
            (b.rank, plan.buffer_index[b.id]): torch.randn(b.rows, b.cols, generator=gen)
            for b in graph.buffers.values()
        }
        self.flags = {r: torch.zeros(plan.count, dtype=torch.int32) for r in (0, 1)}
        self.shadow = {r: torch.zeros(plan.count, dtype=torch.int64) for r in (0, 1)}

    def attach_native(self, drain: object, rank: int, counters: dict) -> None:
        assert not drain.use_cuda(0, *self.libs)
        drain.local_memory = True
        for (r, index), t in self.buffers.items():
            add_tensor(drain, r, native.PLACE_CUDA, index, t, 0)
        for r in (0, 1):
            drain.set_cuda_flags(r, self.flags[r].data_ptr(), self.flags[r].numel(),
                                 self.shadow[r].data_ptr())  # fmt: skip

    def account(self, *_: object, **__: object) -> None:
        pass


def _launch_bodies(graph, plan, sched, epoch: int) -> list[list[int]]:
    cmds = list(plan.start_commands(SRC))
    for tid in sched.ranks[SRC].queues["rdma"]:
        cmds += plan.commands[tid]
    return [encode(c, epoch) for c in cmds]


@pytest.mark.parametrize("flag_copy", [True, False], ids=["copy-flags", "memop-flags"])
@pytest.mark.parametrize("pushed", ["queued", "one-by-one", "lagging-stream"])
def test_one_ranks_launches_raise_every_word(fake: FakeCuda, flag_copy: bool, pushed: str):
    from mgraph.runtime.megakernel.net_report import short_words, writer_of
    from mgraph.runtime.megakernel.netplan import net_plan

    graph = mg.ops.gemm_allreduce(M=256, N=256, K=64, topology="2x1", tile=[8, 16],
                                  chunk_bytes=8 * 256 * 4)  # fmt: skip
    sched = mg.schedule(graph)
    plan = net_plan(graph)
    assert sorted(set(plan.lanes.values())) == [0, 1, 2, 3]  # the 4096 case's lanes
    transport = _Transport(fake, graph, plan)
    fifo = CommandFifo(64)  # net.py: max(fifo_slots 64, 33 commands a launch)
    proxy = NativeProxy(fifo, transport, 8, rank=SRC, name="rank1", timeout=60.0,
                        idle_sleep_us=0, flag_copy=flag_copy)  # fmt: skip
    ptrs = (fifo.ring.data_ptr(), fifo.head.data_ptr(), fifo.tail.data_ptr(), fifo.capacity)
    launches = 3
    if pushed == "lagging-stream":  # each stream operation executes 300 us after its call
        fake.set_delay_us(300)
    if pushed == "queued":  # launch 1 queued before the loop starts: batches of 8
        bodies = _launch_bodies(graph, plan, sched, 1)
        assert native.produce(*ptrs, bodies, len(bodies)) == len(bodies)
        proxy.start()
        first = 2
    else:
        proxy.start()
        first = 1
    for epoch in range(first, launches + 1):
        for body in _launch_bodies(graph, plan, sched, epoch):
            assert native.produce(*ptrs, [body], 1) == 1
    proxy.stop()
    short = []
    for rank in (0, 1):
        values = transport.flags[rank].tolist()
        lines = short_words(graph, plan, rank, launches, values, here={SRC})
        short += [x for x in lines if f"raised by rank {SRC}'s proxy" in x]
        for key, w in plan.words[rank].items():  # and none past its count
            if writer_of(graph, rank, key) == SRC:
                assert values[w] == launches * plan.per_launch[rank][w], (rank, key)
    assert short == [], "\n".join(short)
    for t in graph.tasks:  # every chunk rank 1 sends landed
        if t.role == "rdma" and t.rank == SRC:
            src, dst = t.reads[0], t.writes[0]
            a = transport.buffers[(SRC, plan.buffer_index[src.buffer])][src.row0:src.row1,
                                                                         src.col0:src.col1]
            b = transport.buffers[(0, plan.buffer_index[dst.buffer])][dst.row0:dst.row1,
                                                                       dst.col0:dst.col1]
            assert torch.equal(a, b), t.name
    stats = proxy.loop_stats()
    assert stats["commands"] == 33 * launches
    if pushed == "queued":
        assert stats["coalesced"] > 0  # neighbouring chunks went out as one copy
