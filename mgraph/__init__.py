"""mgraph: a megakernel task-graph runtime for multi-GPU, multi-node fused kernels."""

from __future__ import annotations

from . import hardware, kinds, ops
from .errors import *  # noqa: F403
from .errors import __all__ as _errors
from .graph import Buffer, Event, Region, Task, TaskGraph
from .hardware import H200, HardwareProfile
from .kinds import Role, TaskKind, define_kind
from .topology import Topology

__version__ = "0.1.0"

__all__ = [
    "Topology",
    "HardwareProfile",
    "H200",
    "hardware",
    "kinds",
    "ops",
    "Buffer",
    "Region",
    "Task",
    "Event",
    "TaskGraph",
    "Role",
    "TaskKind",
    "define_kind",
    *_errors,
]
