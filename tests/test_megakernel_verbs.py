"""``MGRAPH_TRANSPORT=verbs`` selects the native proxy's verbs backend for the megakernel's
network (runtime/megakernel/net.py).

End to end on the CPU: tests/megakernel_verbs_interp.py, under TRITON_INTERPRET=1 in a
subprocess whose LD_LIBRARY_PATH holds the fake libibverbs (tests/fake_verbs) as
``libibverbs.so.1``, runs a 2x1 GEMM+AllReduce twice on one runtime; the ranks' proxies move
every byte and raise every remote word through the fake NIC (RDMA WRITE WITH IMMEDIATE), and
the result matches torch. A work request the NIC fails stops the launch with the proxy's error.
A missing library, a missing device and settings the backend cannot serve are named errors
raised while the runtime is built, before any launch.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import fake_verbs
import pytest
import torch

import mgraph as mg
from mgraph.errors import ProxyError, RdmaUnavailableError
from mgraph.runtime.megakernel.net import _transport_kind, check_writable
from mgraph.runtime.megakernel.netplan import net_plan
from mgraph.runtime.proxy import Opcode
from mgraph.runtime.proxy.native import available
from mgraph.settings import Settings

HERE = Path(__file__).resolve().parent

if shutil.which("gcc") is None:
    pytest.skip("needs gcc to build the fake libibverbs", allow_module_level=True)
if not available():
    pytest.skip("the native proxy extension is not built", allow_module_level=True)


def small_graph():
    op = mg.ops.get_op("gemm_allreduce")
    return op(topology="2x1", M=64, N=64, K=64, tile=[32, 32], chunk_bytes=2048)


def test_megakernel_over_fake_verbs(tmp_path: Path) -> None:
    fake = fake_verbs.build(tmp_path / "build")
    libdir = tmp_path / "lib"
    libdir.mkdir()
    (libdir / "libibverbs.so.1").symlink_to(fake.path)  # found by its usual name
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path, LD_LIBRARY_PATH=str(libdir))
    for var in ("MGRAPH_TRANSPORT", "MGRAPH_PROXY_STREAMS"):  # the script passes Settings
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, str(HERE / "megakernel_verbs_interp.py"), str(libdir / "libibverbs.so.1")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["case"]: r for r in map(json.loads, proc.stdout.splitlines()) if "case" in r}
    run = rows["verbs-2x1"]
    assert max(run["errors"]) < 1e-5, run
    assert run["epochs"] == 2 and run["exact"], run
    assert run["transports"] == ["NativeVerbsTransport"] and run["proxy_ranks"] == [0, 1], run
    assert run["memory"] == ["host"], run
    # every pushed command went through the splitter to its rank's proxy, once
    assert run["split"] == run["commands"] == 2 * run["per_launch_commands"] > 0, run
    # every remote event rode on one immediate, counted by the NIC that sent it, the fake and
    # the NIC that received it; every byte crossed the fake NIC (no memmove between ranks)
    remote = 2 * run["per_launch_remote_events"]
    assert run["imms"] == run["fake_imms"] == run["recv_completions"] == remote > 0, run
    assert run["fake_bytes"] == 2 * run["per_launch_write_bytes"] > 0, run
    assert run["fake_errors"] == 0, run
    failed = rows["failed-write"]  # the proxy's error, not the kernel's watchdog
    assert failed["raised"] == "ProxyError", failed
    assert "a write to rank 0 failed: IBV_WC_RETRY_EXC_ERR" in failed["message"], failed
    assert rows["no-device"]["raised"] == "RdmaUnavailableError", rows["no-device"]
    assert "no RDMA device" in rows["no-device"]["message"], rows["no-device"]


def test_missing_libibverbs_is_named_before_launch() -> None:
    """Without libibverbs the runtime is not built (so never launched): RdmaUnavailableError."""
    if ctypes.util.find_library("ibverbs") is not None:
        pytest.skip("this host has a libibverbs: the library is not missing here")
    from mgraph.runtime.megakernel import TritonRuntime
    from mgraph.runtime.megakernel.runtime import _SharedMemory

    graph = small_graph()
    with pytest.raises(RdmaUnavailableError, match="cannot load libibverbs"):
        TritonRuntime(
            mg.schedule(graph),
            rank=None,
            interpret=True,
            shared=_SharedMemory(graph, torch.device("cpu")),
            settings=Settings(transport="verbs"),
        )


def test_transport_selection() -> None:
    assert _transport_kind("auto", gpu=True, streams=4) == "auto"
    assert _transport_kind("inprocess", gpu=False, streams=1) == "auto"
    assert _transport_kind("verbs", gpu=True, streams=1) == "verbs"
    with pytest.raises(ProxyError, match="proxy_streams=2"):
        _transport_kind("verbs", gpu=False, streams=2)
    with pytest.raises(ProxyError, match="no 'tcp' transport"):
        _transport_kind("tcp", gpu=True, streams=1)
    with pytest.raises(ProxyError, match="no 'inprocess' transport on the GPU"):
        _transport_kind("inprocess", gpu=True, streams=1)


def test_unwritable_destination_is_refused() -> None:
    """A buffer peers WRITE into that the NIC could only stage is refused before the launch."""
    graph = small_graph()
    plan = net_plan(graph)
    into = {
        c.dst.buffer
        for cmds in plan.commands.values()
        for c in cmds
        if c.opcode == Opcode.WRITE and c.dst_rank == 1
    }
    assert into
    ok = SimpleNamespace(memory_kinds={i: "dmabuf" for i in range(64)})
    check_writable(graph, plan, 1, ok)
    staged = SimpleNamespace(
        memory_kinds={i: "staged" if i in into else "dmabuf" for i in range(64)}
    )
    with pytest.raises(ProxyError, match="rank 1's NIC could not register buffer"):
        check_writable(graph, plan, 1, staged)
    # staging a buffer nobody writes into (a send-only source) is fine
    only_sources = SimpleNamespace(
        memory_kinds={i: "dmabuf" if i in into else "staged" for i in range(64)}
    )
    check_writable(graph, plan, 1, only_sources)
