"""The native proxy's copy-and-flag kernel (``copy_kernel_bytes``; runtime/proxy/native/
copy_kernel.h) on a CPU, against the fake CUDA driver of tests/fake_cuda, whose cuLaunchKernel
queues what the kernel does, in its order: the copy, then the flag stores.

Checked as for the other protocols (tests/test_native_cuda_path.py): data lands, every flag word
ends at its number of raises, and a concurrent watcher and the fake's exact trace never see a
flag ahead of the data it vouches for (a negative control, a kernel storing its flags first,
shows they would); one WRITE in flight is ONE CUDA call; WRITEs above the limit, host-resident
flags and a failing launch take the paths they must. The PTX itself is assembled with ptxas where
one is installed (what the driver's JIT will get on the GPU).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import time
from pathlib import Path

import fake_cuda
import pytest
import torch
from fake_cuda import FakeCuda
from test_native_cuda_path import (
    FakeCudaTransport,
    Rig,
    Watcher,
    check_final,
    check_trace,
    data_plan,
    live_objects,
    row_tiles,
    write,
)

from mgraph.errors import ProxyError
from mgraph.runtime.proxy import Command, CommandFifo
from mgraph.runtime.proxy.native import NativeProxy, load

native = load()  # test_native_cuda_path skipped this module already if it is not built


class KernelRig(Rig):
    """Rig's proxy with the copy kernel on (every WRITE of the plans qualifies by size)."""

    def __init__(
        self,
        fake: FakeCuda,
        *,
        kernel_bytes: int = 1 << 20,
        flag_copy: bool = False,
        coalesce: bool = True,
        host_flags: bool = False,
    ) -> None:
        self.transport = FakeCudaTransport(fake, host_flags=host_flags)
        self.fifo = CommandFifo(1024)
        self.proxy = NativeProxy(self.fifo, self.transport, 8, rank=0, name="fake",
                                 coalesce=coalesce, flag_copy=flag_copy, timeout=60.0,
                                 copy_kernel_bytes=kernel_bytes)  # fmt: skip


def _ptxas() -> str | None:
    found = shutil.which("ptxas")
    if found:
        return found
    import triton  # ships one with its CUDA backend

    hits = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas"))
    return hits[0] if hits else None


