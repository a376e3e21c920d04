"""The native proxy's verbs backend (runtime/proxy/native/verbs.h) on a CPU, against the fake
libibverbs of tests/fake_verbs: two ranks in this process, each with its own "device", its own
NativeVerbsTransport and its own NativeProxy, talking over RC queue pairs the fake's NIC threads
execute asynchronously.

Each run pushes random tiles (contiguous rows, and strided blocks: one work request per row)
and SIGNALs into rank 0's FIFO; rank 0's drain loop posts RDMA WRITE WITH IMMEDIATE chains;
rank 1's drain loop raises the events from the immediates. Checked: the destination equals the
source byte for byte; every flag word ends at exactly its count; a watcher never sees a tile's
flag before its bytes; "sent" (done) events on rank 0 arrive once per batch; the fake's counters
show chains (several requests per ibv_post_send) and one immediate per event. GPU memory (the
fake CUDA libraries of tests/fake_cuda, host memory standing in) is run through dma-buf,
nvidia-peermem and host staging. Missing library, missing device and a failing work request
are named errors.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator

import fake_cuda
import fake_verbs
import pytest
import torch
import torch.distributed as dist
from fake_cuda import FakeCuda
from fake_verbs import FakeVerbs

from mgraph.errors import ProxyError, RdmaUnavailableError
from mgraph.runtime.proxy import Command, CommandFifo, Rect
from mgraph.runtime.proxy.command import encode
from mgraph.runtime.proxy.native import NativeProxy, available, load
from mgraph.runtime.proxy.verbs_native import NativeVerbsTransport

if shutil.which("gcc") is None:
    pytest.skip("needs gcc to build the fake libraries", allow_module_level=True)
if not available():
    pytest.skip("the native proxy extension is not built", allow_module_level=True)

native = load()
ROWS, COLS = 64, 48  # float32 rows of 192 bytes
TILES = 24  # tiles per run: 16 row bands, 8 strided blocks
N_FLAGS = TILES + 4  # one word per tile, then SIGNAL words
N_DONE = 4  # rank 0's "sent" words


@pytest.fixture(scope="module")
def libs(tmp_path_factory: pytest.TempPathFactory) -> tuple[FakeVerbs, FakeCuda]:
    return (
        fake_verbs.build(tmp_path_factory.mktemp("fake_verbs")),
        fake_cuda.build(tmp_path_factory.mktemp("fake_cuda")),
    )


@pytest.fixture
def fakes(libs: tuple[FakeVerbs, FakeCuda]) -> Iterator[tuple[FakeVerbs, FakeCuda]]:
    for lib in libs:
        lib.reset()
    yield libs
    for lib in libs:
        lib.reset()


def tiles() -> list[Rect]:
    """16 bands of 2 full rows (contiguous; neighbours coalesce), then 8 blocks of 4 rows x 12
    cols with gaps between them (strided: one work request per row, even when merged)."""
    bands = [Rect(1, 2 * i, 2 * i + 2, 0, COLS) for i in range(16)]
    blocks = [
        Rect(1, 32 + 4 * (i // 2), 36 + 4 * (i // 2), 24 * (i % 2), 24 * (i % 2) + 12)
        for i in range(8)
    ]
    return bands + blocks


class Pair:
    """Ranks 0 and 1, each a transport (its own fake device) and a native proxy."""

    def __init__(
        self,
        fake: FakeVerbs,
        cuda: FakeCuda,
        *,
        place: str,
        gpu_memory: str = "auto",
        delay_us: int = 0,
        staging_bytes: int = 64 << 20,
    ) -> None:
        store = dist.HashStore()
        gen = torch.Generator().manual_seed(7)
        self.src = torch.randn(ROWS, COLS, generator=gen)
        self.dst = torch.full((ROWS, COLS), float("nan"))
        self.flags = [
            torch.zeros(N_DONE, dtype=torch.int32),
            torch.zeros(N_FLAGS, dtype=torch.int32),
        ]
        if place == "cuda":
            for t in (self.src, self.dst):
                fake.gpu_range(t.data_ptr(), t.numel() * t.element_size())
        fake.set_delay_us(delay_us)
        cuda_libs = ([str(cuda.runtime)], [str(cuda.driver)])
        self.transports = [
            NativeVerbsTransport(
                store,
                r,
                libs=[str(fake.path)],
                gpu_memory=gpu_memory,
                cuda_libs=cuda_libs,
                timeout=10.0,
                staging_bytes=staging_bytes,
                cuda_device=0 if place == "cuda" else -1,
            )
            for r in (0, 1)
        ]
        self.transports[0].register(0, {0: self.src}, self.flags[0], place=place)
        self.transports[1].register(1, {1: self.dst}, self.flags[1], place=place)
        self.transports[0].connect(0, 1)
        self.transports[1].connect(1, 0)
        self.fifos = [CommandFifo(64, timeout=10.0) for _ in range(2)]
        self.proxies = [
            NativeProxy(
                self.fifos[r],
                self.transports[r],
                8,
                rank=r,
                name=f"verbs{r}",
                timeout=10.0,
                idle_sleep_us=0,
            )
            for r in (0, 1)
        ]

    def push(self, commands: list[Command]) -> None:
        fifo = self.fifos[0]
        bodies = [encode(c, 1) for c in commands]
        ptrs = (fifo.ring.data_ptr(), fifo.head.data_ptr(), fifo.tail.data_ptr())
        assert native.produce(*ptrs, fifo.capacity, bodies, len(bodies)) == len(bodies)

    def wait_flags(self, rank: int, want: torch.Tensor, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not torch.equal(self.flags[rank], want):
            for p in self.proxies:
                p.check()
            assert time.monotonic() < deadline, f"rank {rank} flags {self.flags[rank]} != {want}"
            time.sleep(1e-3)

    def stop(self) -> None:
        for p in self.proxies:
            p.stop()


def commands(
    tile_list: list[Rect], epochs: int
) -> tuple[list[Command], torch.Tensor, torch.Tensor]:
    """Every tile once per epoch (its own event word, a done word), then 4 SIGNALs per epoch."""
    cmds: list[Command] = []
    want1 = torch.zeros(N_FLAGS, dtype=torch.int32)
    want0 = torch.zeros(N_DONE, dtype=torch.int32)
    for _ in range(epochs):
        for i, t in enumerate(tile_list):
            cmds.append(
                Command.write(
                    0, t._replace(buffer=0), 1, t, bytes=t.numel * 4, event=i, done_event=i % N_DONE
                )
            )
            want1[i] += 1
            want0[i % N_DONE] += 1
        for s in range(4):
            cmds.append(Command.signal(0, 1, TILES + s))
            want1[TILES + s] += 1
    return cmds, want0, want1


def watch(pair: Pair, tile_list: list[Rect], stop: threading.Event, seen: list[str]) -> None:
    """A tile's flag raised means its bytes are there (the immediate vouches for the write)."""
    while not stop.is_set():
        flags = pair.flags[1].clone()
        for i, t in enumerate(tile_list):
            if flags[i] > 0:
                region = (slice(t.row0, t.row1), slice(t.col0, t.col1))
                if not torch.equal(pair.dst[region], pair.src[region]):
                    seen.append(f"tile {i} flagged before its data landed")
        time.sleep(2e-4)


