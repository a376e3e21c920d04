"""The host side of GPU-initiated networking: command FIFO, drain proxy, transports.

A GPU (or, on the CPU, a runtime thread standing in for it) pushes fixed-size ``Command``s into a
``CommandFifo``; a ``Proxy`` thread drains the ring in batches and executes each command through
a ``Transport``, which copies the region into the peer's registered memory and raises the
peer's event. See DESIGN.md, "Host FIFO".
"""

from __future__ import annotations

from .command import COMMAND_BYTES, WORDS, Command, Opcode, Rect, Word, decode, encode
from .fifo import CommandFifo
from .proxy import Proxy, ProxyStats
from .transport import InProcessTransport, RaiseEvent, Transport

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
    "RaiseEvent",
    "Proxy",
    "ProxyStats",
]