def test_the_ptx_assembles_for_hopper(tmp_path: Path) -> None:
    ptx = native.COPY_KERNEL_PTX
    assert f".entry {native.COPY_KERNEL_NAME}(.param .align 8 .b8 args[160])" in ptx
    assert ptx.count("st.release.sys.global.u32") == 8  # kKernelFlags, each a release
    ptxas = _ptxas()
    if ptxas is None:
        pytest.skip("no ptxas (CUDA toolkit or triton's) to assemble the PTX with")
    (tmp_path / "k.ptx").write_text(ptx)
    done = subprocess.run([ptxas, "-arch=sm_90", str(tmp_path / "k.ptx"), "-o",
                           str(tmp_path / "k.cubin")], capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("flag_copy", [False, True], ids=["store-flags", "copy-flags"])
@pytest.mark.parametrize("delay_us", [0, 300], ids=["no-delay", "delay"])
def test_kernel_writes_land_before_their_flags(
    fake: FakeCuda, flag_copy: bool, delay_us: int
) -> None:
    """data_plan: row tiles (1-D), 8 x 16 blocks (2-D), coalesced groups, SIGNALs vouching for
    every earlier WRITE, words repeated within batches (so some WRITEs find a raise held back
    and take the copy + flag path): every flag, whoever raised it, after its data."""
    fake.set_delay_us(delay_us)
    fake.start_trace(100_000)
    plan = data_plan()
    rig = KernelRig(fake, flag_copy=flag_copy)
    with Watcher(plan, rig.transport) as watcher:
        rig.run(plan)
    assert torch.equal(rig.transport.dst, rig.transport.src)
    check_final(rig, plan)
    assert watcher.errors == []
    assert check_trace(fake.trace(), plan, rig.transport) == []
    s = rig.proxy.loop_stats()
    assert (s["writes"] + s["coalesced"], s["signals"], s["events"]) == (96, 13, 96 * 2 + 13)
    assert 0 < s["kernel_writes"] < s["writes"]  # both paths taken
    assert fake.stat("kernel_launches") == s["kernel_writes"] + 1  # + the warm-up launch
    assert fake.stat("enq_copy2d") > 0 and fake.stat("null_stream_ops") == 0
    if delay_us:
        assert fake.stat("max_lag") > 8 and watcher.partial > 0


def test_the_checks_catch_a_kernel_that_flags_first(fake: FakeCuda) -> None:
    """Negative control: a kernel storing its flags before its copy is caught by both checks."""
    fake.set_delay_us(300)
    fake.kernel_flags_first(True)
    fake.start_trace(100_000)
    plan = data_plan()
    rig = KernelRig(fake)
    with Watcher(plan, rig.transport) as watcher:
        rig.run(plan)
    assert any("before tiles" in e for e in watcher.errors)
    assert any("before tiles" in e for e in check_trace(fake.trace(), plan, rig.transport))


def _wait_for(rig: Rig, rank: int, word: int, value: int) -> None:
    deadline = time.monotonic() + 10
    while rig.transport.flags[rank][word].item() < value:
        assert time.monotonic() < deadline, f"word {word} of rank {rank} never reached {value}"
        time.sleep(1e-4)


@pytest.mark.parametrize("flag_copy", [False, True], ids=["store-flags", "copy-flags"])
def test_one_write_in_flight_is_one_launch(fake: FakeCuda, flag_copy: bool) -> None:
    """As in the latency bench (a WRITE with its destination and done word, pushed once the
    previous done word is up): ONE CUDA call per WRITE, the launch, which raises both words."""
    rig = KernelRig(fake, flag_copy=flag_copy, coalesce=False)
    rig.proxy.start()
    assert fake.stat("live_modules") >= 1  # loaded (and warmed up) before start returned
    for i, tile in enumerate(row_tiles(16)):
        rig.fifo.push(write(tile, event=i % 8, done_event=i % 8, task=i))
        _wait_for(rig, 0, i % 8, i // 8 + 1)
        assert rig.transport.landed(tile) and rig.transport.flags[1][i % 8].item() == i // 8 + 1
    rig.fifo.push(Command.signal(0, 1, 9))  # a SIGNAL is still one flag call
    _wait_for(rig, 1, 9, 1)
    rig.proxy.stop()
    s = rig.proxy.loop_stats()
    assert (s["writes"], s["kernel_writes"], s["signals"]) == (16, 16, 1)
    assert s["cuda_calls"] == 16 + 1 + 1  # launches, the SIGNAL's flag, the warm-up launch
    assert fake.stat("kernel_launches") == 17
    assert rig.transport.shadow[1][:8].tolist() == [2] * 8


def test_large_writes_and_host_flags_take_the_copy_path(fake: FakeCuda) -> None:
    plan = data_plan()
    rig = KernelRig(fake, kernel_bytes=4)  # below every tile
    rig.run(plan)
    assert torch.equal(rig.transport.dst, rig.transport.src)
    check_final(rig, plan)
    assert rig.proxy.loop_stats()["kernel_writes"] == 0
    fake.reset()
    rig = KernelRig(fake, host_flags=True)  # words the loop raises itself: not the kernel's
    rig.run(plan)
    check_final(rig, plan)
    assert rig.proxy.loop_stats()["kernel_writes"] == 0


def test_the_kernel_needs_one_stream(fake: FakeCuda) -> None:
    with pytest.raises(ProxyError, match=r"copy_kernel_bytes=4096 needs one copy stream"):
        NativeProxy(CommandFifo(64), FakeCudaTransport(fake), 8, rank=0, streams=2,
                    copy_kernel_bytes=4096)  # fmt: skip


@pytest.mark.parametrize(
    "call, status, message",
    [("cuModuleLoadData", 218, r"cuModuleLoadData failed"),
     ("cuLaunchKernel", fake_cuda.INVALID_VALUE, r"command #0 .* cuLaunchKernel failed")],
)  # fmt: skip
def test_a_failing_kernel_call_is_a_named_error_and_leaks_nothing(
    fake: FakeCuda, call: str, status: int, message: str
) -> None:
    live = {**live_objects(fake), "live_modules": fake.stat("live_modules")}
    rig = KernelRig(fake)
    if call == "cuLaunchKernel":
        rig.proxy.start()  # the warm-up launch succeeds; the first WRITE's fails
    fake.fail(call, status)
    rig.fifo.push(write(row_tiles(1)[0], event=0, done_event=0))
    with pytest.raises(ProxyError, match=message):
        rig.proxy.stop()
    assert rig.fifo.tail_value == 0 and rig.transport.flags[1].sum().item() == 0
    del rig
    assert {**live_objects(fake), "live_modules": fake.stat("live_modules")} == live
