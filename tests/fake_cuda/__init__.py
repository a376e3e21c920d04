"""A fake CUDA runtime and driver over host memory, so the native proxy's cuda data path runs on
a CPU (tests/test_native_cuda_path.py).

The proxy resolves CUDA at run time: ``Drain.use_cuda(device, runtime_libs, driver_libs)``
dlopens the paths it is given and dlsyms the entry points listed in
runtime/proxy/native/cuda_api.cpp. ``build(folder)`` compiles, with gcc, this folder's C into
three shared libraries that export exactly those symbols with CUDA 12's C ABI (int status, 0 =
success):

- ``libfakecudart.so`` (fake_cudart.c, and fake_controls.c for the test controls, statistics
  and trace; fake_controls.h is what the two share): the runtime, and every bit of state;
- ``libfakecuda.so`` (fake_cuda.c): the driver's cuGetErrorString, cuStreamWriteValue32(_v2),
  cuStreamBatchMemOp(_v2) and cuMemcpyAsync, queuing onto the runtime's streams (it links the
  runtime);
- ``libfakecuda_v1.so``: the same driver with only cuStreamWriteValue32 of those, as an older
  driver (the proxy falls back to one store call per flag word, and to cudaMemcpyAsync).

"Device memory" is host memory: a test registers host tensors as ``PLACE_CUDA`` and their
``data_ptr()`` is the device address. What the fake keeps from a GPU is what the proxy's
correctness rests on:

- a stream is a FIFO executed in order by its own worker thread, so the caller runs ahead;
  cudaMemcpyAsync / cudaMemcpy2DAsync read the source when they EXECUTE (a pinned staging word
  rewritten before its copy ran is read with the new value);
- cuStreamWriteValue32 queues a 4-byte release store; a 4-byte copy is a release store too, so a
  reader that sees a flag also sees the data copied before it; cuStreamBatchMemOp (fewer than
  256 WRITE_VALUE_32 operations, and with _v2 BARRIER ones, counted; a store without its own
  barrier is refused unless a barrier came before it in the call) queues ONE operation storing
  them in array order, each traced as its own STORE_32 row; cuMemcpyAsync queues a 1-D copy like
  cudaMemcpyAsync;
- cudaEventRecord queues a marker, cudaEventSynchronize waits until the stream executed it,
  cudaStreamSynchronize until the queue is empty, cudaEventQuery / cudaStreamQuery say whether
  that is so (600, cudaErrorNotReady, if not); an execution failure is sticky for the stream;
- cudaHostAlloc is page-aligned memory filled with 0xA5 (never a plausible count); a 1-D copy
  from it (a staged flag word, or a run of them) stores word by word with release stores and is
  traced one row per word;
- cudaMemcpyBatchAsync (CUDA 12.8's signature, attributes checked as documented) queues ONE
  operation whose copies execute in REVERSE order: CUDA orders a batch in its stream as a whole
  and promises nothing within it. cudaRuntimeGetVersion reports 12080 unless
  ``set_runtime_version`` says otherwise (the proxy uses the batch API from 12.8 on only);
- the copy-and-flag kernel (runtime/proxy/native/copy_kernel.h): cuModuleLoadData accepts PTX
  text, cuModuleGetFunction only ``mgraph_copy_flags``, and cuLaunchKernel (one CTA, its one
  160-byte parameter, aligned accesses) queues what the kernel does in its order, the copy
  (traced as a runtime copy) then its flag stores (as one cuStreamBatchMemOp operation); stats
  ``kernel_launches`` and ``live_modules``;
- ``FAKE_CUDA_DEVICES`` (default 2) devices, all peers; enabling a pair twice returns 704
  (cudaErrorPeerAccessAlreadyEnabled) and sets the last error, which cudaGetLastError clears.

Knobs: the environment variable ``FAKE_CUDA_DELAY_US`` (read when the runtime loads) makes every
operation wait that long before it executes, so the worker lags behind the caller. Through
``FakeCuda``: ``set_delay_us``, ``set_call_us`` (each copy-queueing call spins that long in
its caller, as a real one costs host time; a batch call costs it once), ``hold`` (no worker
executes anything until released), ``poison`` (operations touching a range fail when called, or
when executed), ``fail`` (a named
entry point returns a status), three deliberate bugs for negative controls (``events_never_wait``:
cudaEventSynchronize returns at once; ``unordered_stores``: cuStreamWriteValue32 stores when
called, ahead of the stream; ``kernel_flags_first``: the copy kernel stores its flags before
copying), ``start_trace``/``trace`` (every executed operation, in order) and
``stat`` (named counters: see ``kStatNames`` in fake_controls.c). A trace row's ``stream`` is the
stream's creation number (1, 2, ... over the process), so per-stream order can be checked.

All FakeCuda objects of a process share one library instance (the proxy dlopens the same path),
so its settings are global: configure between runs, and ``reset()`` before each test.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["FakeCuda", "build", "TRACE_FIELDS", "COPY", "COPY_2D", "STORE_32", "MARK"]

HERE = Path(__file__).resolve().parent
# Columns of a trace row, and its operation kinds (TraceRow in fake_controls.h, OpKind in
# fake_cudart.c).
TRACE_FIELDS = ("seq", "kind", "dst", "width", "height", "dpitch", "value", "stream")
COPY, COPY_2D, STORE_32, MARK = 1, 2, 3, 4
# cudaError_t / CUresult values the tests use.
INVALID_VALUE, OUT_OF_MEMORY, ILLEGAL_ADDRESS = 1, 2, 700


_CFLAGS = "-std=c11 -O2 -g -fPIC -shared -pthread -fvisibility=hidden -Wall -Wextra -Werror"
# -Bsymbolic: the runtime's own calls stay inside it even where a real libcudart is loaded.
_LDFLAGS = "-Wl,-Bsymbolic"


def _gcc(out: Path, sources: list[str], *extra: str) -> None:
    cmd = ["gcc", *_CFLAGS.split(), _LDFLAGS, "-o", str(out)]
    cmd += [str(HERE / s) for s in sources] + list(extra)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building {out.name} failed:\n{' '.join(cmd)}\n{done.stderr}")


@dataclass
class FakeCuda:
    """The built libraries and the runtime's test controls (loaded with ctypes)."""

    runtime: Path
    driver: Path
    driver_v1: Path
    lib: ctypes.CDLL = field(init=False, repr=False)

    def __post_init__(self) -> None:
        lib = ctypes.CDLL(str(self.runtime))
        lib.fakecuda_stat.restype = ctypes.c_int64
        lib.fakecuda_stat.argtypes = [ctypes.c_char_p]
        lib.fakecuda_poison.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
        ]
        lib.fakecuda_fail.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.fakecuda_trace.argtypes = [ctypes.c_int64]
        lib.fakecuda_trace_len.restype = ctypes.c_int64
        lib.fakecuda_trace_read.restype = ctypes.c_int64
        lib.fakecuda_trace_read.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        self.lib = lib

    def reset(self) -> None:
        """Clear every knob, the trace and the counters (not the live-object counts)."""
        self.lib.fakecuda_reset()

    def set_delay_us(self, us: int) -> None:
        self.lib.fakecuda_set_delay_us(us)

    def set_call_us(self, us: int) -> None:
        """Host time each cudaMemcpyAsync / cudaMemcpy2DAsync / cudaMemcpyBatchAsync call
        spins in its caller before queuing (reset: 0)."""
        self.lib.fakecuda_set_call_us(us)

    def hold(self, on: bool) -> None:
        self.lib.fakecuda_hold(int(on))

    def set_runtime_version(self, version: int) -> None:
        """What cudaRuntimeGetVersion reports (reset: 12080, the first with the batch API)."""
        self.lib.fakecuda_set_runtime_version(version)

    def events_never_wait(self, on: bool) -> None:
        self.lib.fakecuda_events_never_wait(int(on))

    def unordered_stores(self, on: bool) -> None:
        self.lib.fakecuda_unordered_stores(int(on))

    def kernel_flags_first(self, on: bool) -> None:
        self.lib.fakecuda_kernel_flags_first(int(on))

    def poison(self, address: int, nbytes: int, status: int, *, at_execution: bool) -> None:
        if self.lib.fakecuda_poison(address, nbytes, status, int(at_execution)) != 0:
            raise RuntimeError("fake cuda: too many poisoned ranges (reset() clears them)")

    def fail(self, call: str, status: int) -> None:
        self.lib.fakecuda_fail(call.encode(), status)

    def stat(self, name: str) -> int:
        value = self.lib.fakecuda_stat(name.encode())
        if value == -(2**63):
            raise KeyError(f"fake cuda has no statistic {name!r}")
        return int(value)

    def start_trace(self, capacity: int) -> None:
        if self.lib.fakecuda_trace(capacity) != 0:
            raise MemoryError(f"fake cuda: no room for a trace of {capacity} rows")

    def trace(self) -> torch.Tensor:
        """Rows (n, 8) int64 of the executed operations, in execution order (TRACE_FIELDS)."""
        n = self.lib.fakecuda_trace_len()
        rows = torch.zeros((n, len(TRACE_FIELDS)), dtype=torch.int64)
        got = self.lib.fakecuda_trace_read(rows.data_ptr(), n)
        return rows[:got]


