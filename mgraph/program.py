"""``mg.compile``: nn.Module + example inputs + plan -> Program (trace, fuse, lower, validate,
schedule).

A Program runs on the backend it was compiled for:

- ``reference`` (and any backend in ``mgraph.api.BACKENDS``): single-controller on the CPU.
  ``prog(*inputs)`` takes the module's GLOBAL inputs and returns its global outputs.
- ``triton`` on ONE rank (topology ``1x1``): the megakernel on the current CUDA device, GLOBAL
  inputs and outputs as above. ``backend_options={"interpret": True}`` runs the same kernel in
  Triton's interpreter on the CPU (TRITON_INTERPRET=1 set before triton is imported); a
  multi-rank program then runs every rank in this one process, still with global tensors.
- ``triton`` on several ranks: SPMD under torchrun, one process per GPU, torch.distributed
  initialised and the rank's device current. Every rank calls ``prog(*inputs)`` with the same
  module (full weights; the Program cuts each rank's shards of them). The convention is eager
  tensor parallelism's (``parallelize_module`` with ``use_local_output=True``):

  * each input is passed either whole (a replicated input, as ``ColwiseParallel`` reads it) or
    as the rank's chunk along one dim, ``x.chunk(world, dim)[rank]`` (a ``Shard(dim)`` input,
    as ``SequenceParallel`` reads it); which one is told by its shape. A chunk is gathered
    from the other ranks only when the graph binds more of the input on this rank than the
    chunk holds;
  * each output comes back as eager TP returns it: whole on every rank where the traced output
    is replicated (a ``RowwiseParallel`` result), the rank's chunk along the sharded dim where
    it is sharded, and for token-sharded outputs (a sequence-parallel residual stream) the
    rank's chunk along the sequence dim (dim -2: ``Shard(1)`` of a ``[B, S, H]`` output). Where
    the graph holds an output in another split (token rows of a batch larger than 1), the ranks
    gather it first. An output in ring attention's zigzag layout has no eager TP counterpart: it
    comes back whole.

The parameters are read from the module at every call (so updated weights are used), laid out
as the ops read them: each module tensor by its name, following the submodules on its path and
the owner's parameters and buffers, so a new Parameter, buffer tensor or submodule is what the
call reads (the whole module is walked only at the first call and when a name stops leading to
a tensor). On ``triton`` with one runtime per process (one rank, or SPMD under
torchrun; the interpreter's multi-rank runs build every rank's runtime afresh at each call), a
parameter is copied into the megakernel's buffers at the first call and again only when its
module tensor changed since: another tensor object or storage (a new ``nn.Parameter``,
``w.data = t``), another shape or layout, or an in-place write that torch counts in
``w._version`` (``with torch.no_grad(): w.copy_(t)``, ``w.mul_(2)``). Writes that torch does
not count, through ``w.data`` (``w.data.copy_(t)``) or by code outside torch into its memory,
are not seen: call ``prog.reload_parameters()`` after them. Tensors created under
``torch.inference_mode`` have no version counter; they are copied at every call. The module's
inputs are copied at every call, and an output that one buffer holds whole comes back as one
copy of it. That runtime NaN-fills its scratch and output buffers before its first launch only
(``backend_options={"poison": True}``: before every launch, with no CUDA graph replay), so a
task that reads an element no task wrote shows as NaN in the first call's result.

On ``triton`` on GPUs, one rank or SPMD, ``prog(*inputs)`` does not wait for the kernel: it
returns once the launch and the output's copy (SPMD: and the gather of an output held in
another layout, stream-ordered under NCCL) are queued on the current stream, as an eager torch
module does, so the host issues the next call while this one runs. A watchdog timeout
is raised at a later call or at ``prog.synchronize()``, and the outputs of a call that timed
out (and of calls made before the host heard of it) are NaN, never stale values
(runtime/megakernel/inflight.py). ``backend_options={"wait": True}`` (or ``prog.run``, which
waits unless given ``wait=False``) waits for each call and raises its timeout at once. The
interpreter, traced runtimes, outputs of integer dtype and, in one process, outputs with no
buffer holding all of them always wait.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .api import BACKENDS, backend_names, run
from .errors import DTypeError, InputError, MgraphError, RegistrationError, UnknownNameError
from .graph import TaskGraph, gc_paused, torch_dtype
from .hardware import H200, HardwareProfile
from .kinds import KINDS
from .layout import REPLICATE, Layout, binding_runs, flat_shape, layout_runs
from .lower import lower
from .plans import ParallelStyle
from .prune import prune
from .scheduler import Schedule, schedule
from .settings import Settings
from .topology import Topology
from .trace import OpGraph, trace
from .trace.attention_map import additive_mask, token_major_attention
from .trace.glu import fuse_glu
from .trace.opgraph import ParamSource, Value
from .trace.pointwise import fuse_pointwise
from .validate import validate as validate_graph

__all__ = ["compile", "Program", "check_triton_bodies"]


def compile(  # noqa: A001  (mg.compile mirrors torch.compile)
    module: nn.Module,
    example_inputs: Sequence[torch.Tensor] | torch.Tensor,
    *,
    plan: Mapping[str, ParallelStyle] | None = None,
    topology: Topology | str = "1x1",
    backend: str = "reference",
    hardware: HardwareProfile = H200,
    policy: str = "critical_path",
    workers: Mapping[str, int] | None = None,
    validate: bool = True,
    fuse: bool = True,
    glu: bool = False,
    backend_options: Mapping[str, Any] | None = None,
) -> Program:
    """Trace ``module`` under ``plan``, fuse chains of pointwise ops and fold head splits into
    the attention (``fuse``; with ``glu`` also gated units into one GEMM op, mgraph/trace/glu.py:
    off by default, measured slower), lower it to ONE
    TaskGraph on ``topology``, validate and schedule it; the Program runs it on ``backend``
    with ``backend_options`` (triton: ``interpret``, ``trace``, ``gemm_config``,
    ``cuda_graph``: mgraph.runtime.megakernel.TritonRuntime's keywords; ``poison``: NaN-fill
    the kernel's scratch and output buffers before every launch, not only the first; ``wait``:
    each call waits for its kernel, see the module docstring). On
    ``backend="triton"`` a kind with no Triton body is a RegistrationError here, before
    anything launches."""
    check_backend(backend)
    opgraph = trace(module, example_inputs, plan, topology)
    # pointwise chains first (they may take in q's and k's head splits), then the attention
    # reads what head splits and merges are left in the projections' layout
    lowered = token_major_attention(fuse_pointwise(opgraph)) if fuse else opgraph
    if fuse and glu:
        # Gated units (silu(gate) * up of two linears) as one GEMM op whose epilogue applies the
        # unit. Off by default: it measured slower than the two GEMMs and the pointwise pass it
        # replaces (benchmarks/NOTES.md v15: 3.79 against 3.54 ms, the layer on one H200).
        lowered = fuse_glu(lowered)
    with gc_paused():  # the graph is 10^6 small long-lived objects: mgraph.graph.gc_paused
        # what the layouts make but no output uses goes (mgraph/prune.py: at 2x8 the KV heads
        # a rank's attention does not read)
        graph = prune(lower(lowered))
        # validation's counter order is the one scheduling starts from: computed once
        order = validate_graph(graph) if validate else None
        if backend == "triton":
            check_triton_bodies(graph, lowered)
        sched = schedule(graph, hardware, policy, workers, order=order)
    return Program(
        module, opgraph, sched, backend, lowered=lowered, backend_options=backend_options
    )


def check_backend(backend: str) -> None:
    if backend in BACKENDS:
        return
    raise UnknownNameError(f"unknown backend {backend!r}; available: {', '.join(backend_names())}")


def check_triton_bodies(graph: TaskGraph, opgraph: OpGraph) -> None:
    """RegistrationError naming the first kind in ``graph`` with no megakernel tile body, the
    traced op that produced its tasks and how to register one (the megakernel's checks of tile
    shapes and alignment follow when its runtime is built, still before any launch)."""
    from .ops.custom import CUSTOM

    missing: dict[str, list[str]] = {}
    for t in graph.tasks:
        spec = KINDS.get(t.kind)
        if t.role != "rdma" and (spec is None or spec.triton_body is None):
            missing.setdefault(t.kind, []).append(t.name)
    if missing:
        kind, names = next(iter(missing.items()))
        nodes = {n.name: n for n in opgraph.nodes}
        node = nodes.get(names[0].split(":")[0])
        where = node.where() if node is not None else f"task {names[0]!r}"
        if kind in CUSTOM:
            how = (
                f"pass the body when registering the op: @mg.register_op({kind!r}, "
                "triton=body), a @triton.jit function whose parameter names pick kernel "
                "values (mgraph/ops/custom.py documents them)"
            )
        else:
            how = (
                f"attach one in the op's file with mgraph.kinds.kind_spec({kind!r}).triton "
                "(runtime/megakernel/dispatch.py: ABI_NAMES), or compile with "
                "backend='reference'"
            )
        others = f" (also without one: {sorted(missing)[1:]})" if len(missing) > 1 else ""
        raise RegistrationError(
            f"backend='triton': task kind {kind!r} has no Triton tile body; {where} made "
            f"{len(names)} task(s) of it{others}",
            hint=how,
        )


class Program:
    """A compiled module: ``prog(*inputs)`` runs it; ``opgraph`` (as traced, one node per op),
    ``lowered`` (pointwise chains fused: what was lowered), ``graph`` and ``schedule`` are the
    objects each stage produced."""

    def __init__(
        self,
        module: nn.Module,
        opgraph: OpGraph,
        sched: Schedule,
        backend: str,
        *,
        lowered: OpGraph | None = None,
        backend_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.module = module
        self.opgraph = opgraph
        self.lowered = lowered if lowered is not None else opgraph
        self.schedule = sched
        self.backend = backend
        self.backend_options = dict(backend_options or {})
        self.last_result: Any = None
        self._runtime: Any = None  # the TritonRuntime of this process's rank (built once)
        self._chunk_ok: dict[tuple[str, int, int], bool] = {}
        # parameter name -> its module tensors as the runtime's buffers hold them (triton)
        self._loaded: dict[str, tuple[_Seen | None, ...]] = {}
        # Worked out at the first call, kept for the Program's life (they read only the graph):
        # each module input's checks, each parameter's recipe, and where its module tensors
        # live (_Sources: followed again at every call, so replaced tensors are seen).
        self._input_specs: list[_InputSpec] | None = None
        self._param_specs: list[_ParamSpec] | None = None
        self._sources: _Sources | None = None
        self._gpu_seen = False  # torch saw a CUDA GPU at an earlier call
        self._runs: dict[tuple[str, int], tuple] = {}  # _output_runs by (output, rank)
        # (output, rank) -> whether the rank's buffer holds what eager TP returns (_spmd_output)
        self._output_as_wanted: dict[tuple[str, int], bool] = {}

    @property
    def graph(self) -> TaskGraph:
        return self.schedule.graph

    @property
    def topology(self) -> Topology:
        return self.opgraph.topology

    # -- inputs -------------------------------------------------------------------------------
    def _arg(self, value: Value, arg: Any, shapes: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """``arg`` checked against ``value`` (one of ``shapes``, the compute dtype), a boolean
        mask turned into its additive form."""
        og = self.opgraph
        if not isinstance(arg, torch.Tensor) or tuple(arg.shape) not in shapes:
            got = tuple(arg.shape) if isinstance(arg, torch.Tensor) else type(arg).__name__
            raise InputError(
                f"{og.name}: input {value.name!r} is {got}, the program was compiled for "
                f"{list(value.shape)}"
                + (
                    f" (or a rank's chunk: {[list(s) for s in shapes[1:]]})"
                    if len(shapes) > 1
                    else ""
                ),
                hint="compile again with example inputs of this shape",
            )
        dtype = torch_dtype(og.dtype)
        if value.encoding == "bool_mask":
            if arg.dtype != torch.bool:
                raise DTypeError(
                    f"{og.name}: input {value.name!r} is {arg.dtype}, compiled as a boolean "
                    "attention mask",
                    hint="pass a torch.bool mask (True = attend), as at compile time",
                )
            return additive_mask(arg, dtype)
        if arg.dtype != dtype:
            raise DTypeError(
                f"{og.name}: input {value.name!r} is {arg.dtype}, compiled for {og.dtype}",
                hint=f"cast it with .to(torch.{og.dtype})",
            )
        return arg

    def _check_count(self, args: Sequence[Any]) -> None:
        og = self.opgraph
        if len(args) != len(og.inputs):
            raise InputError(
                f"{og.name} was compiled for {len(og.inputs)} input(s), got {len(args)}",
                hint="pass the same positional inputs as the example inputs",
            )

    def _params(
        self,
        out: dict[str, torch.Tensor],
        loaded: Mapping[str, tuple[_Seen | None, ...]] | None = None,
        held: Collection[str] | None = None,
    ) -> dict[str, tuple[_Seen | None, ...]]:
        """The parameters the graph reads, built from the module now (global, flat 2-D) into
        ``out``; with ``loaded`` (what the runtime's buffers hold, by parameter name; only the
        names in ``held`` when given) only the parameters whose module tensors changed since.
        Returns what every wanted parameter is built from now."""
        specs = self._param_specs
        if specs is None:
            specs = self._param_specs = self._build_param_specs()
        tensors = self._source_tensors()
        dtype = torch_dtype(self.opgraph.dtype)
        now: dict[str, tuple[_Seen | None, ...]] = {}
        for spec in specs:
            parts = [tensors[i] for i in spec.sources]
            if loaded is not None:
                before = loaded.get(spec.name) if held is None or spec.name in held else None
                if before is not None and _unchanged(before, parts):
                    now[spec.name] = before
                    continue
                now[spec.name] = tuple(_Seen.of(t) for t in parts)
            t = spec.source.build(dict(zip(spec.source.fqns, parts, strict=True))).to(dtype)
            out[spec.name] = t.reshape(spec.flat)
        return now

    def _build_param_specs(self) -> list[_ParamSpec]:
        wanted, fqns = self.graph.inputs, self._fqns()
        at = {f: i for i, f in enumerate(fqns)}
        specs = []
        for value in self.lowered.params:  # (what lowering read: fused ops may pack weights)
            if value.name in wanted:
                assert value.source is not None
                specs.append(
                    _ParamSpec(
                        value.name,
                        value.source,
                        tuple(at[f] for f in value.source.fqns),
                        flat_shape(value.shape),
                    )
                )
        return specs

    def _fqns(self) -> list[str]:
        """Every module tensor name the wanted parameters are built from, each once."""
        wanted = self.graph.inputs
        names = [
            f
            for value in self.lowered.params
            if value.name in wanted and value.source is not None
            for f in value.source.fqns
        ]
        return list(dict.fromkeys(names))

    def _source_tensors(self) -> list[torch.Tensor]:
        """The module tensors named by ``_fqns()`` as the module holds them now: by walking
        their names with the kept _Sources, else (the first call, or a name that no longer
        leads to a tensor of the table it was found in) from ``named_parameters`` and
        ``named_buffers`` (the OpGraph's constants over both), finding the walks again."""
        if self._sources is not None:
            got = self._sources.resolve()
            if got is not None:
                return got
        og = self.opgraph
        tensors = dict(self.module.named_parameters(remove_duplicate=False))
        tensors.update(self.module.named_buffers(remove_duplicate=False))
        tensors.update(og.constants)
        fqns = self._fqns()
        found = [tensors[f] for f in fqns]
        self._sources = _Sources.find(self.module, fqns, og.constants, found)
        return found

    def synchronize(self) -> None:
        """Wait for every call still running (backend "triton": calls do not wait, see the
        module docstring) and raise the first watchdog timeout among them; nothing to do on
        other backends or before the first call."""
        if self._runtime is not None:
            self._runtime.synchronize()

    def reload_parameters(self) -> None:
        """Copy every parameter into the kernel's buffers again at the next call (backend
        "triton"): for writes to a parameter that torch's version counter does not see, such
        as ``w.data.copy_(t)`` (the module docstring says which writes are seen)."""
        self._loaded = {}

    def inputs(self, *args: torch.Tensor) -> dict[str, torch.Tensor]:
        """The graph's global inputs for module inputs ``args``: the arguments and parameters,
        each flattened to the 2-D view its buffers use."""
        out = self._module_inputs(args)
        self._params(out)
        return out

    def _module_inputs(self, args: Sequence[Any]) -> dict[str, torch.Tensor]:
        self._check_count(args)
        specs = self._input_specs
        if specs is None:
            wanted, dtype = self.graph.inputs, torch_dtype(self.opgraph.dtype)
            specs = self._input_specs = [
                _InputSpec(v, v.name in wanted, flat_shape(v.shape), dtype)
                for v in self.opgraph.inputs
            ]
        out: dict[str, torch.Tensor] = {}
        for spec, arg in zip(specs, args, strict=True):
            value = spec.value
            # the common case checked inline; anything else (a mismatch: its named error, a
            # boolean mask: its additive form) through _arg
            if not (
                isinstance(arg, torch.Tensor)
                and value.encoding is None
                and arg.dtype == spec.dtype
                and arg.shape == value.shape
            ):
                arg = self._arg(value, arg, [value.shape])
            if spec.wanted:
                out[value.name] = arg.reshape(spec.flat)
        return out

    # -- running ------------------------------------------------------------------------------
    def run(self, *args: torch.Tensor, settings: Settings | None = None, **options: Any) -> Any:
        """Run once; the RunResult's outputs are the module's outputs by name (out, out0, ...),
        in their traced shapes (under SPMD: this rank's part, see the module docstring)."""
        opts = {**self.backend_options, **options}
        if self.backend == "triton":
            # settings=None: the runtime reads the environment when it is built, not per call
            result = self._run_triton(args, settings, opts)
        else:
            result = run(
                self.schedule, self.inputs(*args), backend=self.backend, settings=settings, **opts
            )
            for name, value in zip(self.opgraph.output_names, self.opgraph.outputs, strict=True):
                if name in result.outputs:  # timing-only backends (sim) compute no values
                    result.outputs[name] = result.outputs[name].reshape(value.shape)
        self.last_result = result
        return result

    def __call__(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        # a call does not wait for its kernel (the module docstring), unless the Program was
        # compiled with backend_options={"wait": True}
        wait = {} if self.backend != "triton" or "wait" in self.backend_options else {"wait": False}
        outputs = self.run(*args, **wait).outputs
        values = [outputs[name] for name in self.opgraph.output_names]
        return values[0] if self.opgraph.single_output else tuple(values)

    def _run_triton(
        self, args: Sequence[torch.Tensor], settings: Settings | None, opts: dict
    ) -> Any:
        from .api import _triton_available
        from .runtime.megakernel import TritonRuntime, run_in_process
        from .runtime.reference import RunResult

        poison = opts.pop("poison", None)
        wait = bool(opts.pop("wait", True))
        interpret = bool(opts.get("interpret"))
        if not interpret and not self._gpu_seen:
            _triton_available()
            self._gpu_seen = True  # a GPU torch saw does not go away: checked once
        world = self.topology.world_size
        if world > 1 and not interpret:
            return self._run_spmd(args, settings, opts, poison, wait)
        if world > 1:  # the interpreter: every rank in one program of this process
            outputs = run_in_process(self.schedule, self.inputs(*args), settings=settings)
            result = RunResult(outputs, None, 0.0, 1, {})
        else:
            inputs = self._module_inputs(args)
            if self._runtime is None:
                self._runtime = TritonRuntime(self.schedule, settings=settings, **opts)
            result = self._launch(inputs, lambda ins: ins, poison, wait)
        for name, value in zip(self.opgraph.output_names, self.opgraph.outputs, strict=True):
            result.outputs[name] = result.outputs[name].reshape(value.shape)
        return result

    def _launch(
        self,
        inputs: dict[str, torch.Tensor],
        local: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
        poison: bool | None,
        wait: bool = True,
    ) -> Any:
        """One run of this process's runtime on the module inputs ``inputs`` (global) and the
        parameters that changed since its buffers were loaded (``local``: the global tensors
        as the runtime takes them). The kernel's buffers are poisoned at its first launch, or
        at every launch with ``poison``; ``wait``: see TritonRuntime.run."""
        runtime = self._runtime
        held = runtime.loaded_inputs()  # what the runtime can keep: never a buffer a task writes
        now = self._params(inputs, self._loaded, held)
        resident = [name for name in now if name not in inputs]
        # a run that fails part-way leaves the buffers in no known state: reload them all next
        self._loaded = {}
        result = runtime.run(
            local(inputs),
            poison=runtime.epoch == 0 if poison is None else bool(poison),
            resident=resident,
            wait=wait,
        )
        self._loaded = now
        return result

    # -- SPMD (torchrun) ----------------------------------------------------------------------
    def _run_spmd(
        self,
        args: Sequence[torch.Tensor],
        settings: Settings | None,
        opts: dict,
        poison: bool | None,
        wait: bool = True,
    ) -> Any:
        import torch.distributed as dist

        from .runtime.megakernel import TritonRuntime, local_shards
        from .runtime.megakernel.runtime import assemble_local

        world = self.topology.world_size
        if not dist.is_initialized() or dist.get_world_size() != world:
            raise MgraphError(
                f"{self.opgraph.name}: compiled for {world} ranks on backend='triton', which "
                "runs SPMD: one process per GPU with torch.distributed initialised "
                f"(now: {dist.get_world_size() if dist.is_initialized() else 'not initialised'})",
                hint=f"start it with torchrun --nproc_per_node={world}, call "
                "dist.init_process_group('nccl') and torch.cuda.set_device(local_rank) first",
            )
        rank = dist.get_rank()
        self._check_count(args)
        globals_: dict[str, torch.Tensor] = {}
        for value, arg in zip(self.opgraph.inputs, args, strict=True):
            if value.name in self.graph.inputs:
                globals_[value.name] = self._spmd_input(value, arg, rank, world)
        if self._runtime is None:
            self._runtime = TritonRuntime(self.schedule, rank=rank, settings=settings, **opts)
        def local(ins: dict[str, torch.Tensor]) -> dict:
            # per_buffer: a constant the rank holds in two buffers (a RoPE table read whole and
            # by rows) gets each buffer's own part
            return local_shards(self.graph, rank, ins, per_buffer=True)

        result = self._launch(globals_, local, poison, wait)
        # a call that did not wait got copies of its own (masked by the watchdog record); a
        # waiting one, views of the buffers that the next launch rewrites
        private = not self._runtime.last_waited
        for name, value in zip(self.opgraph.output_names, self.opgraph.outputs, strict=True):
            local = assemble_local(self.graph, rank, name, result.outputs[name])
            result.outputs[name] = self._spmd_output(name, value, local, rank, world, private)
        return result

    def _spmd_input(self, value: Value, arg: Any, rank: int, world: int) -> torch.Tensor:
        """The input's global flat 2-D tensor as far as this rank's buffers read it, from the
        whole tensor or this rank's chunk along one dim (gathered only when needed)."""
        import torch.distributed as dist

        shape = value.shape
        chunks = []
        for d, n in enumerate(shape):
            if n % world == 0:
                chunks.append(shape[:d] + (n // world,) + shape[d + 1 :])
        arg = self._arg(value, arg, [shape, *chunks])
        if tuple(arg.shape) == shape:
            return arg.reshape(flat_shape(shape))
        d = next(d for d, n in enumerate(shape) if arg.shape[d] != n)
        key = (value.name, rank, d)
        if key not in self._chunk_ok:
            self._chunk_ok[key] = self._within_chunk(value, rank, world, d)
        if self._chunk_ok[key]:
            # only the chunk's elements are read: the rest of this tensor is never touched
            full = arg.new_empty(shape)
        else:
            parts = [torch.empty_like(arg) for _ in range(world)]
            dist.all_gather(parts, arg.contiguous())
            return torch.cat(parts, dim=d).reshape(flat_shape(shape))
        lo = rank * (shape[d] // world)
        full.narrow(d, lo, shape[d] // world).copy_(arg)
        return full.reshape(flat_shape(shape))

    def _within_chunk(self, value: Value, rank: int, world: int, d: int) -> bool:
        """Whether every buffer this rank binds ``value`` to reads only its chunk along ``d``."""
        flat = flat_shape(value.shape)
        chunk = layout_runs(value.shape, Layout("shard", d), rank, world)
        for buf in self.graph.buffers.values():
            b = buf.binding
            if buf.rank != rank or buf.role != "input" or b is None or b.tensor != value.name:
                continue
            for r0, r1, c0, c1 in binding_runs(flat, b.pieces, b.cat_dim):
                row = r0
                while row < r1:
                    cover = next(
                        (c for c in chunk if c[0] <= row < c[1] and c[2] <= c0 and c1 <= c[3]), None
                    )
                    if cover is None:
                        return False
                    row = cover[1]
        return True

    def _spmd_output(
        self, name: str, value: Value, local: torch.Tensor, rank: int, world: int,
        private: bool = False,
    ) -> torch.Tensor:
        """This rank's output as eager TP returns it (the module docstring's convention);
        ``private``: ``local`` is a copy of the caller's own already, not a buffer's view."""
        import torch.distributed as dist

        lay = value.layout or REPLICATE
        if lay.kind == "rows":  # token rows (sequence parallel): eager's Shard(sequence dim)
            lay = Layout("shard", max(len(value.shape) - 2, 0))
        want = REPLICATE if lay.zigzag else lay
        shape = list(value.shape)
        if want.kind == "shard":
            shape[want.dim] //= world
        key = (name, rank)
        if key not in self._output_as_wanted:  # the graph's: worked out at the first call
            mine = self._output_runs(name, rank)
            self._output_as_wanted[key] = mine == layout_runs(value.shape, want, rank, world)
        if self._output_as_wanted[key]:
            return local.reshape(shape) if private else local.reshape(shape).clone()
        # Held in another layout: every rank's output buffer, gathered, then cut as wanted.
        flat_local = local.reshape(-1).contiguous()
        most = max(  # every rank's buffer size is in the graph: no size exchange
            sum((r1 - r0) * (c1 - c0) for r0, r1, c0, c1 in self._output_runs(name, r))
            for r in range(world)
        )
        padded = torch.zeros(most, dtype=local.dtype, device=local.device)
        padded[: flat_local.numel()] = flat_local
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded)
        rows, cols = flat_shape(value.shape)
        full = torch.empty(rows, cols, dtype=local.dtype, device=local.device)
        for r in range(world):
            at = 0
            for r0, r1, c0, c1 in self._output_runs(name, r):
                n = (r1 - r0) * (c1 - c0)
                full[r0:r1, c0:c1] = parts[r][at : at + n].view(r1 - r0, c1 - c0)
                at += n
        full = full.reshape(value.shape)
        if want.kind == "shard":
            return full.chunk(world, want.dim)[rank].contiguous()
        return full

    def _output_runs(self, name: str, rank: int) -> tuple:
        """The (row, row end, column, column end) runs of output ``name`` that ``rank``'s
        output buffer holds, in its order (kept: they read only the graph)."""
        key = (name, rank)
        if key in self._runs:
            return self._runs[key]
        buf = next(
            b
            for b in self.graph.buffers.values()
            if b.rank == rank
            and b.role == "output"
            and b.binding is not None
            and b.binding.tensor == name
        )
        runs = binding_runs(self.graph.outputs[name].shape, buf.binding.pieces, buf.binding.cat_dim)
        self._runs[key] = runs
        return runs

    def view(self, path: str | None = None, **kw: Any):
        """Write the offline HTML viewer of this program's graph, schedule and last run's
        timeline; returns the file's path (mgraph.viz.view)."""
        from .viz import view

        return view(self, path, **kw)

    def __repr__(self) -> str:
        g = self.graph
        return (
            f"Program({self.opgraph.name}, topology={self.topology}, backend={self.backend!r}, "
            f"ops={len(self.lowered.nodes)}, tasks={len(g.tasks)})"
        )


class _Seen:
    """A module tensor as it was when a Program copied it into the kernel's buffers: the same
    object (held weakly: a freed tensor's id and address can be reused), storage, layout and
    in-place version (torch bumps ``_version`` at every in-place write it runs)."""

    __slots__ = ("ref", "ptr", "shape", "stride", "dtype", "device", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.ref = weakref.ref(t)
        self.ptr, self.shape, self.stride = t.data_ptr(), t.shape, t.stride()
        self.dtype, self.device, self.version = t.dtype, t.device, t._version

    @staticmethod
    def of(t: torch.Tensor) -> _Seen | None:
        """None for a tensor that has no version counter (made under torch.inference_mode):
        it matches nothing, so it is copied at every call."""
        return None if t.is_inference() else _Seen(t)

    def matches(self, t: torch.Tensor) -> bool:
        return (
            self.ref() is t
            and t._version == self.version
            and t.data_ptr() == self.ptr
            and t.shape == self.shape
            and t.stride() == self.stride
            and t.dtype == self.dtype
            and t.device == self.device
        )


def _unchanged(held: tuple[_Seen | None, ...], tensors: Sequence[torch.Tensor]) -> bool:
    """Whether every module tensor is the one ``held`` saw (a None never matches)."""
    if len(held) != len(tensors):
        return False
    for seen, t in zip(held, tensors, strict=True):
        if seen is None or not seen.matches(t):
            return False
    return True


@dataclass(frozen=True)
class _InputSpec:
    """A module input's checks, worked out once: its traced value, whether the graph reads
    it, its flat 2-D shape and the dtype it must have (the compiled one)."""

    value: Value
    wanted: bool
    flat: tuple[int, int]
    dtype: torch.dtype


@dataclass(frozen=True)
class _ParamSpec:
    """A parameter the graph reads: its name, how it is built, the indices of its module
    tensors in ``Program._fqns()`` and its flat 2-D shape."""

    name: str
    source: ParamSource
    sources: tuple[int, ...]
    flat: tuple[int, int]


_CONSTANT, _PARAMETER, _BUFFER = 0, 1, 2


class _Sources:
    """Where each module tensor a Program builds parameters from lives, found once: the names
    of the ``_modules`` entries from the root module down to its owner and its key in the
    owner's ``_parameters`` or ``_buffers`` (the tables ``named_parameters`` and
    ``named_buffers`` read), or an OpGraph constant. ``resolve`` walks the same names at every
    call, so a new Parameter, buffer tensor or submodule is what it finds, without a walk over
    every module and tensor of the module; where the names no longer lead to one tensor of the
    same table (a submodule removed, a tensor deleted or set to None, a parameter shadowed by a
    buffer of its name) it returns None and the Program looks every name up again."""

    __slots__ = ("root", "edges", "entries")

    def __init__(self, root: nn.Module, edges: list, entries: list) -> None:
        self.root = root
        self.edges: list[tuple[int, str]] = edges  # (parent's index in the walk, child's name)
        self.entries: list[tuple[int, Any, str]] = entries  # (where, module index or constant, key)

    @staticmethod
    def find(
        root: nn.Module,
        fqns: Sequence[str],
        constants: Mapping[str, torch.Tensor],
        found: Sequence[torch.Tensor],
    ) -> _Sources | None:
        """The walks to ``fqns``, whose tensors were just looked up by name as ``found``;
        None when a walk does not lead to the same tensor (a module whose ``named_*`` methods
        report something else than its tables): such a Program looks names up at every
        call."""
        index: dict[tuple[str, ...], int] = {(): 0}
        modules = [root]
        edges: list[tuple[int, str]] = []
        entries: list[tuple[int, Any, str]] = []
        for fqn, tensor in zip(fqns, found, strict=True):
            if fqn in constants:
                entries.append((_CONSTANT, constants[fqn], fqn))
                continue
            *path, key = fqn.split(".")
            at = 0
            for depth, name in enumerate(path):
                prefix = tuple(path[: depth + 1])
                if prefix not in index:
                    child = modules[at]._modules.get(name)
                    if child is None:
                        return None
                    edges.append((at, name))
                    index[prefix] = len(modules)
                    modules.append(child)
                at = index[prefix]
            owner = modules[at]
            if owner._buffers.get(key) is not None:
                where, held = _BUFFER, owner._buffers[key]
            else:
                where, held = _PARAMETER, owner._parameters.get(key)
            if held is not tensor:
                return None
            entries.append((where, at, key))
        return _Sources(root, edges, entries)

    def resolve(self) -> list[torch.Tensor] | None:
        """The tensors the same names lead to now, in ``fqns`` order; None where a name leads
        nowhere or to the other table."""
        modules = [self.root]
        for parent, name in self.edges:
            child = modules[parent]._modules.get(name)
            if child is None:
                return None
            modules.append(child)
        out = []
        for where, at, key in self.entries:
            if where == _CONSTANT:
                out.append(at)
                continue
            owner = modules[at]
            if where == _BUFFER:
                t = owner._buffers.get(key)
            else:  # a buffer of the same name would win in the lookup by name
                t = owner._parameters.get(key)
                if owner._buffers.get(key) is not None:
                    return None
            if t is None:
                return None
            out.append(t)
        return out
