"""The native proxy with several copy streams (Settings.proxy_streams; mover.h "Several streams")
on a CPU, against the fake CUDA libraries of tests/fake_cuda (streams executed by their own
worker threads, concurrently, over host memory).

Commands carry lanes (command word LANE); the proxy runs lane L on stream L mod 4. Checked, with
and without cudaMemcpyBatchAsync (the fake offers it, or reports a runtime too old for it), in
both flag modes: every tile lands; every flag word ends at exactly its raises, and exactly
``launch * raises`` after each of several launches through one proxy; a concurrent watcher and
the fake's trace never see a flag ahead of the data it vouches for, nor a word going backwards,
nor a word written from two streams; copies really spread over the streams; flags of a batch go
out together (fewer flag copies than raised words). A command raising a word from a second
stream, and a failing copy or flag, are ProxyErrors naming the command.
"""

from __future__ import annotations

import time
from collections import defaultdict

import fake_cuda
import pytest
import torch
from fake_cuda import FakeCuda
from test_native_cuda_path import (
    N_FLAGS,
    FakeCudaTransport,
    Plan,
    Watcher,
    block_tiles,
    check_final,
    check_trace,
    native,
    queue_calls,
    row_tiles,
    write,
)

from mgraph.errors import ProxyError
from mgraph.runtime.proxy import Command, CommandFifo, Rect
from mgraph.runtime.proxy.command import encode
from mgraph.runtime.proxy.native import NativeProxy

STREAMS = 4
LANES = 8  # lanes 0..7 onto 4 streams: lanes L and L + 4 share a stream


class StreamRig:
    """A NativeProxy (rank 0, ``streams`` copy streams) over a FakeCudaTransport."""

    def __init__(self, fake: FakeCuda, *, flag_copy: bool, streams: int = STREAMS,
                 coalesce: bool = True, capacity: int = 1024, fuse_flags: bool = True) -> None:
        self.transport = FakeCudaTransport(fake)
        self.fifo = CommandFifo(capacity)
        self.proxy = NativeProxy(
            self.fifo, self.transport, 8, rank=0, name="fake", coalesce=coalesce,
            flag_copy=flag_copy, timeout=10.0, streams=streams, fuse_flags=fuse_flags,
        )

    def push(self, plan: Plan, epoch: int = 1) -> None:
        ptrs = (self.fifo.ring.data_ptr(), self.fifo.head.data_ptr(), self.fifo.tail.data_ptr())
        bodies = [[*b[:2], epoch, *b[3:]] for b in plan.bodies]
        assert native.produce(*ptrs, self.fifo.capacity, bodies, plan.count) == plan.count

    def run(self, plan: Plan) -> None:
        self.push(plan)
        self.proxy.start()
        self.proxy.stop()


