"""Task kinds: every kind is named once here, and everything else reads this registry.

A kind is what a task does to its regions. Its facets are attached by decorators in the file of
the op that owns it (STYLE rule 1): ``cpu`` (torch on CPU tensors: the reference tile body the CPU
runtimes execute), ``flops`` (the cost hint the scheduler and simulator use) and ``triton`` (the
megakernel's tile body: the megakernel's dispatch is generated from the kinds that have one,
runtime/megakernel/dispatch.py). Attaching a facet twice is a RegistrationError. Custom ops add kinds
with :func:`define_kind`; the builtin names below are the closed set mgraph ships.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from .errors import RegistrationError, UnknownNameError

if TYPE_CHECKING:
    import torch

    from .graph import Task

__all__ = ["Role", "TaskKind", "KindSpec", "KINDS", "define_kind", "kind_spec"]


class Role(str, Enum):
    """Which worker type runs a task: tile math, NVLink peer traffic, or RDMA via the proxy."""

    COMPUTE = "compute"
    NVLINK = "nvlink"
    RDMA = "rdma"

    def __str__(self) -> str:
        return self.value


ROLES: tuple[Role, ...] = (Role.COMPUTE, Role.NVLINK, Role.RDMA)
COMM = frozenset({Role.NVLINK, Role.RDMA})


class TaskKind(str, Enum):
    """The builtin task kinds (their meaning is the ``cpu`` body attached in mgraph/ops/)."""

    GEMM = "gemm"  # every write = reads[0] @ reads[1] (fp32 accumulate)
    REDUCE = "reduce"  # every write = sum(reads) (fp32 accumulate)
    COPY = "copy"  # every write = reads[0]
    ATTN_BLOCK = "attn_block"  # online-softmax update of (acc, m, l) with one KV block
    ATTN_FINALIZE = "attn_finalize"  # out = acc / l
    MOE_ROUTE = "moe_route"  # top-k routing + pack tokens into per-destination send slots
    MOE_EXPERT = "moe_expert"  # SwiGLU expert MLP over the rows routed to one expert
    MOE_COMBINE = "moe_combine"  # weighted sum of expert outputs back into token order

    def __str__(self) -> str:
        return self.value


CpuBody = Callable[["Task", Sequence["torch.Tensor"], Sequence["torch.Tensor"]], None]
FlopsFn = Callable[[Sequence[tuple[int, int]], Sequence[tuple[int, int]], dict], float]


@dataclass
class KindSpec:
    """One task kind and its facets."""

    name: str
    roles: frozenset[Role]
    doc: str
    cpu_body: CpuBody | None = None
    flops_fn: FlopsFn | None = None
    triton_body: Any = None
    extra: dict = field(default_factory=dict)
    # The task params a tile body reads on the GPU, in order (each task's ``params[name]``,
    # an int or a float): the megakernel packs them into the task's row of its params table.
    params: tuple[str, ...] = ()
    # The megakernel casts every buffer to the graph's dtype unless the body says otherwise: by
    # taking ``bufdt`` (the dtype code per slot), or with ``own_dtypes`` (its lowering and body
    # agree on each operand's dtype, e.g. MoE routing metadata is always float32).
    own_dtypes: bool = False
    # Values of declared params a task may leave out (e.g. gemm's ``accumulate``: 0).
    param_defaults: dict = field(default_factory=dict)

    def _attach(self, facet: str, fn: Any) -> Any:
        if getattr(self, facet) is not None:
            raise RegistrationError(
                f"task kind {self.name!r} already has a {facet.replace('_', ' ')}",
                hint="each facet is attached once, in the file of the op that owns the kind",
            )
        setattr(self, facet, fn)
        return fn

    def cpu(self, fn: CpuBody) -> CpuBody:
        """Decorator: the torch CPU tile body ``fn(task, reads, writes)``; it writes in place."""
        return self._attach("cpu_body", fn)

    def flops(self, fn: FlopsFn) -> FlopsFn:
        """Decorator: ``fn(read_shapes, write_shapes, params) -> flops`` cost hint."""
        return self._attach("flops_fn", fn)

    def triton(self, fn: Any) -> Any:
        """Decorator: the megakernel tile body (a @triton.jit function)."""
        return self._attach("triton_body", fn)

    def run_cpu(self, task: Task, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]):
        if self.cpu_body is None:
            raise RegistrationError(
                f"task kind {self.name!r} has no CPU body (task {task.name!r})",
                hint=f"attach one with @kind_spec({self.name!r}).cpu",
            )
        self.cpu_body(task, reads, writes)


KINDS: dict[str, KindSpec] = {}


def define_kind(
    name: str, roles: Sequence[Role | str], doc: str, *, params: Sequence[str] = (),
    own_dtypes: bool = False,
) -> KindSpec:
    """Register a new task kind; a name defined twice is a RegistrationError. ``params``: the
    task params its Triton body reads (abi.param_i32/param_f32 by position), in order.
    ``own_dtypes``: the body addresses each operand in the dtype its lowering gives it (without
    it, a body that touches a float32 buffer in a bf16 graph must take ``bufdt``)."""
    if name in KINDS:
        raise RegistrationError(
            f"task kind {name!r} is already defined", hint="pick another name for the new kind"
        )
    spec = KindSpec(name=name, roles=frozenset(Role(r) for r in roles), doc=doc,
                    params=tuple(params), own_dtypes=own_dtypes)
    KINDS[name] = spec
    return spec


def kind_spec(name: str | TaskKind) -> KindSpec:
    key = name.value if isinstance(name, TaskKind) else name
    try:
        return KINDS[key]
    except KeyError:
        raise UnknownNameError(
            f"unknown task kind {key!r}; known kinds: {', '.join(sorted(KINDS))}",
            hint="custom kinds are created with mgraph.kinds.define_kind",
        ) from None


_ALL = (Role.COMPUTE, Role.NVLINK, Role.RDMA)
GEMM_SPEC = define_kind(TaskKind.GEMM.value, [Role.COMPUTE], "C = A @ B with fp32 accumulation",
                        params=("accumulate",))
GEMM_SPEC.param_defaults = {"accumulate": 0}  # 1: the writes add into zeroed buffers
define_kind(TaskKind.REDUCE.value, _ALL, "dst = sum of the read regions, fp32 accumulation")
define_kind(TaskKind.COPY.value, _ALL, "every written region = the one read region")
define_kind(TaskKind.ATTN_BLOCK.value, [Role.COMPUTE], "online softmax update with one KV block")
define_kind(TaskKind.ATTN_FINALIZE.value, [Role.COMPUTE], "attention output = acc / l")
define_kind(TaskKind.MOE_ROUTE.value, [Role.COMPUTE], "top-k routing and packing of send slots",
            own_dtypes=True)
define_kind(TaskKind.MOE_EXPERT.value, [Role.COMPUTE], "SwiGLU expert over its routed rows",
            own_dtypes=True)
define_kind(TaskKind.MOE_COMBINE.value, [Role.COMPUTE], "weighted combine of expert outputs",
            own_dtypes=True)
