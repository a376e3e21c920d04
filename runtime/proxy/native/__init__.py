"""The native drain loop (C++ in this folder) behind the same interface as ``Proxy``.

The hot path of the host proxy is a std::thread that never takes the GIL (drain.h): it polls
the CommandFifo's ring, batches up to ``batch`` commands, merges neighbouring tiles bound for one
destination into one transfer, executes them through a native data path (host memmove, a TCP
frame, cudaMemcpy2DAsync + cuStreamWriteValue32 for cuda_ipc, or RDMA WRITE WITH IMMEDIATE
through a NIC a ``NativeVerbsTransport`` attached: verbs.h) and advances the tail. A
Python loop was measured at 3-33 k commands/s (GPU.md), far below the 200 k/s a 50 GB/s link
needs at 256 KiB chunks.

Python keeps the control plane: this wrapper builds the loop over the FIFO's tensors, asks the
transport to describe its memory to it (``Transport.attach_native``), watches for errors and
turns them into ProxyErrors that name the command, exactly like ``Proxy``.

Events raised for CPU memory are atomic adds on int64 counter arrays the runtime registers per
rank (``counters``), or on int32 flag words a transport registered instead (a Triton-interpreted
megakernel's flags: ``InProcessTransport.register_flags``), with an optional doorbell fd written
once per batch so the runtime's waiters wake without polling. A callback into Python per batch
was rejected: the loop would wait for the GIL, up to ``sys.getswitchinterval()`` (5 ms) behind
busy worker threads. A word that several commands of one batch raise is updated once, by the
total (mover.h says why, and which order is kept).

If the extension was not built, ``load()`` raises a ProxyError saying how to build it; the
Python ``Proxy`` stays available, but only when asked for (``Settings(proxy="python")``).
"""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from mgraph.errors import ProxyError

from ..command import Command, decode
from ..fifo import CommandFifo
from ..proxy import ProxyStats

if TYPE_CHECKING:
    from ..transport import Transport

__all__ = ["load", "available", "NativeProxy", "add_tensor", "dtype_name"]

_BUILD_HINT = (
    "build it with `pip install -e .` from the repository root (needs gcc and pybind11; no "
    "CUDA toolkit), or choose the Python proxy explicitly: Settings(proxy='python') or "
    "MGRAPH_PROXY=python"
)


def load() -> ModuleType:
    """The compiled module; ProxyError (with how to build it) when it is missing."""
    try:
        drain = importlib.import_module(f"{__name__}._drain")
    except ImportError as exc:
        raise ProxyError(
            f"the native proxy extension mgraph.runtime.proxy.native._drain is not built ({exc})",
            hint=_BUILD_HINT,
        ) from exc
    return drain


def available() -> bool:
    try:
        load()
    except ProxyError:
        return False
    return True


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def add_tensor(
    drain: object, rank: int, place: int, index: int, tensor: torch.Tensor, device: int = -1
) -> None:
    """Register ``tensor`` (2-D, rows contiguous) as ``rank``'s buffer ``index`` on ``drain``."""
    if tensor.dim() != 2 or (tensor.size(1) > 1 and tensor.stride(1) != 1):
        raise ProxyError(
            f"native proxy: rank {rank} buffer {index} is {tuple(tensor.shape)} with strides "
            f"{tensor.stride()}: rows must be contiguous",
            hint="register buffers as the runtime allocates them: 2-D, row-major",
        )
    rows, cols = tensor.shape
    item = tensor.element_size()
    row_bytes = max(tensor.stride(0), cols) * item
    drain.add_buffer(
        rank,
        place,
        index,
        tensor.data_ptr(),
        rows,
        cols,
        row_bytes,
        item,
        dtype_name(tensor.dtype),
        device,
    )


