"""The host side of GPU-initiated networking: command FIFO, drain proxy, transports.

A GPU (or, on the CPU, a runtime thread standing in for it) pushes fixed-size ``Command``s into a
``CommandFifo``; a proxy drains the ring in batches and executes each command through a
``Transport``, which copies the region into the peer's registered memory and raises the peer's
event. ``NativeProxy`` is the C++ drain loop (native/), ``Proxy`` the Python one. Transports:
in-process, ``tcp`` (processes on any hosts), ``verbs`` (RDMA via pyverbs, loaded lazily) and
``cuda_ipc`` (GPUs of one host as nodes). See DESIGN.md, "Host FIFO".
"""

from __future__ import annotations

from .command import COMMAND_BYTES, WORDS, Command, Opcode, Rect, Word, decode, encode
from .cuda_ipc import CudaIpcTransport
from .fifo import CommandFifo
from .native import NativeProxy
from .proxy import Proxy, ProxyStats
from .tcp import TcpTransport
from .transport import InProcessTransport, RaiseEvent, Transport
from .verbs import VerbsTransport

__all__ = [
    "WORDS",
    "COMMAND_BYTES",
    "Word",
    "Opcode",
    "Rect",
    "Command",
    "encode",
    "decode",
    "CommandFifo",
    "Transport",
    "InProcessTransport",
    "TcpTransport",
    "VerbsTransport",
    "CudaIpcTransport",
    "RaiseEvent",
    "Proxy",
    "NativeProxy",
    "ProxyStats",
]
