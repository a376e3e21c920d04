"""The native proxy's cuda data path on a CPU, against the fake CUDA runtime and driver of
tests/fake_cuda: streams executed asynchronously by worker threads over host memory, so the
proxy's ordering is exercised as a GPU would exercise it (mover.cpp's cuda branch, cuda_api.cpp).

Each test drives a real NativeProxy over host tensors registered as CUDA memory, in both flag
modes (cuStreamWriteValue32 stores, or copy-engine copies from the pinned staging ring). Checked:
data lands; every flag word ends at exactly its number of raises; a concurrent watcher thread and,
exactly, the fake's trace of executed operations never see a flag ahead of the data it vouches
for nor a flag going backwards; the staging ring wraps without reusing a word too early (with a
negative control showing the checks catch it); a failing CUDA call is a ProxyError naming the
command, never a crash.
"""

from __future__ import annotations

import ctypes
import gc
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import fake_cuda
import pytest
import torch
from fake_cuda import FakeCuda

from mgraph.errors import ProxyError
from mgraph.runtime.proxy import Command, CommandFifo, Rect
from mgraph.runtime.proxy.command import encode
from mgraph.runtime.proxy.native import NativeProxy, add_tensor, available, load

if shutil.which("gcc") is None:
    pytest.skip(
        "needs gcc to build the fake CUDA libraries (tests/fake_cuda)", allow_module_level=True
    )
if not available():
    pytest.skip(
        "the native proxy extension is not built (pip install -e . builds it)",
        allow_module_level=True,
    )

native = load()
ROWS, COLS = 128, 64  # float32: 256-byte rows
N_FLAGS = 16  # flag words per rank
STAGE_WORDS, REGION_WORDS = 1 << 16, 1 << 10  # mover.h: kStageWords, kRegionWords
Key = tuple[int, int]  # (rank, flag word)


class FakeCudaTransport:
    """What CudaIpcTransport.attach_native registers, over host memory and the fake libraries:
    rank 0's buffer 0 (the source) and rank 1's buffer 1 (the destination) as CUDA memory, and
    per rank ``N_FLAGS`` int32 flag words with the int64 host shadow of their running counts."""

    name = "fake_cuda"

    def __init__(
        self,
        fake: FakeCuda,
        *,
        driver: Path | None = None,
        device: int = 0,
        local: bool = False,
        host_flags: bool = False,
    ):
        gen = torch.Generator().manual_seed(device)
        self.src = torch.randn(ROWS, COLS, generator=gen)
        self.dst = torch.zeros(ROWS, COLS)
        self.flags = {r: torch.zeros(N_FLAGS, dtype=torch.int32) for r in (0, 1)}
        self.shadow = {r: torch.zeros(N_FLAGS, dtype=torch.int64) for r in (0, 1)}
        self.libs = ([str(fake.runtime)], [str(driver or fake.driver)])
        self.device = device
        self.local = local  # claim every buffer and flag is on the proxy's GPU (as cuda_ipc)
        self.host_flags = host_flags  # flags as pinned host memory: raised by host stores

    def attach_native(self, drain: object, rank: int, counters: dict) -> None:
        failure = drain.use_cuda(self.device, *self.libs)
        assert not failure, failure
        drain.local_memory = self.local
        add_tensor(drain, 0, native.PLACE_CUDA, 0, self.src, self.device)
        add_tensor(drain, 1, native.PLACE_CUDA, 1, self.dst, self.device)
        for r in (0, 1):
            if self.host_flags:
                drain.set_cuda_host_flags(r, self.flags[r].data_ptr(), N_FLAGS)
            else:
                drain.set_cuda_flags(
                    r, self.flags[r].data_ptr(), N_FLAGS, self.shadow[r].data_ptr()
                )

    def account(self, *_: object, **__: object) -> None:
        """NativeProxy.stop reports the loop's traffic here: nothing to count."""

    def landed(self, tile: Rect) -> bool:
        r = slice(tile.row0, tile.row1), slice(tile.col0, tile.col1)
        return torch.equal(self.dst[r], self.src[r])

    def address(self, tile: Rect, row: int, col: int) -> int:
        return self.dst.data_ptr() + ((tile.row0 + row) * COLS + tile.col0 + col) * 4


@dataclass
class Plan:
    """Commands (as FIFO bodies, pushed cycling to ``count``) and, per flag word, how often it
    is raised and which WRITE tiles (indices into ``tiles``) each of its raises vouches for."""

    bodies: list[list[int]]
    count: int
    tiles: list[Rect] = field(default_factory=list)  # destination of each WRITE, in order
    raises: dict[Key, int] = field(default_factory=lambda: defaultdict(int))
    vouches: dict[Key, list[list[int]]] = field(default_factory=lambda: defaultdict(list))

    def add(self, cmd: Command, vouch: dict[Key, list[int]]) -> None:
        self.bodies.append(encode(cmd, 1))
        self.count += 1
        for key, tiles in vouch.items():
            self.raises[key] += 1
            self.vouches[key].append(tiles)


def write(tile: Rect, **kw: int) -> Command:
    return Command.write(0, tile._replace(buffer=0), 1, tile, bytes=tile.numel * 4, **kw)


def row_tiles(n: int) -> list[Rect]:
    """One full row each: contiguous, so cudaMemcpyAsync (and neighbours coalesce)."""
    return [Rect(1, r, r + 1, 0, COLS) for r in range(n)]