class NativeProxy:
    """Drains ``fifo`` through ``transport`` on a native thread; the ``Proxy`` interface.

    ``rank`` is the rank whose FIFO this is. ``counters`` maps each local rank to the int64
    array its events live in (see the module docstring); ``doorbell_fd`` is written after every
    batch that raised such an event. ``on_error`` is called (from a watcher thread) with the
    ProxyError as soon as the loop fails, so a runtime can abort its waits at once.
    ``bandwidth`` (bytes/s, 0: none) paces writes like a NIC of that speed. ``flag_copy``: GPU
    flag words are written by a copy-engine copy from pinned memory instead of a stream memory
    operation (mover.h says why; benchmarks/NOTES.md has the measurement).
    ``idle_sleep_us`` is the longest sleep between polls of an empty ring; 0 never sleeps (the
    loop spins, then yields its core to any runnable thread): for a GPU's proxy, which must see
    a command within microseconds, at the cost of keeping one core busy.
    ``streams``: copy streams for GPU memory (``Settings.proxy_streams``); a command runs on
    stream ``lane mod streams`` and a flag word keeps one stream (mover.h, "Several streams"),
    with data copies and flags batched per stream and batch; 1 keeps the single-stream path.
    ``allow_batch``: use cudaMemcpyBatchAsync where the CUDA runtime has it, for the data copies
    of several streams and for several flag copies due together (``batch_api`` says whether it
    will). ``fuse_flags``: the GPU flag words due at one point (one command's, or one
    coalesced group's) go out in ONE CUDA call: a WRITE with a destination and a done word is
    2 calls (data, flags), a SIGNAL 1 (mover.h, "CUDA calls per command"). Off by default: one
    call per word (3 for that WRITE), the protocol that measured faster on one H200 (NOTES v14:
    loopback push->flag 13.7 against 17.7 us with copy-engine flags, equal with memop flags). ``driver_copy``:
    1-D data copies through the driver's cuMemcpyAsync instead of the runtime's
    cudaMemcpyAsync (``cuda_apis`` says whether the driver has it; else the runtime's).
    ``gpu_fence``: fused cuStreamWriteValue32 flags take ONE GPU-scope memory barrier per call
    instead of a system-wide one per store, where the transport found every buffer and flag
    word on the proxy's own GPU (``cuda_apis["gpu_fence"]`` says whether it is in force). On
    the H200 of NOTES v14 the driver refused every such call ("invalid argument"): the proxy
    stops with a ProxyError naming the command; not usable there.
    ``copy_kernel_bytes`` (> 0, one stream only): a WRITE of at most that many bytes whose flag
    words are GPU words goes out as ONE launch of a one-CTA copy-and-flag kernel that copies the
    data and then raises the words with a release store, instead of a copy followed by a flag
    operation (copy_kernel.h says why it is ordered, and what it costs: an SM per WRITE for a
    few microseconds, so never under a kernel that holds every SM). ``start`` returns once the
    kernel is loaded. Off by default (NOTES v20, one H200: 12.7-13.4 us loopback at 4 KiB
    against the default's 14.1-14.8, slower at 64 KiB; a megakernel schedule that leaves it no
    free SM is refused, runtime/megakernel/shared_gpu.py).
    """

    def __init__(
        self,
        fifo: CommandFifo,
        transport: Transport,
        batch: int = 8,
        *,
        rank: int,
        counters: Mapping[int, torch.Tensor] | None = None,
        name: str = "proxy",
        timeout: float = 10.0,
        coalesce: bool = True,
        on_error: Callable[[ProxyError], None] | None = None,
        doorbell_fd: int = -1,
        bandwidth: float = 0.0,
        idle_sleep_us: int = 200,
        flag_copy: bool = False,
        streams: int = 1,
        allow_batch: bool = True,
        fuse_flags: bool = False,
        driver_copy: bool = False,
        gpu_fence: bool = False,
        copy_kernel_bytes: int = 0,
    ) -> None:
        if not isinstance(batch, int) or batch < 1:
            raise ProxyError(f"proxy {name}: batch must be a positive int, got {batch!r}")
        if not isinstance(idle_sleep_us, int) or idle_sleep_us < 0:
            raise ProxyError(
                f"proxy {name}: idle_sleep_us must be an int >= 0, got {idle_sleep_us!r}",
                hint="0 never sleeps (a GPU's proxy); 200 suits a CPU runtime",
            )
        if not isinstance(streams, int) or isinstance(streams, bool) or not 1 <= streams <= 64:
            raise ProxyError(
                f"proxy {name}: streams must be an int in [1, 64], got {streams!r}",
                hint="Settings.proxy_streams / MGRAPH_PROXY_STREAMS (1..8 for the megakernel)",
            )
        if not isinstance(copy_kernel_bytes, int) or copy_kernel_bytes < 0:
            raise ProxyError(
                f"proxy {name}: copy_kernel_bytes must be an int >= 0, got {copy_kernel_bytes!r}"
            )
        if copy_kernel_bytes and streams != 1:
            raise ProxyError(
                f"proxy {name}: copy_kernel_bytes={copy_kernel_bytes} needs one copy stream, "
                f"got streams={streams}",
                hint="set streams=1 (Settings.proxy_streams) or copy_kernel_bytes=0",
            )
        native = load()
        for r, t in (counters or {}).items():
            if t.dtype != torch.int64 or t.dim() != 1 or not t.is_contiguous():
                raise ProxyError(f"proxy {name}: counters of rank {r} must be a 1-D int64 tensor")
        self.fifo = fifo
        self.transport = transport
        self.batch = batch
        self.rank = rank
        self.name = name
        self.timeout = timeout
        self.on_error = on_error
        self._drain = native.Drain(
            fifo.ring.data_ptr(),
            fifo.head.data_ptr(),
            fifo.tail.data_ptr(),
            fifo.capacity,
            batch,
            coalesce,
            timeout,
        )
        self._drain.doorbell_fd = doorbell_fd
        self._drain.bytes_per_s = float(bandwidth)
        self._drain.idle_sleep_us = idle_sleep_us
        self._drain.flag_copy = bool(flag_copy)  # read when the loop starts (cuda flags only)
        self._drain.streams = streams  # likewise
        self._drain.allow_batch = bool(allow_batch)
        self._drain.fuse_flags = bool(fuse_flags)  # read when the loop starts
        self._drain.driver_copy = bool(driver_copy)
        self._drain.gpu_fence = bool(gpu_fence)
        self._drain.copy_kernel_bytes = copy_kernel_bytes  # read when the loop starts
        self.streams = streams
        # Keep what the loop points into alive as long as the loop.
        self._keep = (fifo, dict(counters or {}))
        transport.attach_native(self._drain, rank, dict(counters or {}))
        self._started = False
        self._stopped = False
        self._error: ProxyError | None = None
        self._watcher: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> NativeProxy:
        if self._started:
            raise ProxyError(f"proxy {self.name}: already started", hint="create one per run")
        self._started = True
        self._drain.start()
        if self.on_error is not None:
            self._watcher = threading.Thread(
                target=self._watch, name=f"mgraph-{self.name}-watch", daemon=True
            )
            self._watcher.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Execute every command still queued, stop the thread, raise the loop's error."""
        if self._stopped:
            self.check()
            return
        limit = self.timeout if timeout is None else timeout
        if not self._started:
            self._started = True
            self._drain.start()  # never started: drain what is queued now
        if not self._drain.stop(limit):
            self._drain.abort()
            raise ProxyError(
                f"proxy {self.name}: did not stop within {limit:.3g} s ({self.fifo!r}, "
                f"{self.stats.commands} commands done)",
                hint="a producer claimed a slot and never published it, or the transport hangs",
            )
        self._stopped = True
        for dst, (nbytes, writes) in self._drain.sent_to().items():
            self.transport.account(self.rank, dst, nbytes, writes=writes)
        self.check()

    def abort(self) -> None:
        """End the loop now, dropping what is queued (a failed run's cleanup)."""
        self._drain.abort()
        self._drain.wait(self.timeout)

    def check(self) -> None:
        """Raise the loop's error, if it had one."""
        if self._error is None:
            failure = self._drain.error()
            if failure is None:
                return
            self._error = self._wrap(*failure)
        raise self._error

    @property
    def running(self) -> bool:
        return bool(self._drain.running)

    @property
    def stats(self) -> ProxyStats:
        s = self._drain.stats()
        return ProxyStats(
            commands=s["commands"],
            batches=s["batches"],
            max_batch=s["max_batch"],
            writes=s["writes"],
            coalesced=s["coalesced"],
            signals=s["signals"],
            bytes=s["bytes"],
        )

    def loop_stats(self) -> dict[str, int]:
        """The loop's own counters: ``stats``' fields plus ``events`` (event raises the
        commands asked for on this process's ranks), ``raises`` (word updates made for them
        once repeats within a batch were merged; ``raises <= events``), ``streams``, and with
        several streams ``data_copies``/``flag_copies`` (copy operations queued; a staged run of
        neighbouring flag words is one; ``flag_copies`` also counts fused flags' copies or
        stores with one stream) and ``batch_calls`` (cudaMemcpyBatchAsync calls);
        ``busy_ns`` (host time from reading each batch to its end, summed), ``paced_ns`` (the
        part of it spent holding copies for the emulated NIC), ``cuda_calls`` and
        ``cuda_call_ns`` (the calls queueing copies or flag writes, and their host time), and
        ``flag_calls``/``flag_call_ns`` (of those, the ones raising GPU flags), and
        ``kernel_writes`` (WRITEs that went out as one copy-and-flag kernel launch)."""
        return dict(self._drain.stats())

    @property
    def batch_api(self) -> bool:
        """cudaMemcpyBatchAsync is used (known once the transport attached CUDA)."""
        return bool(self._drain.batch_api)

    @property
    def cuda_apis(self) -> dict[str, bool]:
        """Which optional CUDA entry points the loop uses or found (known once the transport
        attached CUDA): ``batch_copy`` (cudaMemcpyBatchAsync, used), ``batch_memop``
        (cuStreamBatchMemOp), ``driver_copy`` (cuMemcpyAsync), ``gpu_fence`` (GPU-scope
        barriers, in force: asked for, memory all local, a driver with the _v2 batch API),
        ``kernel`` (the driver can load and launch the copy-and-flag kernel)."""
        d = self._drain
        return {"batch_copy": bool(d.batch_api), "batch_memop": bool(d.batch_memop),
                "driver_copy": bool(d.driver_copy_api), "gpu_fence": bool(d.gpu_scope),
                "kernel": bool(d.kernel_api)}  # fmt: skip

    def __enter__(self) -> NativeProxy:
        return self.start()

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.stop()
        else:  # keep the caller's exception; still end the thread
            self.abort()

    # -- errors -----------------------------------------------------------------------------
    def _watch(self) -> None:
        # Polls from Python rather than blocking in Drain.wait(): a daemon thread parked in C++
        # with the GIL released is killed by pthread_exit when it wakes during interpreter
        # shutdown, and unwinding through C++ frames then aborts the process.
        while self._drain.running:
            if self._stopped:
                return
            time.sleep(0.02)
        try:
            self.check()
        except ProxyError as err:
            assert self.on_error is not None
            self.on_error(err)

    def _wrap(self, ticket: int, message: str) -> ProxyError:
        if ticket < 0:
            return ProxyError(f"proxy {self.name}: {message}")
        words = self.fifo.ring[ticket & self.fifo.mask].tolist()
        cmd: Command | str
        try:
            cmd = decode(words)[1]
        except ProxyError:  # a garbled slot: show what is there
            cmd = f"raw words {words}"
        err = ProxyError(f"proxy {self.name}: command #{ticket} ({cmd}) failed: {message}")
        err.ticket = ticket  # type: ignore[attr-defined]
        err.command = cmd  # type: ignore[attr-defined]
        return err

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"NativeProxy({self.name!r}, {state}, batch={self.batch}, {self.stats})"