def run_pair(pair: Pair, epochs: int = 3) -> None:
    tile_list = tiles()
    cmds, want0, want1 = commands(tile_list, epochs)
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=watch, args=(pair, tile_list, stop, seen), daemon=True)
    watcher.start()
    for p in pair.proxies:
        p.start()
    try:
        for k in range(0, len(cmds), 48):  # the FIFO holds 64: push as it drains
            pair.push(cmds[k : k + 48])
        pair.wait_flags(1, want1)
        pair.wait_flags(0, want0)
    finally:
        stop.set()
        watcher.join()
    pair.stop()
    assert not seen, seen[:3]
    covered = torch.zeros(ROWS, COLS, dtype=torch.bool)
    for t in tile_list:
        covered[t.row0 : t.row1, t.col0 : t.col1] = True
    assert torch.equal(pair.dst[covered], pair.src[covered])  # byte for byte (float32 copies)
    assert pair.dst[~covered].isnan().all()  # nothing written outside the tiles
    assert torch.equal(pair.flags[1], want1) and torch.equal(pair.flags[0], want0)


def test_host_memory_two_ranks(fakes: tuple[FakeVerbs, FakeCuda]) -> None:
    fake, cuda = fakes
    pair = Pair(fake, cuda, place="host", delay_us=20)
    run_pair(pair)
    s = pair.transports[0].stats()
    events = 3 * (TILES + 4)
    assert s["imms"] == events == fake.stat("imms")  # one immediate per event, none lost
    assert pair.transports[1].stats()["recv_completions"] == events
    # neighbouring bands of a batch coalesce into one write (the events then ride on zero-length
    # writes after it); strided blocks take one request per row: 3 x 32 of them, + 3 x 4 SIGNALs
    assert s["wrs"] == fake.stat("wrs") >= 3 * 32 + 3 * 4 + 3
    assert s["post_calls"] < s["wrs"] and s["max_chain"] > 1  # batches go out as chains
    assert fake.stat("errors") == 0 and fake.stat("cq_overruns") == 0
    assert fake.stat("host_regs") == 2


@pytest.mark.parametrize("mode", ["dmabuf", "peermem"])
def test_gpu_memory_two_ranks(fakes: tuple[FakeVerbs, FakeCuda], mode: str) -> None:
    """GPU buffers registered through dma-buf (auto's first choice) or, without it, through
    nvidia-peermem are read and written by the NIC directly: nothing is staged."""
    fake, cuda = fakes
    fake.dmabuf(mode == "dmabuf")
    pair = Pair(fake, cuda, place="cuda", delay_us=10)
    for r in (0, 1):
        assert set(pair.transports[r].memory_kinds.values()) == {mode}
    run_pair(pair)
    s = pair.transports[0].stats()
    if mode == "dmabuf":
        assert fake.stat("dmabuf_regs") == 2 and cuda.stat("dmabuf_handles") == 2
    assert s["staged_copies"] == 0