def block_tiles(n: int) -> list[Rect]:
    """8 x 16 blocks of rows 64..127, four per band: strided, so cudaMemcpy2DAsync."""
    return [
        Rect(1, 64 + 8 * (i // 4), 72 + 8 * (i // 4), 16 * (i % 4), 16 * (i % 4) + 16)
        for i in range(n)
    ]


def data_plan() -> Plan:
    """Every tile of the destination, each raising an arrival word on rank 1 (i % 6) and a
    done word on rank 0 (i % 3); a SIGNAL on word 6 after every 7th write vouches for all the
    writes before it. Words repeat within a batch of 8, so raises are merged too."""
    plan = Plan([], 0)
    for i, tile in enumerate(row_tiles(64) + block_tiles(32)):
        plan.tiles.append(tile)
        plan.add(
            write(tile, event=i % 6, done_event=i % 3, task=i), {(1, i % 6): [i], (0, i % 3): [i]}
        )
        if i % 7 == 6:
            plan.add(Command.signal(0, 1, 6), {(1, 6): list(range(i + 1))})
    return plan


def signal_plan(count: int) -> Plan:
    """``count`` SIGNALs cycling over the 16 words of rank 1: any 8 in a row raise distinct
    words, so every SIGNAL is one raise (one staging word in flag_copy mode)."""
    plan = Plan([encode(Command.signal(0, 1, w), 1) for w in range(N_FLAGS)], count)
    for w in range(N_FLAGS):
        plan.raises[(1, w)] = len(range(w, count, N_FLAGS))
        plan.vouches[(1, w)] = [[]] * plan.raises[(1, w)]
    return plan


class Rig:
    """A NativeProxy (rank 0) over a FakeCudaTransport; ``run`` pushes a plan as a GPU would
    (module.cpp's ``produce``, concurrently with the loop) and stops the proxy."""

    def __init__(
        self,
        fake: FakeCuda,
        *,
        flag_copy: bool,
        coalesce: bool = True,
        driver: Path | None = None,
        device: int = 0,
        capacity: int = 1024,
        fuse_flags: bool = True,
        driver_copy: bool = False,
        gpu_fence: bool = False,
        local: bool = False,
        host_flags: bool = False,
    ) -> None:
        self.transport = FakeCudaTransport(
            fake, driver=driver, device=device, local=local, host_flags=host_flags
        )
        self.fifo = CommandFifo(capacity)
        self.proxy = NativeProxy(
            self.fifo,
            self.transport,
            8,
            rank=0,
            name="fake",
            coalesce=coalesce,
            flag_copy=flag_copy,
            fuse_flags=fuse_flags,
            driver_copy=driver_copy,
            gpu_fence=gpu_fence,
            # A deadline for a hang, not a speed check: the 70000-command staging-ring runs
            # took over 10 s to drain on two busy cores (a second pytest-xdist worker and other
            # processes beside them).
            timeout=60.0,
        )

    def push(self, plan: Plan) -> None:
        ptrs = (self.fifo.ring.data_ptr(), self.fifo.head.data_ptr(), self.fifo.tail.data_ptr())
        assert native.produce(*ptrs, self.fifo.capacity, plan.bodies, plan.count) == plan.count

    def run(self, plan: Plan) -> None:
        """A plan that fits the ring is queued before the loop starts (full batches of 8, so
        which raises merge does not depend on timing); a longer one is pushed as it drains."""
        if plan.count <= self.fifo.capacity:
            self.push(plan)
            self.proxy.start()
        else:
            self.proxy.start()
            self.push(plan)
        self.proxy.stop()


class Watcher:
    """A concurrent consumer polling the flag words, as a GPU kernel would: a word never goes
    backwards nor past its number of raises, and a value v means the tiles its first v raises
    vouch for have landed (read after the flag, as a consumer reads data after its flag)."""

    def __init__(self, plan: Plan, transport: FakeCudaTransport) -> None:
        self.plan, self.transport = plan, transport
        self.last: dict[Key, int] = defaultdict(int)
        self.checked: dict[Key, int] = defaultdict(int)  # raises whose tiles were seen landed
        self.is_landed = [False] * len(plan.tiles)
        self.errors: list[str] = []
        self.samples = self.partial = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="flag-watcher", daemon=True)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._done.set()
        self._thread.join()
        self.sample()

    def _loop(self) -> None:
        while not self._done.is_set():
            self.sample()
            time.sleep(20e-6)  # leave the loop and the stream a core of CI's two

    def landed(self, t: int) -> bool:
        if not self.is_landed[t]:  # a tile never un-lands: check until it has
            self.is_landed[t] = self.transport.landed(self.plan.tiles[t])
        return self.is_landed[t]

    def sample(self) -> None:
        values = {r: f.tolist() for r, f in self.transport.flags.items()}
        self.samples += 1
        partial = False
        for rank, words in values.items():
            for word, value in enumerate(words):
                key = (rank, word)
                want = self.plan.raises.get(key, 0)
                partial |= 0 < value < want
                if value < self.last[key]:
                    self.errors.append(f"word {key} went back from {self.last[key]} to {value}")
                if value > want:
                    self.errors.append(f"word {key} at {value}, past its {want} raises")
                for k in range(self.checked[key], min(value, want)):
                    missing = [t for t in self.plan.vouches[key][k] if not self.landed(t)]
                    if missing:
                        self.errors.append(f"word {key} at {value} before tiles {missing} landed")
                self.checked[key] = max(self.checked[key], min(value, want))
                self.last[key] = value
        self.partial += partial
        del self.errors[20:]


def check_trace(rows: torch.Tensor, plan: Plan, transport: FakeCudaTransport) -> list[str]:
    """Exact, from the fake's trace of executed operations in execution order: every flag store
    writes a value above the word's previous one and within its raises, after the copies of all
    the tiles its new raises vouch for executed; each word's last store is its number of raises."""
    dst_lo = transport.dst.data_ptr()
    dst_hi = dst_lo + transport.dst.numel() * 4
    corners = [
        (transport.address(t, 0, 0), transport.address(t, t.shape[0] - 1, t.shape[1] - 1))
        for t in plan.tiles
    ]
    flag_base = {r: f.data_ptr() for r, f in transport.flags.items()}
    landed = [False] * len(plan.tiles)
    last: dict[Key, int] = defaultdict(int)
    errors: list[str] = []

    def covers(dst: int, width: int, height: int, pitch: int, address: int) -> bool:
        row, col = divmod(address - dst, pitch)
        return address >= dst and row < height and col < width

    for seq, kind, dst, width, height, pitch, value, _stream in rows.tolist():
        if kind in (fake_cuda.COPY, fake_cuda.COPY_2D) and dst_lo <= dst < dst_hi:
            for t, (first, final) in enumerate(corners):
                if not landed[t] and covers(dst, width, height, pitch, first):
                    assert covers(dst, width, height, pitch, final), f"tile {t} copied in part"
                    landed[t] = True
            continue
        if kind not in (fake_cuda.COPY, fake_cuda.STORE_32):
            continue
        key = next(
            ((r, (dst - b) // 4) for r, b in flag_base.items() if b <= dst < b + 4 * N_FLAGS), None
        )
        if key is None:
            errors.append(f"op {seq} (kind {kind}) wrote outside the registered memory at {dst:#x}")
            continue
        want = plan.raises.get(key, 0)
        if not last[key] < value <= want:
            errors.append(f"op {seq}: word {key} went from {last[key]} to {value} ({want} raises)")
        else:
            for k in range(last[key], value):
                missing = [t for t in plan.vouches[key][k] if not landed[t]]
                if missing:
                    errors.append(f"op {seq}: word {key} at {value} before tiles {missing} landed")
        last[key] = max(last[key], value)
    for key, want in plan.raises.items():
        if last[key] != want:
            errors.append(f"word {key}: last store {last[key]}, but {want} raises")
    return errors[:20]


def check_final(rig: Rig, plan: Plan) -> None:
    for rank, flags in rig.transport.flags.items():
        want = [plan.raises.get((rank, w), 0) for w in range(N_FLAGS)]
        assert flags.tolist() == want, f"rank {rank}'s flag words"
        if not rig.transport.host_flags:  # host-resident flags need no shadow
            assert rig.transport.shadow[rank].tolist() == want, f"rank {rank}'s host shadow"


def live_objects(fake: FakeCuda) -> dict[str, int]:
    """Streams, events and pinned blocks alive now, once earlier tests' proxies are collected."""
    gc.collect()
    return {k: fake.stat(k) for k in ("live_streams", "live_events", "live_host")}


# -- the fake itself ---------------------------------------------------------------------------
def test_fake_streams_run_behind_the_caller_and_read_sources_late(fake: FakeCuda) -> None:
    """The semantics the other tests rely on, through the C ABI the proxy uses."""
    lib, driver = fake.lib, ctypes.CDLL(str(fake.driver))
    ref, ptr, size = ctypes.byref, ctypes.c_void_p, ctypes.c_size_t
    stream, event = ptr(), ptr()
    assert lib.cudaStreamCreateWithFlags(ref(stream), 1) == 0
    assert lib.cudaEventCreateWithFlags(ref(event), 2) == 0
    src = torch.arange(64, dtype=torch.int32)
    dst = torch.zeros(64, dtype=torch.int32)
    flag = torch.zeros(1, dtype=torch.int32)
    fake.hold(True)
    assert lib.cudaMemcpyAsync(ptr(dst.data_ptr()), ptr(src.data_ptr()), size(256), 4, stream) == 0
    store = driver.cuStreamWriteValue32_v2(stream, ctypes.c_uint64(flag.data_ptr()), 7, 0)
    assert store == 0 and lib.cudaEventRecord(event, stream) == 0
    src += 1000  # after the call, before the copy runs: the copy must see this
    synced: list[int] = []  # ctypes drops the GIL: the sync blocks in its own thread
    waiter = threading.Thread(target=lambda: synced.append(lib.cudaEventSynchronize(event)))
    waiter.start()
    while fake.stat("waiting") == 0:
        time.sleep(1e-3)
    assert not dst.any() and flag.item() == 0 and fake.stat("executed") == 0  # held
    fake.hold(False)
    waiter.join()
    assert synced == [0] and torch.equal(dst, src) and flag.item() == 7
    assert lib.cudaMemcpyAsync(ptr(dst.data_ptr()), ptr(src.data_ptr()), size(256), 7, stream) == 21
    assert lib.cudaGetLastError() == 21 and lib.cudaGetLastError() == 0
    # Peer access: once per pair, then 704 (already enabled).
    assert lib.cudaSetDevice(1) == 0
    assert lib.cudaDeviceEnablePeerAccess(0, 0) == 0
    assert lib.cudaDeviceEnablePeerAccess(0, 0) == 704
    assert lib.cudaSetDevice(2) == 101  # two devices
    assert lib.cudaEventDestroy(event) == 0 and lib.cudaStreamDestroy(stream) == 0
    assert fake.stat("max_lag") == 3 and fake.stat("event_syncs_blocked") == 1


def test_delay_is_read_from_the_environment_at_load(fake: FakeCuda) -> None:
    code = "import ctypes, sys; print(ctypes.CDLL(sys.argv[1]).fakecuda_delay_us())"
    env = {**os.environ, "FAKE_CUDA_DELAY_US": "123"}
    out = subprocess.run(
        [sys.executable, "-c", code, str(fake.runtime)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "123"


def queue_calls(fake: FakeCuda) -> int:
    """The fake's entry-point calls that queued copies or flag writes (one batch call is one)."""
    names = ("enq_copy", "enq_copy2d", "enq_batch", "enq_store", "enq_store_batch", "enq_mark")
    return sum(fake.stat(k) for k in names)


# -- data and flags ----------------------------------------------------------------------------
# NativeProxy options (and the transport's claim that all memory is local) per protocol.
PROTOCOL_OPTIONS = {
    "fused": {},
    "per-word": {"fuse_flags": False},
    "fused-driver": {"driver_copy": True},
    "fused-gpufence": {"gpu_fence": True, "local": True},
    "fused-gpufence-remote": {"gpu_fence": True, "local": False},  # not allowed: system scope
}
# (flag_copy, delay_us, protocol): fused flags (the default) with and without a lagging stream;
# one call per word (the protocol before, kept to measure against), driver-API data copies and
# GPU-scope barriers (PROTOCOL_OPTIONS) with a lag only.
DATA_CASES = [
    (flag_copy, delay, protocol)
    for flag_copy in (False, True)
    for delay, protocol in ((0, "fused"), (300, "fused"), (300, "per-word"), (300, "fused-driver"))
] + [(False, 300, "fused-gpufence")]


@pytest.mark.parametrize(
    "flag_copy, delay_us, protocol",
    DATA_CASES,
    ids=[f"{'copy' if f else 'store'}-flags-{'delay' if d else 'no-delay'}-{p}" for f, d, p in DATA_CASES],
)
def test_data_lands_before_its_flags(
    fake: FakeCuda, flag_copy: bool, delay_us: int, protocol: str
) -> None:
    fake.set_delay_us(delay_us)
    fake.start_trace(100_000)
    plan = data_plan()
    fuse, by_driver = protocol != "per-word", protocol == "fused-driver"
    rig = Rig(fake, flag_copy=flag_copy, **PROTOCOL_OPTIONS[protocol])
    with Watcher(plan, rig.transport) as watcher:
        rig.run(plan)
    assert torch.equal(rig.transport.dst, rig.transport.src)  # the tiles cover the buffer
    check_final(rig, plan)
    assert watcher.errors == []
    assert check_trace(fake.trace(), plan, rig.transport) == []
    s = rig.proxy.loop_stats()
    assert (s["writes"] + s["coalesced"], s["signals"], s["events"]) == (96, 13, 96 * 2 + 13)
    assert s["coalesced"] > 0  # neighbouring tiles went out as one copy
    assert s["raises"] < s["events"]  # words repeated within a batch went out merged
    assert fake.stat("enq_copy2d") > 0 and fake.stat("null_stream_ops") == 0
    assert fake.stat("trace_dropped") == 0
    assert s["cuda_calls"] == queue_calls(fake)  # every queueing call is counted
    rows = fake.trace()  # data copies through cudaMemcpyAsync: the contiguous row tiles
    data_copies = int(((rows[:, 1] == fake_cuda.COPY) & (rows[:, 3] > 4)).sum())
    # driver_copy: every 1-D copy (data, and staged flag words outside a batch) by the driver
    assert fake.stat("driver_copies") == (fake.stat("enq_copy") if by_driver else 0)
    if flag_copy and fuse:  # runs of neighbouring words staged together, several in one batch
        assert fake.stat("enq_store") + fake.stat("enq_store_batch") == 0
        assert s["flag_copies"] < s["raises"] and s["batch_calls"] > 0
        flag_ops = fake.stat("enq_copy") - data_copies + fake.stat("batch_copies")
        assert flag_ops == s["flag_copies"] and fake.stat("enq_batch") == s["batch_calls"]
    elif flag_copy:
        assert fake.stat("enq_store") == 0 and fake.stat("enq_batch") == 0
        assert fake.stat("enq_copy") == s["raises"] + data_copies
    elif fuse:  # words due together in one cuStreamBatchMemOp
        stores = fake.stat("enq_store") + fake.stat("batch_stores")
        assert stores == s["raises"] == s["flag_copies"]
        assert 0 < fake.stat("enq_store_batch") and fake.stat("enq_store_batch") + fake.stat(
            "enq_store"
        ) < s["raises"]
    else:
        assert fake.stat("enq_store") == s["raises"] and fake.stat("store_v2") == s["raises"]
        assert fake.stat("enq_store_batch") == 0
    if delay_us:  # the stream really ran behind the loop, and the watcher saw it mid-way
        assert fake.stat("max_lag") > 8 and watcher.partial > 0


def calls_plan(n_writes: int = 48) -> Plan:
    """WRITEs of one row each raising rank 1's word i % 8 and rank 0's done word i % 8 (like
    the latency bench: destination and done flags), and after every 4th a SIGNAL on rank 1's
    word 8 + k % 8. Any 8 commands in a row raise distinct words, so every command's words are
    due right after it and nothing merges: the calls per command are the protocol's own."""
    plan = Plan([], 0)
    for i, tile in enumerate(row_tiles(n_writes)):
        plan.tiles.append(tile)
        plan.add(write(tile, event=i % 8, done_event=i % 8, task=i),
                 {(1, i % 8): [i], (0, i % 8): [i]})  # fmt: skip
        if i % 4 == 3:
            k = i // 4
            plan.add(Command.signal(0, 1, 8 + k % 8, task=k), {(1, 8 + k % 8): list(range(i + 1))})
    return plan


# (flag_copy, protocol, fake driver / runtime, CUDA calls per WRITE); a SIGNAL is 1 in all.
CALL_CASES = [
    (False, "fused", "", 2),  # data, then one cuStreamBatchMemOp for both words
    (True, "fused", "", 2),  # data, then one cudaMemcpyBatchAsync for both staged words
    (False, "fused-driver", "", 2),  # the data copy through cuMemcpyAsync
    (False, "fused-gpufence", "", 2),  # one GPU-scope barrier, then both stores, in one call
    (False, "fused-gpufence-remote", "", 2),
    (False, "per-word", "", 3),  # the protocol before: one call per word
    (True, "per-word", "", 3),
    (False, "fused", "driver-v1", 3),  # no cuStreamBatchMemOp: one store call per word
    (True, "fused", "runtime-12.4", 3),  # no cudaMemcpyBatchAsync: one copy per word
]


@pytest.mark.parametrize(
    "flag_copy, protocol, old, per_write",
    CALL_CASES,
    ids=[f"{'copy' if f else 'store'}-flags-{p}{'-' + o if o else ''}" for f, p, o, _ in CALL_CASES],
)
def test_cuda_calls_per_command_are_pinned(
    fake: FakeCuda, flag_copy: bool, protocol: str, old: str, per_write: int
) -> None:
    """The CUDA calls a WRITE (data + destination word + done word) and a SIGNAL cost, counted
    by the loop and by the fake's entry points: adding a call back fails here."""
    if old == "runtime-12.4":
        fake.set_runtime_version(12040)
    fake.start_trace(10_000)
    plan = calls_plan()
    rig = Rig(fake, flag_copy=flag_copy, coalesce=False, **PROTOCOL_OPTIONS[protocol],
              driver=fake.driver_v1 if old == "driver-v1" else None)  # fmt: skip
    rig.run(plan)
    check_final(rig, plan)
    assert check_trace(fake.trace(), plan, rig.transport) == []
    s = rig.proxy.loop_stats()
    writes, signals = s["writes"], s["signals"]
    assert (writes, signals, s["coalesced"], s["raises"]) == (48, 12, 0, 2 * 48 + 12)
    assert s["cuda_calls"] == per_write * writes + signals == queue_calls(fake)
    # The flag calls among them: all but each WRITE's data copy.
    assert s["flag_calls"] == (per_write - 1) * writes + signals
    assert 0 < s["flag_call_ns"] < s["cuda_call_ns"]
    assert fake.stat("driver_copies") == (writes if protocol == "fused-driver" else 0)
    fence = protocol == "fused-gpufence"  # in force: every flag call starts with one barrier
    assert fake.stat("gpu_barriers") == fake.stat("memop_barriers")
    assert fake.stat("gpu_barriers") == (writes + signals if fence else 0)
    assert fake.stat("enq_store_batch") == (writes + signals if fence else 0) + (
        writes if protocol in ("fused", "fused-driver", "fused-gpufence-remote") and not flag_copy
        and old != "driver-v1" else 0
    )  # fmt: skip
    assert rig.proxy.cuda_apis == {
        "batch_copy": protocol != "per-word" and old != "runtime-12.4",
        "batch_memop": old != "driver-v1",
        "driver_copy": old != "driver-v1",
        "gpu_fence": fence,
        "kernel": True,  # both fake drivers can load and launch the copy kernel
    }


# -- host-resident flags -------------------------------------------------------------------------
def test_host_resident_flags_wait_for_their_data(fake: FakeCuda) -> None:
    """Flag words in (pinned) host memory: the loop raises them with host stores once the stream
    has executed the work before them. A lagging stream and a watcher: no word ahead of its
    data, exact final counts; no flag call at all (only data copies, and an event recorded
    where a batch came while words still waited)."""
    fake.set_delay_us(300)
    plan = data_plan()
    rig = Rig(fake, flag_copy=False, host_flags=True)
    with Watcher(plan, rig.transport) as watcher:
        rig.run(plan)
    assert torch.equal(rig.transport.dst, rig.transport.src)
    check_final(rig, plan)
    # The stream ran behind the loop (the watcher may or may not sample mid-way here: the held
    # test below is the deterministic one).
    assert watcher.errors == [] and fake.stat("max_lag") > 8
    s = rig.proxy.loop_stats()
    assert s["flag_calls"] == 0 and fake.stat("enq_store") + fake.stat("enq_store_batch") == 0
    assert s["cuda_calls"] == queue_calls(fake) == fake.stat("enq_copy") + fake.stat(
        "enq_copy2d"
    ) + fake.stat("enq_mark")
    assert fake.stat("enq_mark") > 0 and fake.stat("queries") > 0


def test_host_resident_flags_stay_down_while_the_stream_holds_their_data(fake: FakeCuda) -> None:
    """Deterministic: with the stream held (nothing executes) the running loop raises no word,
    whatever it polls; released, every word reaches its count."""
    fake.hold(True)
    plan = data_plan()
    rig = Rig(fake, flag_copy=False, host_flags=True)
    rig.push(plan)
    rig.proxy.start()
    deadline = time.monotonic() + 10
    while rig.fifo.tail_value < min(plan.count, rig.fifo.capacity) and time.monotonic() < deadline:
        time.sleep(1e-3)  # every command queued its copies (the loop released them all)
    time.sleep(0.02)
    assert rig.fifo.tail_value == plan.count and fake.stat("queries") > 0
    assert all(not f.any() for f in rig.transport.flags.values())
    fake.hold(False)
    rig.proxy.stop()
    check_final(rig, plan)


def test_one_write_in_flight_is_one_cuda_call_with_host_resident_flags(fake: FakeCuda) -> None:
    """As in the latency bench: each WRITE (destination and done word) is pushed once the
    previous one's done word is up. Then a WRITE is its data copy alone, and a SIGNAL nothing."""
    rig = Rig(fake, flag_copy=False, coalesce=False, host_flags=True)
    rig.proxy.start()
    tiles = row_tiles(16)

    def wait_for(rank: int, word: int, value: int) -> None:
        deadline = time.monotonic() + 10
        while rig.transport.flags[rank][word].item() < value:
            assert time.monotonic() < deadline, f"word {word} of rank {rank} never reached {value}"
            time.sleep(1e-4)

    for i, tile in enumerate(tiles):
        rig.fifo.push(write(tile, event=i % 8, done_event=i % 8, task=i))
        wait_for(0, i % 8, i // 8 + 1)
        assert rig.transport.landed(tile) and rig.transport.flags[1][i % 8].item() == i // 8 + 1
        if i % 4 == 3:  # alone too (pushed with the WRITE, a batch could find its words waiting)
            rig.fifo.push(Command.signal(0, 1, 8 + i // 4))
            wait_for(1, 8 + i // 4, 1)
    rig.proxy.stop()
    s = rig.proxy.loop_stats()
    assert (s["writes"], s["signals"]) == (16, 4)
    assert s["cuda_calls"] == 16 == fake.stat("enq_copy") and fake.stat("enq_mark") == 0
    assert rig.transport.flags[1][8:12].tolist() == [1, 1, 1, 1]


def test_host_resident_flags_need_one_stream(fake: FakeCuda) -> None:
    transport = FakeCudaTransport(fake, host_flags=True)
    fifo = CommandFifo(64)
    proxy = NativeProxy(fifo, transport, 8, rank=0, name="fake", streams=2, timeout=10.0)
    fifo.push(write(row_tiles(1)[0], event=0))
    with pytest.raises(ProxyError, match=r"in host memory.*needs one copy stream \(streams=1\)"):
        with proxy:
            pass


def test_an_older_driver_without_the_v2_symbol(fake: FakeCuda) -> None:
    plan = data_plan()
    rig = Rig(fake, flag_copy=False, driver=fake.driver_v1)
    rig.run(plan)
    assert torch.equal(rig.transport.dst, rig.transport.src)
    check_final(rig, plan)
    raises = rig.proxy.loop_stats()["raises"]
    assert fake.stat("store_v1") == raises and fake.stat("store_v2") == 0


def test_the_checks_catch_a_flag_ahead_of_its_data(fake: FakeCuda) -> None:
    """Negative control: with stores that skip the stream (written when called, ahead of the
    delayed copies queued before them), both the watcher and the trace check object."""
    fake.set_delay_us(300)
    fake.unordered_stores(True)
    fake.start_trace(100_000)
    plan = data_plan()
    rig = Rig(fake, flag_copy=False)
    with Watcher(plan, rig.transport) as watcher:
        rig.run(plan)
    assert any("before tiles" in e for e in watcher.errors)
    assert any("before tiles" in e for e in check_trace(fake.trace(), plan, rig.transport))


# -- the pinned staging ring of flag_copy ------------------------------------------------------
N_WRAP = 70_000  # raises: one lap of the 65536-word ring and 4464 words of the next


def release_when(fake: FakeCuda, seen: dict[str, int], ops: int) -> threading.Thread:
    """Releases a held stream once the loop blocks on an event, or queued ``ops`` flag writes."""

    def watch() -> None:
        deadline = time.monotonic() + 10.0  # never leave a stream held
        while time.monotonic() < deadline:
            if fake.stat("waiting") or fake.stat("enq_copy") + fake.stat("enq_store") >= ops:
                break
            time.sleep(1e-3)
        seen.update({k: fake.stat(k) for k in ("waiting", "enq_copy", "enq_mark", "executed")})
        fake.hold(False)

    thread = threading.Thread(target=watch, name="releaser", daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    "flag_copy, mode",
    [(True, "free"), (True, "delay"), (True, "held"), (False, "delay")],
    ids=["copy-flags", "copy-flags-delay", "copy-flags-held", "store-flags-delay"],
)
def test_staging_ring_wraps_without_reusing_a_word_early(
    fake: FakeCuda, flag_copy: bool, mode: str
) -> None:
    """70000 SIGNALs, each one raise: the ring's 64 regions of 1024 staging words fill once, so
    regions 0..4 are reused; each reuse first waits for the event recorded behind the region's
    last copy a lap ago. Held: the stream executes nothing until the loop blocks on that wait,
    which must come exactly when the ring is full."""
    fake.start_trace(N_WRAP + 1000)
    if mode == "delay":
        fake.set_delay_us(2)
    plan = signal_plan(N_WRAP)
    rig = Rig(fake, flag_copy=flag_copy)
    seen: dict[str, int] = {}
    releaser = None
    if mode == "held":
        fake.hold(True)
        releaser = release_when(fake, seen, N_WRAP)
    with Watcher(plan, rig.transport) as watcher:
        rig.run(plan)
    check_final(rig, plan)
    assert watcher.errors == []
    assert check_trace(fake.trace(), plan, rig.transport) == []
    assert rig.proxy.loop_stats()["raises"] == N_WRAP
    if not flag_copy:
        assert fake.stat("enq_store") == N_WRAP and fake.stat("enq_mark") == 0
        return
    regions_reused = -(-(N_WRAP - STAGE_WORDS) // REGION_WORDS)  # 5
    assert fake.stat("enq_copy") == N_WRAP
    assert (
        fake.stat("enq_mark")
        == STAGE_WORDS // REGION_WORDS + (N_WRAP - STAGE_WORDS) // REGION_WORDS
    )
    assert fake.stat("event_syncs") == regions_reused
    if releaser is not None:
        releaser.join()
        # Blocked with the whole ring in flight and not one copy executed: the first reuse.
        assert seen == {"waiting": 1, "enq_copy": STAGE_WORDS, "enq_mark": 64, "executed": 0}
        assert fake.stat("event_syncs_blocked") >= 1


def test_the_checks_catch_a_staging_word_reused_before_its_copy_ran(
    fake: FakeCuda,
) -> None:
    """Negative control: with an event wait that does not wait, the held stream's first-lap
    copies read the second lap's counts, and the trace check says so."""
    fake.start_trace(N_WRAP + 1000)
    fake.events_never_wait(True)
    fake.hold(True)
    plan = signal_plan(N_WRAP)
    rig = Rig(fake, flag_copy=True)
    releaser = release_when(fake, {}, N_WRAP)
    rig.run(plan)
    releaser.join()
    errors = check_trace(fake.trace(), plan, rig.transport)
    assert errors and "went from" in errors[0]
    check_final(rig, plan)  # the last lap's copies still leave the right counts behind


# -- failures ----------------------------------------------------------------------------------
def failing_plan(tiles: list[Rect]) -> Plan:
    """One write per tile, each raising its own word on rank 1 (so no raise is deferred)."""
    plan = Plan([], 0, list(tiles))
    for i, tile in enumerate(tiles):
        plan.add(write(tile, event=i, task=100 + i), {(1, i): [i]})
    return plan


@pytest.mark.parametrize("flag_copy", [False, True], ids=["store-flags", "copy-flags"])
@pytest.mark.parametrize(
    "tiles, call",
    [(row_tiles, "cudaMemcpyAsync"), (block_tiles, "cudaMemcpy2DAsync")],
    ids=["rows", "blocks"],
)
def test_a_failing_copy_names_its_command(
    fake: FakeCuda, tiles: Callable[[int], list[Rect]], call: str, flag_copy: bool
) -> None:
    plan = failing_plan(tiles(10))
    rig = Rig(fake, flag_copy=flag_copy, coalesce=False)
    bad = plan.tiles[5]
    fake.poison(
        rig.transport.address(bad, bad.shape[0] - 1, 3),
        4,
        fake_cuda.INVALID_VALUE,
        at_execution=False,
    )
    with pytest.raises(ProxyError, match=rf"{call} failed: invalid argument \(1\)") as info:
        rig.run(plan)
    assert "command #5 (WRITE" in str(info.value) and "task 105" in str(info.value)
    assert rig.fifo.tail_value == 5
    assert [rig.transport.landed(t) for t in plan.tiles] == [True] * 5 + [False] * 5
    assert rig.transport.flags[1].tolist() == [1] * 5 + [0] * (N_FLAGS - 5)


@pytest.mark.parametrize(
    "flag_copy, call",
    [(False, "cuStreamWriteValue32"), (True, "cudaMemcpyAsync")],
    ids=["store-flags", "copy-flags"],
)
def test_a_failing_flag_write_names_its_command(fake: FakeCuda, flag_copy: bool, call: str) -> None:
    plan = failing_plan(row_tiles(10))
    rig = Rig(fake, flag_copy=flag_copy, coalesce=False)
    fake.poison(
        rig.transport.flags[1].data_ptr() + 4 * 5, 4, fake_cuda.INVALID_VALUE, at_execution=False
    )
    with pytest.raises(ProxyError, match=rf"{call} failed: invalid argument \(1\)") as info:
        rig.run(plan)
    assert "command #5 (WRITE" in str(info.value)
    assert rig.fifo.tail_value == 5
    # The write's data went out before its raise failed; nothing after it ran.
    assert [rig.transport.landed(t) for t in plan.tiles] == [True] * 6 + [False] * 4
    assert rig.transport.flags[1].tolist() == [1] * 5 + [0] * (N_FLAGS - 5)


@pytest.mark.parametrize(
    "call",
    [
        "cudaSetDevice",
        "cudaGetDeviceCount",
        "cudaDeviceEnablePeerAccess",
        "cudaStreamCreateWithFlags",
        "cudaHostAlloc",
        "cudaEventCreateWithFlags",
    ],
)
def test_a_failing_setup_call_is_a_named_error_and_leaks_nothing(fake: FakeCuda, call: str) -> None:
    live = live_objects(fake)
    fake.fail(call, fake_cuda.OUT_OF_MEMORY)
    plan = failing_plan(row_tiles(4))
    rig = Rig(fake, flag_copy=True)
    rig.push(plan)
    with pytest.raises(ProxyError, match=rf"^proxy fake: {call} failed: out of memory \(2\)$"):
        rig.proxy.stop()
    assert rig.fifo.tail_value == 0 and not rig.transport.dst.any()
    del rig
    assert live_objects(fake) == live


def test_a_failure_on_the_stream_is_a_proxy_error(fake: FakeCuda) -> None:
    """A copy that faults when it EXECUTES (an illegal address): the stream fails for good, like
    a GPU's, and the next CUDA call the loop makes reports it; later work never runs."""
    plan = failing_plan(row_tiles(10))
    rig = Rig(fake, flag_copy=False, coalesce=False)
    fake.poison(rig.transport.address(plan.tiles[5], 0, 0), 4, 0, at_execution=True)
    with pytest.raises(ProxyError, match=r"an illegal memory access was encountered \(700\)"):
        rig.run(plan)
    assert [rig.transport.landed(t) for t in plan.tiles][:6] == [True] * 5 + [False]
    assert rig.transport.flags[1][5:].tolist() == [0] * (N_FLAGS - 5)


# -- setup and teardown ------------------------------------------------------------------------
def test_peer_access_is_enabled_once_and_everything_is_released(fake: FakeCuda) -> None:
    """Two proxies on device 1 in turn: the first enables peer 0, the second finds it enabled
    (704, cleared with cudaGetLastError, not an error); streams, events and pinned staging are
    all released when the proxies go."""
    live = live_objects(fake)
    for _ in range(2):
        plan = failing_plan(row_tiles(8))
        rig = Rig(fake, flag_copy=True, device=1)
        rig.run(plan)
        assert all(rig.transport.landed(t) for t in plan.tiles)
        check_final(rig, plan)
    assert fake.stat("last_device") == 1 and fake.stat("set_device") == 2
    assert (fake.stat("peer_enabled"), fake.stat("peer_already")) == (1, 1)
    assert fake.stat("last_error_cleared") == 1
    assert live_objects(fake)["live_events"] == live["live_events"] + 64  # the last rig's
    del rig
    assert live_objects(fake) == live


def test_cuda_memory_without_cuda_libraries_is_an_error_not_a_crash() -> None:
    code = """if True:
        import torch
        from mgraph.runtime.proxy import Command, CommandFifo, Rect
        from mgraph.runtime.proxy.native import add_tensor, load
        native = load()
        fifo = CommandFifo(8)
        ptrs = fifo.ring.data_ptr(), fifo.head.data_ptr(), fifo.tail.data_ptr()
        drain = native.Drain(*ptrs, 8, 8, True, 2.0)
        add_tensor(drain, 0, native.PLACE_CUDA, 0, torch.randn(4, 4), 0)
        add_tensor(drain, 1, native.PLACE_CUDA, 0, torch.zeros(4, 4), 0)
        fifo.push(Command.write(0, Rect(0, 0, 4, 0, 4), 1, Rect(0, 0, 4, 0, 4), bytes=64))
        drain.start()
        drain.stop(2.0)
        print(drain.error())
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-500:]}"
    assert "cuda" in done.stdout.lower()


def test_turning_flag_copy_on_in_a_running_loop_is_refused_not_a_crash(fake: FakeCuda) -> None:
    code = """if True:
        import sys, time
        import torch
        from mgraph.runtime.proxy import Command, CommandFifo
        from mgraph.runtime.proxy.native import add_tensor, load
        native = load()
        fifo = CommandFifo(8)
        ptrs = fifo.ring.data_ptr(), fifo.head.data_ptr(), fifo.tail.data_ptr()
        drain = native.Drain(*ptrs, 8, 8, True, 2.0)
        assert not drain.use_cuda(0, [sys.argv[1]], [sys.argv[2]])
        flags = torch.zeros(4, dtype=torch.int32)
        shadow = torch.zeros(4, dtype=torch.int64)
        add_tensor(drain, 1, native.PLACE_CUDA, 0, torch.zeros(4, 4), 0)
        drain.set_cuda_flags(1, flags.data_ptr(), 4, shadow.data_ptr())
        drain.start()
        time.sleep(0.05)
        try:
            drain.flag_copy = True
        except Exception as exc:  # refusing is a fix too
            print("refused:", exc)
        fifo.push(Command.signal(0, 1, 2))
        drain.stop(2.0)
        print(drain.error(), flags.tolist())
    """
    argv = [sys.executable, "-c", code, str(fake.runtime), str(fake.driver)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-500:]}"