_BUILT: FakeCuda | None = None


def build(folder: Path) -> FakeCuda:
    """Compile the fake libraries into ``folder``; RuntimeError with gcc's output on failure.
    Once per process: a second build elsewhere would be a second runtime the first driver does
    not see (the driver finds its runtime by soname, and the first one loaded wins), so later
    calls return the first build."""
    global _BUILT
    if _BUILT is not None:
        return _BUILT
    if shutil.which("gcc") is None:
        raise RuntimeError("fake cuda: gcc is not on PATH")
    folder.mkdir(parents=True, exist_ok=True)
    runtime = folder / "libfakecudart.so"
    _gcc(runtime, ["fake_cudart.c", "fake_controls.c"], "-Wl,-soname,libfakecudart.so")
    # The driver finds the runtime next to itself ($ORIGIN) and, once the runtime is loaded,
    # by its soname: one instance, so the driver's stores share the runtime's streams.
    link = ["-L", str(folder), "-lfakecudart", "-Wl,-rpath,$ORIGIN"]
    _gcc(folder / "libfakecuda.so", ["fake_cuda.c"], *link)
    _gcc(folder / "libfakecuda_v1.so", ["fake_cuda.c"], "-DFAKE_CUDA_V1_ONLY", *link)
    _BUILT = FakeCuda(runtime, folder / "libfakecuda.so", folder / "libfakecuda_v1.so")
    return _BUILT
