"""A fake libibverbs over host memory, so the native proxy's verbs backend runs on a CPU
(tests/test_verbs_native.py).

The proxy dlopens libibverbs at run time (runtime/proxy/native/verbs_api.cpp) and calls
ibv_post_send / ibv_post_recv / ibv_poll_cq through ``context->ops``, as verbs.h's inline
functions do. ``build(folder)`` compiles fake_verbs.c with gcc into ``libfakeibverbs.so``, which
exports the IBVERBS_1.x entry points the backend resolves and fills ``context->ops`` with its own
post and poll functions. Several "devices" (``fakeib0``, ``fakeib1``, ...) live in one process,
each opened context running a worker thread as its NIC: two proxies of one test process, one per
rank, talk over RC queue pairs as two hosts would. fake_verbs.c's header comment lists what it
checks (QP states and masks, PSNs, LIDs, keys and protection domains, receive consumption by
immediates, selective signaling and send-queue slots, CQ overrun, GPU memory registration).

Knobs (``FakeVerbs``): ``set_devices`` (0: "no RDMA device"), ``peermem`` / ``dmabuf`` (which GPU
registration paths work), ``gpu_range`` (declare a range device memory), ``set_delay_us`` (the
NIC lags), ``fail_next`` (the next request fails with a completion status), ``stat`` (counters:
``kStatNames`` in fake_verbs.c). One library instance per process: ``reset()`` between tests.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["FakeVerbs", "build", "RETRY_EXC_ERR"]

HERE = Path(__file__).resolve().parent
RETRY_EXC_ERR = 12  # ibv_wc_status: the peer never answered

_CFLAGS = "-std=c11 -O2 -g -fPIC -shared -pthread -fvisibility=hidden -Wall -Wextra -Werror"


@dataclass
class FakeVerbs:
    path: Path
    lib: ctypes.CDLL = field(init=False, repr=False)

    def __post_init__(self) -> None:
        lib = ctypes.CDLL(str(self.path))
        lib.fakeverbs_stat.restype = ctypes.c_int64
        lib.fakeverbs_stat.argtypes = [ctypes.c_char_p]
        lib.fakeverbs_gpu_range.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
        self.lib = lib

    def reset(self) -> None:
        self.lib.fakeverbs_reset()

    def set_devices(self, n: int) -> None:
        self.lib.fakeverbs_set_devices(n)

    def peermem(self, on: bool) -> None:
        self.lib.fakeverbs_peermem(int(on))

    def dmabuf(self, on: bool) -> None:
        self.lib.fakeverbs_dmabuf(int(on))

    def gpu_range(self, address: int, nbytes: int) -> None:
        if self.lib.fakeverbs_gpu_range(address, nbytes) != 0:
            raise RuntimeError("fake verbs: too many GPU ranges (reset() clears them)")

    def set_delay_us(self, us: int) -> None:
        self.lib.fakeverbs_set_delay_us(us)

    def fail_next(self, status: int) -> None:
        self.lib.fakeverbs_fail_next(status)

    def stat(self, name: str) -> int:
        value = self.lib.fakeverbs_stat(name.encode())
        if value == -(2**63):
            raise KeyError(f"fake verbs has no statistic {name!r}")
        return int(value)


_BUILT: FakeVerbs | None = None


def build(folder: Path) -> FakeVerbs:
    """Compile the fake library into ``folder`` (once per process; later calls return it)."""
    global _BUILT
    if _BUILT is not None:
        return _BUILT
    if shutil.which("gcc") is None:
        raise RuntimeError("fake verbs: gcc is not on PATH")
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "libfakeibverbs.so"
    cmd = ["gcc", *_CFLAGS.split(), "-o", str(out), str(HERE / "fake_verbs.c")]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building {out.name} failed:\n{' '.join(cmd)}\n{done.stderr}")
    _BUILT = FakeVerbs(out)
    return _BUILT
