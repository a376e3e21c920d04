"""mgraph: a megakernel task-graph runtime for multi-GPU, multi-node fused kernels."""

from __future__ import annotations

from . import hardware, kinds, ops
from .api import run
from .errors import *  # noqa: F403
from .errors import __all__ as _errors
from .graph import Buffer, Event, Region, Task, TaskGraph
from .hardware import H200, HardwareProfile
from .kinds import Role, TaskKind, define_kind
from .ops.custom import register_op
from .plans import (
    ColwiseParallel,
    ContextParallel,
    ExpertParallel,
    Replicate,
    RowwiseParallel,
    SequenceParallel,
    Shard,
)
from .program import Program, compile
from .scheduler import schedule
from .topology import Topology

__version__ = "0.1.0"

__all__ = [
    "run",
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
    "schedule",
    "compile",
    "Program",
    "register_op",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "ContextParallel",
    "ExpertParallel",
    "Shard",
    "Replicate",
    *_errors,
]