def lane_plan() -> Plan:
    """Every tile of the destination (64 rows, then 32 strided blocks), tile i on lane
    L = (i // 4) % 8: four neighbours share a lane (they may coalesce), consecutive blocks of
    four go to different streams (lanes L and L + 4 share stream L % 4). Words keep one stream,
    as netplan.py makes them: rank 0's word L counts lane L's completions ("sent"); rank 1's
    words 3s..3s+2 count arrivals of stream s (tile i raises 3s + i % 3: neighbouring words,
    raised together in one copy per batch, like netplan's per-task words); after every 5th
    tile a SIGNAL of its lane raises rank 1's word 12 + s, vouching for every tile of stream s
    so far (a SIGNAL is ordered after its own stream's copies only)."""
    plan = Plan([], 0)
    seen: dict[int, list[int]] = defaultdict(list)
    for i, tile in enumerate(row_tiles(64) + block_tiles(32)):
        lane = (i // 4) % LANES
        stream = lane % STREAMS
        arrive = 3 * stream + i % 3
        plan.tiles.append(tile)
        seen[stream].append(i)
        plan.add(write(tile, event=arrive, done_event=lane, task=i, lane=lane),
                 {(1, arrive): [i], (0, lane): [i]})
        if i % 5 == 4:
            plan.add(Command.signal(0, 1, 12 + stream, task=i, lane=lane),
                     {(1, 12 + stream): list(seen[stream])})
    return plan


def streams_of_words(rows: torch.Tensor, transport: FakeCudaTransport) -> dict:
    """(rank, word) -> the set of streams that wrote it, from the trace."""
    out: dict = defaultdict(set)
    for _seq, kind, dst, _w, _h, _p, _v, stream in rows.tolist():
        if kind not in (fake_cuda.COPY, fake_cuda.STORE_32):
            continue
        for r, f in transport.flags.items():
            if f.data_ptr() <= dst < f.data_ptr() + 4 * N_FLAGS:
                out[r, (dst - f.data_ptr()) // 4].add(stream)
    return out


def data_streams(rows: torch.Tensor, transport: FakeCudaTransport) -> set[int]:
    lo = transport.dst.data_ptr()
    hi = lo + transport.dst.numel() * 4
    return {
        int(r[7]) for r in rows.tolist()
        if r[1] in (fake_cuda.COPY, fake_cuda.COPY_2D) and lo <= r[2] < hi
    }


@pytest.mark.parametrize(
    "version", [12080, 13000, 12040], ids=["batch-api-12.8", "batch-api-13.0", "fallback"]
)
@pytest.mark.parametrize("delay_us", [0, 300], ids=["no-delay", "delay"])
@pytest.mark.parametrize("flag_copy", [True, False], ids=["copy-flags", "store-flags"])
def test_data_lands_before_its_flags_on_every_stream(
    fake: FakeCuda, flag_copy: bool, delay_us: int, version: int
) -> None:
    # 12.8 and 13.0 differ in cudaMemcpyBatchAsync's signature (13.0 dropped failIdx): the fake
    # reads its arguments as the reported version's, so the wrong one fails the run.
    fake.set_runtime_version(version)
    batch = version >= 12080
    fake.set_delay_us(delay_us)
    fake.start_trace(100_000)
    plan = lane_plan()
    rig = StreamRig(fake, flag_copy=flag_copy)
    assert rig.proxy.batch_api is batch
    with Watcher(plan, rig.transport) as watcher:
        rig.run(plan)
    assert torch.equal(rig.transport.dst, rig.transport.src)
    check_final(rig, plan)
    assert watcher.errors == []
    rows = fake.trace()
    assert check_trace(rows, plan, rig.transport) == []
    # One writer per word; every stream carried data.
    writers = streams_of_words(rows, rig.transport)
    assert writers and all(len(s) == 1 for s in writers.values()), dict(writers)
    assert len(data_streams(rows, rig.transport)) == STREAMS
    assert fake.stat("streams_created") == STREAMS and fake.stat("null_stream_ops") == 0
    s = rig.proxy.loop_stats()
    n_signals = sum(1 for i in range(96) if i % 5 == 4)
    assert s["streams"] == STREAMS
    assert (s["writes"] + s["coalesced"], s["signals"]) == (96, n_signals)
    assert s["events"] == 96 * 2 + n_signals and s["raises"] < s["events"]
    # Flags of a batch raised together: neighbouring words of a stream share one copy.
    if flag_copy:
        assert s["flag_copies"] < s["raises"]
        assert fake.stat("enq_store") == 0
    else:  # a stream's words of a batch in one cuStreamBatchMemOp
        stores = fake.stat("enq_store") + fake.stat("batch_stores")
        assert s["flag_copies"] == s["raises"] == stores
        assert fake.stat("enq_store") + fake.stat("enq_store_batch") < s["raises"]
    assert s["cuda_calls"] == queue_calls(fake)
    assert fake.stat("batch13") == (s["batch_calls"] if version >= 13000 else 0)
    if batch:
        assert s["batch_calls"] > 0 and fake.stat("enq_batch") == s["batch_calls"]
    else:
        assert s["batch_calls"] == 0 and fake.stat("enq_batch") == 0
    queued = fake.stat("enq_copy") + fake.stat("enq_copy2d") + fake.stat("batch_copies")
    assert queued == s["data_copies"] + (s["flag_copies"] if flag_copy else 0)
    if delay_us:  # the streams really ran behind the loop, and the watcher saw it mid-way
        assert fake.stat("max_lag") > 2 and watcher.partial > 0


def test_one_stream_keeps_the_single_stream_path(fake: FakeCuda) -> None:
    """streams=1 (the default) with fuse_flags off: lanes are carried but every command runs on
    one stream, and the flags go out one copy per word as before (no batch API, no multi-word
    copy). Fused flags on one stream: tests/test_native_cuda_path.py."""
    fake.start_trace(100_000)
    plan = lane_plan()
    rig = StreamRig(fake, flag_copy=True, streams=1, fuse_flags=False)
    assert not rig.proxy.batch_api
    rig.run(plan)
    check_final(rig, plan)
    rows = fake.trace()
    assert check_trace(rows, plan, rig.transport) == []
    assert len(data_streams(rows, rig.transport)) == 1 and fake.stat("streams_created") == 1
    s = rig.proxy.loop_stats()
    assert fake.stat("enq_batch") == 0 and s["batch_calls"] == 0
    data = int(((rows[:, 1] == fake_cuda.COPY) & (rows[:, 3] > 4)).sum())
    assert fake.stat("enq_copy") == s["raises"] + data  # one 4-byte copy per raise


def wait_for(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(1e-3)


@pytest.mark.parametrize("flag_copy", [True, False], ids=["copy-flags", "store-flags"])
def test_counts_are_exact_per_launch_across_relaunches(fake: FakeCuda, flag_copy: bool) -> None:
    """One proxy, four launches (epochs 1..4) of the plan: after launch k every word holds
    exactly k times its raises (running counts never reset), and never more on the way."""
    fake.set_delay_us(20)
    plan = lane_plan()
    rig = StreamRig(fake, flag_copy=flag_copy)
    rig.proxy.start()
    try:
        for launch in range(1, 5):
            rig.transport.dst.zero_()
            rig.push(plan, epoch=launch)
            want = {k: launch * n for k, n in plan.raises.items()}

            def reached(want: dict = want) -> bool:
                return all(
                    rig.transport.flags[r][w].item() >= n for (r, w), n in want.items()
                )

            wait_for(reached, f"launch {launch}'s flags")
            for (r, w), n in want.items():
                assert rig.transport.flags[r][w].item() == n, (launch, r, w)
            assert torch.equal(rig.transport.dst, rig.transport.src)  # landed before flags
    finally:
        rig.proxy.stop()
    assert rig.proxy.stats.commands == 4 * plan.count


def test_a_word_raised_from_two_streams_is_refused_by_name(fake: FakeCuda) -> None:
    """Lanes 0 and 4 share stream 0 (4 streams): fine. Lane 1 is stream 1: a running count
    written from two streams could go backwards, so the command is refused and named."""
    tiles = row_tiles(4)
    plan = Plan([], 0, list(tiles))
    for i, (tile, lane) in enumerate(zip(tiles, [0, 4, 0, 1], strict=True)):
        plan.add(write(tile, event=3, task=200 + i, lane=lane), {(1, 3): [i]})
    rig = StreamRig(fake, flag_copy=True, coalesce=False)
    with pytest.raises(ProxyError, match=r"command #3 \(WRITE .* task 203 lane 1\)") as info:
        rig.run(plan)
    assert "flag word 3 of rank 1 is raised from copy stream 0 and now from stream 1" in str(
        info.value
    )
    assert rig.fifo.tail_value == 3  # the three before it executed
    assert rig.transport.flags[1][3].item() == 3
    assert all(rig.transport.landed(t) for t in tiles[:3]) and not rig.transport.landed(tiles[3])


@pytest.mark.parametrize("batch", [True, False], ids=["batch-api", "fallback"])
def test_a_failing_data_copy_names_its_command_and_raises_no_flag(
    fake: FakeCuda, batch: bool
) -> None:
    if not batch:
        fake.set_runtime_version(12040)
    tiles = row_tiles(10)
    plan = Plan([], 0, list(tiles))
    for i, tile in enumerate(tiles):
        plan.add(write(tile, event=i, task=100 + i), {(1, i): [i]})
    rig = StreamRig(fake, flag_copy=True, coalesce=False)
    fake.poison(rig.transport.address(tiles[5], 0, 3), 4, fake_cuda.INVALID_VALUE,
                at_execution=False)
    call = "cudaMemcpyBatchAsync" if batch else "cudaMemcpyAsync"
    with pytest.raises(ProxyError, match=rf"{call} failed: invalid argument \(1\)") as info:
        rig.run(plan)
    assert "command #5 (WRITE" in str(info.value) and "task 105" in str(info.value)
    # The batch's copies went out together: none of it is released, and no flag of it raised.
    assert rig.fifo.tail_value == 0
    assert not rig.transport.flags[1].any()
    assert not rig.transport.landed(tiles[5]) and not any(
        rig.transport.landed(t) for t in tiles[8:]
    )


def test_a_failing_flag_copy_names_a_command_and_its_words(fake: FakeCuda) -> None:
    tiles = row_tiles(10)
    plan = Plan([], 0, list(tiles))
    for i, tile in enumerate(tiles):
        plan.add(write(tile, event=i, task=100 + i), {(1, i): [i]})
    rig = StreamRig(fake, flag_copy=True, coalesce=False)
    fake.poison(rig.transport.flags[1].data_ptr() + 4 * 5, 4, fake_cuda.INVALID_VALUE,
                at_execution=False)
    with pytest.raises(ProxyError, match=r"raising flag words 0\.\.7 of rank 1: cudaMemcpyAsync "
                       r"failed: invalid argument \(1\)") as info:
        rig.run(plan)
    assert "command #0 (WRITE" in str(info.value)
    assert rig.fifo.tail_value == 0 and not rig.transport.flags[1].any()


def test_streams_is_validated_by_name(fake: FakeCuda) -> None:
    with pytest.raises(ProxyError, match=r"proxy fake: streams must be an int in \[1, 64\]"):
        StreamRig(fake, flag_copy=True, streams=0)


def test_rect_lanes_round_trip_through_the_fifo() -> None:
    cmd = Command.write(0, Rect(0, 0, 1, 0, 4), 1, Rect(1, 0, 1, 0, 4), bytes=16, lane=7)
    words = encode(cmd, 1)
    assert words[14] == 7
    with pytest.raises(ProxyError, match="lane"):
        Command.signal(0, 1, 2, lane=256)


@pytest.mark.parametrize("value", ["0", "9", "two"])
def test_the_setting_names_its_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from mgraph.errors import SettingsError
    from mgraph.settings import Settings

    monkeypatch.setenv("MGRAPH_PROXY_STREAMS", value)
    with pytest.raises(SettingsError, match=f"MGRAPH_PROXY_STREAMS={value}"):
        Settings.from_env()
    monkeypatch.setenv("MGRAPH_PROXY_STREAMS", "4")
    assert Settings.from_env().proxy_streams == 4 and Settings().proxy_streams == 1
