"""``mg.run``: execute a Schedule (or a TaskGraph, scheduled with defaults) on a backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .errors import BackendUnavailableError, UnknownNameError
from .graph import TaskGraph
from .hardware import HardwareProfile
from .settings import Settings

if TYPE_CHECKING:
    from .runtime.reference import RunResult
    from .scheduler import Schedule

__all__ = ["run", "BACKENDS", "backend_names"]


def _reference(schedule: Schedule, inputs: dict[str, torch.Tensor], settings: Settings, **kw: Any):
    from .runtime.memory import check_inputs
    from .runtime.reference import ReferenceRuntime

    if kw:
        raise UnknownNameError(f"backend 'reference' takes no options {sorted(kw)}")
    check_inputs(schedule.graph, inputs)  # before anything is allocated
    with ReferenceRuntime(schedule, settings) as runtime:
        return runtime.run(inputs)


_TRITON_RUNTIMES: dict[int, Any] = {}  # id(schedule) -> TritonRuntime: compile and allocate once


def _triton(schedule: Schedule, inputs: dict[str, torch.Tensor], settings: Settings, **kw: Any):
    """The persistent megakernel. 1-rank graphs take GLOBAL tensors; multi-rank graphs run SPMD
    under torchrun and take each rank's LOCAL shards."""
    if not kw.get("interpret"):
        _triton_available()
    from .runtime.megakernel import TritonRuntime

    rt = _TRITON_RUNTIMES.get(id(schedule))
    if rt is None or rt.schedule is not schedule:
        rt = TritonRuntime(schedule, settings=settings, **kw)
        _TRITON_RUNTIMES[id(schedule)] = rt
    return rt.run(inputs)


def _triton_available() -> None:
    """BackendUnavailableError unless torch sees a CUDA GPU (checked before any work)."""
    if not torch.cuda.is_available():
        raise BackendUnavailableError(
            "backend 'triton' needs a CUDA GPU, and torch sees none here "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'})",
            hint="use backend='reference' (the CPU runtime runs the same schedule) or "
            "backend='sim' (predicted time); on CPU the kernel runs under TRITON_INTERPRET=1 "
            "with mgraph.runtime.megakernel.run_in_process",
        )


def _sim(schedule: Schedule, inputs: dict[str, torch.Tensor] | None, settings: Settings, **kw: Any):
    from .runtime.sim import simulate

    return simulate(schedule, settings=settings, **kw)


BACKENDS: dict[str, Callable[..., RunResult]] = {
    "reference": _reference,
    "triton": _triton,
    "sim": _sim,
}
# Backends that model time rather than compute values: run() makes no random inputs for them.
INPUTLESS: set[str] = {"sim"}


def backend_names() -> list[str]:
    return sorted(BACKENDS)


def run(
    schedule: Schedule | TaskGraph,
    inputs: dict[str, torch.Tensor] | None = None,
    *,
    backend: str = "reference",
    settings: Settings | None = None,
    seed: int = 0,
    **options: Any,
) -> RunResult:
    """Run ``schedule`` on ``backend`` with GLOBAL ``inputs`` (random ones from ``seed`` if
    None) and return the gathered outputs and the trace. ``backend="sim"`` predicts the time on
    ``hardware=`` (a HardwareProfile; default the schedule's) and needs no inputs."""
    from .ops import get_op
    from .scheduler import schedule as make_schedule

    if backend not in BACKENDS:
        raise UnknownNameError(
            f"unknown backend {backend!r}; available: {', '.join(backend_names())}"
        )
    if isinstance(schedule, TaskGraph):
        hw = options.get("hardware")  # the sim's profile also schedules a bare graph
        schedule = make_schedule(schedule, hw) if isinstance(hw, HardwareProfile) else (
            make_schedule(schedule)
        )
    if inputs is None and backend not in INPUTLESS:
        inputs = get_op(schedule.graph.op).random_inputs(schedule.graph, seed=seed)
    return BACKENDS[backend](schedule, inputs, settings or Settings.from_env(), **options)