def test_staged_source(fakes: tuple[FakeVerbs, FakeCuda]) -> None:
    """No dma-buf and no peermem for the source: every write is staged, the ring (16 KiB, about
    two batches) wraps many times without a block reused before the NIC read it."""
    fake, cuda = fakes
    fake.dmabuf(False)
    fake.peermem(False)
    store_pair = Pair.__new__(Pair)  # built by hand: only the source is GPU memory
    # the destination must be registrable: declare only the source GPU memory
    gen = torch.Generator().manual_seed(7)
    src = torch.randn(ROWS, COLS, generator=gen)
    fake.gpu_range(src.data_ptr(), src.numel() * 4)
    fake.set_delay_us(20)
    store = dist.HashStore()
    cuda_libs = ([str(cuda.runtime)], [str(cuda.driver)])
    t0 = NativeVerbsTransport(
        store, 0, libs=[str(fake.path)], cuda_libs=cuda_libs, staging_bytes=16 << 10, cuda_device=0
    )
    t1 = NativeVerbsTransport(store, 1, libs=[str(fake.path)])
    store_pair.src, store_pair.dst = src, torch.full((ROWS, COLS), float("nan"))
    store_pair.flags = [
        torch.zeros(N_DONE, dtype=torch.int32),
        torch.zeros(N_FLAGS, dtype=torch.int32),
    ]
    t0.register(0, {0: src}, store_pair.flags[0], place="cuda")
    t1.register(1, {1: store_pair.dst}, store_pair.flags[1])
    assert t0.memory_kinds == {0: "staged"} and t1.memory_kinds == {1: "host"}
    t0.connect(0, 1)
    t1.connect(1, 0)
    store_pair.transports = [t0, t1]
    store_pair.fifos = [CommandFifo(64, timeout=10.0) for _ in range(2)]
    store_pair.proxies = [
        NativeProxy(
            store_pair.fifos[r], store_pair.transports[r], 8, rank=r, timeout=10.0, idle_sleep_us=0
        )
        for r in (0, 1)
    ]
    run_pair(store_pair, epochs=6)
    s = t0.stats()
    assert 6 * 4 <= s["staged_copies"] <= 6 * TILES  # one per (coalesced) write
    assert s["staged_bytes"] == 6 * sum(t.numel * 4 for t in tiles())
    assert s["stage_waits"] > 0  # the ring filled and was freed by completions


def test_missing_library_and_device(fakes: tuple[FakeVerbs, FakeCuda], tmp_path) -> None:
    fake, _ = fakes
    with pytest.raises(RdmaUnavailableError, match="cannot load libibverbs"):
        NativeVerbsTransport(dist.HashStore(), 0, libs=[str(tmp_path / "libibverbs.so.1")])
    fake.set_devices(0)
    with pytest.raises(RdmaUnavailableError, match="no RDMA device: .* found none"):
        NativeVerbsTransport(dist.HashStore(), 0, libs=[str(fake.path)])
    fake.set_devices(2)
    with pytest.raises(RdmaUnavailableError, match="no RDMA device named 'mlx5_0'"):
        NativeVerbsTransport(dist.HashStore(), 0, libs=[str(fake.path)], device="mlx5_0")


def test_failed_write_is_a_named_error(fakes: tuple[FakeVerbs, FakeCuda]) -> None:
    fake, cuda = fakes
    pair = Pair(fake, cuda, place="host")
    for p in pair.proxies:
        p.start()
    fake.fail_next(fake_verbs.RETRY_EXC_ERR)
    cmds, _, _ = commands(tiles()[:4], 1)
    pair.push(cmds)
    deadline = time.monotonic() + 10
    while pair.proxies[0].running and time.monotonic() < deadline:
        time.sleep(1e-3)
    with pytest.raises(ProxyError, match="a write to rank 1 failed: IBV_WC_RETRY_EXC_ERR"):
        pair.proxies[0].check()
    pair.proxies[1].stop()


def test_refusals(fakes: tuple[FakeVerbs, FakeCuda]) -> None:
    """A destination its NIC could not register, and several copy streams, are refused."""
    fake, cuda = fakes
    fake.dmabuf(False)
    fake.peermem(False)
    pair = Pair(fake, cuda, place="cuda")
    assert pair.transports[1].memory_kinds == {1: "staged"}
    pair.proxies[1].start()
    pair.proxies[0].start()
    t = tiles()[0]
    pair.push([Command.write(0, t._replace(buffer=0), 1, t, bytes=t.numel * 4, event=0)])
    deadline = time.monotonic() + 10
    while pair.proxies[0].running and time.monotonic() < deadline:
        time.sleep(1e-3)
    with pytest.raises(ProxyError, match="could not register .* host staging covers only"):
        pair.proxies[0].check()
    pair.proxies[1].stop()
    fifo = CommandFifo(8)
    with pytest.raises(ProxyError, match="streams must be 1"):
        NativeProxy(fifo, pair.transports[0], 8, rank=0, streams=2)
