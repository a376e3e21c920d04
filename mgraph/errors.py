"""Every user-facing exception of mgraph.

Each error says what is wrong, where (op, task, rank, event) and how to fix it. Internal
invariants use ``assert``; anything a user can cause raises one of these.
"""

from __future__ import annotations

__all__ = [
    "MgraphError",
    "TopologyError",
    "ShapeError",
    "DTypeError",
    "UnknownNameError",
    "RegistrationError",
    "GraphError",
    "CycleError",
    "UnsatisfiableWaitError",
    "RaceError",
    "TransferError",
    "InputError",
    "ScheduleError",
    "WatchdogTimeout",
    "ProxyError",
    "RdmaUnavailableError",
    "TraceError",
    "UnsupportedOpError",
    "PlanError",
    "OptionError",
    "SizeOptionError",
    "SizeLimitError",
    "SettingsError",
    "GraphFileError",
    "BackendUnavailableError",
    "OutputPathError",
    "OutputError",
    "MoECapacityWarning",
    "SlowPathWarning",
]


class MgraphError(Exception):
    """Base of every error mgraph raises on purpose."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint
        super().__init__(message if hint is None else f"{message}\n  hint: {hint}")


class TopologyError(MgraphError, ValueError):
    """A topology string or rank is invalid."""


class ShapeError(MgraphError, ValueError):
    """An op's sizes are invalid: non-positive, or not divisible by a tile or the world size."""


class DTypeError(MgraphError, TypeError):
    """A dtype is unsupported, or a tensor's dtype disagrees with the graph."""


class UnknownNameError(MgraphError, KeyError):
    """A name (op, kind, policy, backend) is not registered; the message lists the valid ones."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.args[0]


class RegistrationError(MgraphError, ValueError):
    """An op or task kind was registered twice, or is missing a required facet."""


class GraphError(MgraphError, ValueError):
    """A TaskGraph is malformed. Subclasses say which rule it breaks."""


class CycleError(GraphError):
    """Tasks wait on each other in a cycle."""


class UnsatisfiableWaitError(GraphError):
    """A task waits for more signals than its event can ever receive."""


class RaceError(GraphError):
    """Two tasks touch one region (write/write or read/write) with no order between them."""


class TransferError(GraphError):
    """A transfer's two ends disagree (shape, dtype, link class, rail peer, event placement)."""


class InputError(MgraphError, ValueError):
    """Inputs given to a run do not match the graph (missing, extra, shape, dtype)."""


class ScheduleError(MgraphError, ValueError):
    """A schedule is invalid for its graph or hardware."""


class WatchdogTimeout(MgraphError, TimeoutError):
    """A bounded wait expired: names rank, worker, task, event, current and target count."""


class ProxyError(MgraphError, RuntimeError):
    """The host proxy or one of its transports failed."""


class RdmaUnavailableError(ProxyError):
    """The verbs transport cannot run here: no RDMA device (or no pyverbs to reach one)."""


class TraceError(MgraphError, ValueError):
    """A module cannot be traced into an op graph (e.g. data-dependent control flow)."""


class UnsupportedOpError(TraceError):
    """A traced ATen op (or an argument of it) has no mgraph op; the hint says how to register one."""


class PlanError(MgraphError, ValueError):
    """A parallel plan names a module path that does not exist or a style that does not fit it."""


class OptionError(MgraphError, ValueError):
    """An op option (``--set key=value``, a builder keyword) has the wrong type or value; the
    message names the op, the option, the type it takes and the value given."""


class SizeOptionError(OptionError, ShapeError):
    """A size option (``tile``, ``chunk_bytes``, ``block``, ...) is not positive: an OptionError,
    and a ShapeError since it is a size."""


class SizeLimitError(MgraphError, ValueError):
    """A graph would exceed a size limit (tasks, bytes); the hint names the setting that raises
    it (``MGRAPH_MAX_TASKS``, ``MGRAPH_MAX_BYTES``)."""


class SettingsError(MgraphError, ValueError):
    """An environment variable (or Settings field) holds an invalid value; names the variable."""


class GraphFileError(GraphError):
    """A graph JSON file cannot be read: missing, a directory, not JSON, or a field that breaks
    the schema (the message gives the field's path)."""


class BackendUnavailableError(MgraphError, RuntimeError):
    """A backend cannot run on this machine (e.g. ``triton`` without CUDA)."""


class OutputPathError(MgraphError, ValueError):
    """A file the command would write (``--trace``, ``--json``) cannot be written there; raised
    before any work is done."""


class OutputError(MgraphError, RuntimeError):
    """A run's outputs cannot be assembled: replicas disagree, or the graph leaves part of an
    output unwritten (a lowering bug, named with the region)."""


class MoECapacityWarning(UserWarning):
    """A traced MoE block runs with a capacity bound (``capacity_factor`` < E / top_k): picks
    beyond an expert's segment are dropped, so the Program may differ from eager torch."""


class SlowPathWarning(UserWarning):
    """backend="triton" runs some tasks on a correct but much slower path: GEMMs whose operands'
    rows are not whole 16-byte units go by masked pointers instead of TMA (the path's first form
    measured 9-24x slower a task on an H200; benchmarks/NOTES.md v19). Padding the width to a
    multiple of 8 (bf16) avoids it."""
