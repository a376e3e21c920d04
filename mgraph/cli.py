"""The ``mgraph`` command: demo, inspect, schedule, run, ops, compile."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from .errors import MgraphError, OptionError, OutputPathError, ShapeError, UnknownNameError
from .graph import ITEMSIZE, TaskGraph
from .options import type_name

__all__ = ["main", "build_from_args"]

console = Console()

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {}


def command(name: str) -> Callable:
    def wrap(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS[name] = fn
        return fn

    return wrap


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError


def human_flops(n: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} FLOP"


def parse_option(text: str, op: Any) -> tuple[str, Any]:
    """``--set key=value`` for ``op``: the value is parsed by the option's declared type
    (mgraph/options.py: ``causal=true``, ``tile=64,64``), never guessed."""
    from .options import parse_option_text

    if "=" not in text:
        raise OptionError(f"--set {text!r} is not key=value", hint="e.g. --set causal=true")
    key, raw = (part.strip() for part in text.split("=", 1))
    types = op.option_types
    if key not in types:
        valid = ", ".join(f"{k} ({type_name(t)})" for k, t in types.items()) or "none"
        raise UnknownNameError(f"{op.name}: unknown option {key!r}; its options: {valid}",
                               hint="list them with `mgraph ops`")
    return key, parse_option_text(op.name, key, raw, types[key])


def check_output_path(path: str | None, flag: str) -> None:
    """Fail before any work when ``path`` cannot be written (missing folder, a directory)."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise OutputPathError(f"{flag} {path!r} is a directory", hint=f"give {flag} a file name")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise OutputPathError(f"{flag} {path!r}: folder {str(folder)!r} does not exist",
                              hint=f"create it first (mkdir -p {folder}) or write elsewhere")
    if not os.access(folder, os.W_OK):
        raise OutputPathError(f"{flag} {path!r}: folder {str(folder)!r} is not writable")


def progress(what: str) -> Any:
    """A transient spinner with elapsed time, so a build or run that takes seconds says so."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    bar = Progress(SpinnerColumn(), TextColumn(what), TimeElapsedColumn(), console=console,
                   transient=True)
    bar.add_task(what, total=None)
    return bar


def add_op_args(p: argparse.ArgumentParser, *, required: bool = True) -> None:
    p.add_argument("--op", required=required, help="fused op name (see `mgraph ops`)")
    p.add_argument("--shape", help="comma-separated sizes in the op's dim order")
    p.add_argument("--topology", default="2x4", help="NODESxGPUS, e.g. 2x8")
    p.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | float16")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="op option")


def build_from_args(args: argparse.Namespace) -> tuple[TaskGraph, float]:
    from . import ops

    op = ops.get_op(args.op)
    params: dict[str, Any] = dict(parse_option(s, op) for s in args.set)
    if args.shape:
        sizes = [s for s in args.shape.split(",") if s.strip()]
        if len(sizes) != len(op.dims):
            raise MgraphError(
                f"--shape {args.shape!r} has {len(sizes)} sizes; {op.name} takes "
                f"{len(op.dims)}: {','.join(op.dims)}"
            )
        for dim, s in zip(op.dims, sizes, strict=True):
            try:
                params[dim] = int(s)
            except ValueError:
                raise ShapeError(f"--shape: {dim}={s!r} is not an integer",
                                 hint=f"{op.name} takes --shape {','.join(op.dims)} as ints") from None
    start = time.perf_counter()
    with progress(f"building {op.name} on {args.topology}"):
        graph = op(topology=args.topology, dtype=args.dtype, **params)
    return graph, time.perf_counter() - start


def print_graph(graph: TaskGraph, build_s: float | None = None) -> None:
    st = graph.stats()
    built = f", built in {build_s * 1e3:.0f} ms" if build_s is not None else ""
    console.print(
        f"[bold]{graph.op}[/] on {graph.topology} ({graph.topology.world_size} GPUs), "
        f"{graph.dtype}, params {json.dumps(graph.params)}: {len(graph.tasks)} tasks, "
        f"{len(graph.events)} events, {len(graph.buffers)} buffers{built}"
    )
    flops: dict[tuple[str, str], float] = {}
    nbytes: dict[tuple[str, str], int] = {}
    for t in graph.tasks:
        flops[(t.role, t.kind)] = flops.get((t.role, t.kind), 0.0) + t.flops
        nbytes[(t.role, t.kind)] = nbytes.get((t.role, t.kind), 0) + t.bytes
    table = Table(title="tasks by role and kind (all ranks)")
    for col in ("role", "kind", "tasks", "per rank", "flops", "bytes touched"):
        table.add_column(col, justify="left" if col in ("role", "kind") else "right")
    world = graph.topology.world_size
    for (role, kind), n in sorted(st.by_role_kind().items()):
        table.add_row(
            role, kind, str(n), f"{n / world:.1f}", human_flops(flops[(role, kind)]),
            human_bytes(nbytes[(role, kind)]),
        )
    console.print(table)
    nodes = Table(title="traffic per node")
    for col in ("node", "nvlink bytes", "rdma sent", "rdma received", "flops"):
        nodes.add_column(col, justify="right")
    g = graph.topology.gpus_per_node
    for n in range(graph.topology.nodes):
        node_flops = sum(st.flops_per_rank[n * g : (n + 1) * g])
        nodes.add_row(
            str(n), human_bytes(st.nvlink_per_node[n]), human_bytes(st.rdma_sent_per_node[n]),
            human_bytes(st.rdma_received_per_node[n]), human_flops(node_flops),
        )
    console.print(nodes)
    out_bytes = sum(_numel(spec.shape) * ITEMSIZE[spec.dtype] for spec in graph.outputs.values())
    console.print(
        f"bytes per link class: nvlink {human_bytes(st.bytes_by_link['nvlink'])}, rdma "
        f"{human_bytes(st.bytes_by_link['rdma'])} (output bytes D = {human_bytes(out_bytes)})"
    )


def print_network(graph: TaskGraph) -> None:
    """What each rank's RDMA workers push per launch on the megakernel, and the proxies' flag
    words (runtime/megakernel/netplan.py): the proxy pays per command, not per byte."""
    from .runtime.megakernel.netplan import net_plan

    if not any(t.role == "rdma" for t in graph.tasks):
        console.print("network: no rdma tasks (one node)")
        return
    plan = net_plan(graph)
    table = Table(title="network per launch (megakernel FIFO commands)")
    for col in ("rank", "peers", "WRITEs", "SIGNALs", "bytes", "bytes/WRITE", "flag words"):
        table.add_column(col, justify="right")
    for r in graph.topology.ranks:
        cmds = [c for t, cs in plan.commands.items() if graph.tasks[t].rank == r for c in cs]
        writes = [c for c in cmds if c.opcode.name == "WRITE"]
        nbytes = sum(c.bytes for c in writes)
        table.add_row(
            str(r), ",".join(map(str, plan.peers[r])) or "-", str(len(writes)),
            str(len(cmds) - len(writes)), human_bytes(nbytes),
            human_bytes(nbytes // len(writes)) if writes else "-",
            str(len(plan.words[r])),
        )
    console.print(table)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@command("inspect")
def cmd_inspect(args: argparse.Namespace) -> int:
    check_output_path(args.json, "--json")
    if args.file:
        from .serialize import load_graph_file

        start = time.perf_counter()
        graph = load_graph_file(args.file)
        build_s = time.perf_counter() - start
    elif args.op:
        graph, build_s = build_from_args(args)
    else:
        raise MgraphError("inspect needs --op (with --shape) or a graph JSON file")
    start = time.perf_counter()
    graph.validate()
    valid_s = time.perf_counter() - start
    print_graph(graph, build_s)
    if args.network:
        print_network(graph)
    console.print(f"[green]valid[/] (checked in {valid_s * 1e3:.0f} ms)")
    if args.json:
        graph.save(args.json)
        console.print(f"wrote {args.json}")
    return 0


@command("ops")
def cmd_ops(args: argparse.Namespace) -> int:
    from . import ops

    table = Table(title="fused ops")
    for col in ("op", "dims (--shape order)", "inputs", "outputs", "options"):
        table.add_column(col, no_wrap=col == "op")
    for name in ops.op_names():
        op = ops.get_op(name)
        table.add_row(
            name, ",".join(op.dims), ", ".join(op.input_names), ", ".join(op.output_names),
            ", ".join(f"{k}={json.dumps(v)}" for k, v in op.options.items()),
        )
    console.print(table)
    return 0


def print_schedule(sched) -> None:
    table = Table(title=f"schedule ({sched.policy}, {sched.hardware.name}): workers and queues per rank")
    for col in ("rank", "compute SMs", "nvlink SMs", "rdma SMs", "compute tasks", "nvlink tasks",
                "rdma tasks", "proxy batches"):
        table.add_column(col, justify="right")
    for rs in sched.ranks:
        table.add_row(
            str(rs.rank), *(str(rs.workers.get(r, 0)) for r in ("compute", "nvlink", "rdma")),
            *(str(len(rs.queues.get(r, []))) for r in ("compute", "nvlink", "rdma")),
            str(len(rs.batches)),
        )
    console.print(table)


@command("schedule")
def cmd_schedule(args: argparse.Namespace) -> int:
    from .scheduler import schedule

    check_output_path(args.json, "--json")
    graph, build_s = build_from_args(args)
    start = time.perf_counter()
    with progress("scheduling"):
        sched = schedule(graph, policy=args.policy)
    console.print(
        f"[bold]{graph.op}[/] on {graph.topology}: {len(graph.tasks)} tasks, built in "
        f"{build_s * 1e3:.0f} ms, scheduled in {(time.perf_counter() - start) * 1e3:.0f} ms"
    )
    print_schedule(sched)
    if args.json:
        with open(args.json, "w") as f:
            f.write(sched.to_json())
        console.print(f"wrote {args.json}")
    return 0


@command("run")
def cmd_run(args: argparse.Namespace) -> int:
    from .api import BACKENDS, INPUTLESS, backend_names, run
    from .ops import get_op
    from .scheduler import schedule
    from .settings import Settings

    if args.backend not in BACKENDS:
        raise UnknownNameError(f"unknown backend {args.backend!r}; available: "
                               f"{', '.join(backend_names())}")
    if args.check and args.backend in INPUTLESS:
        raise OptionError(f"--check needs computed outputs; backend {args.backend!r} predicts "
                          "time only", hint="drop --check, or use --backend reference")
    check_output_path(args.trace, "--trace")
    settings = Settings.from_env()
    if args.backend == "triton":  # refuse before building, not after
        from .api import _triton_available

        _triton_available()
    graph, _ = build_from_args(args)
    with progress("validating and scheduling"):
        graph.validate()
        sched = schedule(graph, policy=args.policy)
    op = get_op(graph.op)
    inputs = None if args.backend in INPUTLESS else op.random_inputs(graph, seed=args.seed)
    with progress(f"running {graph.op} on {graph.topology} ({len(graph.tasks)} tasks, "
                  f"backend {args.backend})"):
        result = run(sched, inputs, backend=args.backend, settings=settings)
    if args.backend == "sim":
        summary = result.summary()
        speedups = ", ".join(f"{k} {v:.2f}x" for k, v in summary["speedup"].items())
        console.print(f"predicted {summary['predicted_ms']:.3f} ms on {result.hardware.name} "
                      f"(speedup over {speedups}); busy: "
                      + ", ".join(f"{k} {v:.0%}" for k, v in summary["busy_by_role"].items()))
    else:
        console.print(f"done in {result.wall_s * 1e3:.1f} ms")
    status = 0
    if args.check:
        from .demo import rel_err

        want = op.run_reference(inputs, graph.params)
        tol = 1e-4 if graph.dtype == "float32" else 2e-2
        for name in graph.outputs:
            err = rel_err(result.outputs[name], want[name])
            ok = err < tol
            status |= 0 if ok else 1
            console.print(f"check {name}: relative error {err:.2e} (tolerance {tol:g}) "
                          + ("[green]ok[/]" if ok else "[red]FAILED[/]"))
    if args.trace and args.backend == "sim":
        result.save_timeline(args.trace)
        console.print(f"wrote predicted timeline {args.trace} (open in https://ui.perfetto.dev)")
    elif args.trace:
        result.trace.save(args.trace)
        console.print(f"wrote timeline {args.trace} (open in https://ui.perfetto.dev)")
    return status


@command("demo")
def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import DEMO_CASES, run_demo

    console.print(f"[bold]mgraph demo[/]: {len(DEMO_CASES)} fused ops on a {args.topology} cluster, "
                  "run on the CPU reference runtime and checked against torch")
    start = time.perf_counter()
    rows = run_demo(args.topology, args.out)
    table = Table(title=f"fused ops on {args.topology} (fp32)")
    for col in ("op", "tasks", "nvlink", "rdma", "ms", "rel err", "ok"):
        table.add_column(col, justify="left" if col == "op" else "right", no_wrap=True)
    for r in rows:
        table.add_row(r.op, str(r.tasks), human_bytes(r.nvlink_bytes), human_bytes(r.rdma_bytes),
                      f"{r.wall_s * 1e3:.0f}", f"{r.rel_err:.1e}",
                      "[green]ok[/]" if r.ok else "[red]FAILED[/]")
    console.print(table)
    console.print(f"timelines in {args.out}/ (Chrome/Perfetto JSON); total "
                  f"{time.perf_counter() - start:.1f} s")
    return 0 if all(r.ok for r in rows) else 1


# -- compile --profile ---------------------------------------------------------------------------
# The stages mg.compile runs, by the names mgraph.program calls them (validate as
# ``validate_graph``: compile's flag is named ``validate``): the profile wraps them for the
# duration of one compile, so it times the real call.
COMPILE_STAGES = (
    "trace", "fuse_pointwise", "token_major_attention", "fuse_glu", "lower", "prune", "validate",
    "check_triton_bodies", "schedule",
)


class StageTimes:
    """Wall and CPU seconds per stage of the mg.compile calls made inside ``with`` (the CPU
    time says how much of the wall time this process spent; the rest is waiting for a core)."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self._undo: list[tuple[Any, str, Any]] = []

    def _wrap(self, owner: Any, attr: str, stage: str) -> None:
        fn = getattr(owner, attr, None)
        if fn is None:
            return
        times = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                times.wall[stage] = times.wall.get(stage, 0.0) + time.perf_counter() - wall
                times.cpu[stage] = times.cpu.get(stage, 0.0) + time.process_time() - cpu

        self._undo.append((owner, attr, fn))
        setattr(owner, attr, timed)

    def __enter__(self) -> StageTimes:
        from . import program

        for stage in COMPILE_STAGES:
            self._wrap(program, "validate_graph" if stage == "validate" else stage, stage)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, attr, fn in reversed(self._undo):
            setattr(owner, attr, fn)
        self._undo.clear()


def load_module_factory(spec: str) -> tuple[Callable[..., Any], Any]:
    """``FILE.py:NAME`` -> (NAME, the file's namespace). NAME builds the nn.Module."""
    import runpy

    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py") or not name:
        raise OptionError(f"module {spec!r} is not FILE.py:NAME",
                          hint="e.g. examples/llama_block.py:DecoderBlock")
    if not Path(path).is_file():
        raise OptionError(f"module file {path!r} does not exist")
    namespace = runpy.run_path(path, run_name="mgraph_compile_module")
    if not callable(namespace.get(name)):
        found = sorted(k for k, v in namespace.items() if callable(v) and not k.startswith("_"))
        raise UnknownNameError(f"{path} has no callable {name!r}", hint=f"it has: {', '.join(found)}")
    return namespace[name], namespace


def _literal(text: str) -> Any:
    import ast

    key, sep, raw = text.partition("=")
    if not sep:
        raise OptionError(f"--set {text!r} is not key=value", hint="e.g. --set hidden=4096")
    try:
        return key.strip(), ast.literal_eval(raw.strip())
    except (ValueError, SyntaxError):
        return key.strip(), raw.strip()  # a bare word: a string


@command("compile")
def cmd_compile(args: argparse.Namespace) -> int:
    import gc

    import torch

    from .graph import torch_dtype
    from .program import compile as mg_compile

    check_output_path(args.json, "--json")
    dtype = torch_dtype(args.dtype)
    factory, namespace = load_module_factory(args.module)
    kwargs = dict(_literal(s) for s in args.set)
    shapes = []
    for text in args.input:
        try:
            shapes.append([int(v) for v in text.split(",") if v.strip()])
        except ValueError:
            raise ShapeError(f"--input {text!r} is not a comma-separated shape",
                             hint="e.g. --input 1,4096,4096") from None
    plan = None
    if args.plan:
        if not callable(namespace.get(args.plan)):
            found = sorted(k for k, v in namespace.items() if callable(v) and not k.startswith("_"))
            raise UnknownNameError(f"{args.module.rpartition(':')[0]} has no plan function "
                                   f"{args.plan!r}", hint=f"it has: {', '.join(found)}")
        plan = namespace[args.plan]()
    if args.repeat < 1:
        raise OptionError(f"--repeat {args.repeat} must be at least 1")
    runs = []
    for i in range(args.repeat):
        torch.manual_seed(i)
        with torch.no_grad():
            module = factory(**kwargs).to(dtype).eval()
        inputs = tuple(torch.randn(shape, dtype=dtype) for shape in shapes)
        gc.collect()
        with StageTimes() as times:
            wall, cpu = time.perf_counter(), time.process_time()
            prog = mg_compile(module, inputs, plan=plan, topology=args.topology,
                              policy=args.policy)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        runs.append({
            "run": "cold" if i == 0 else "warm", "wall_s": wall, "cpu_s": cpu,
            "tasks": len(prog.graph.tasks),
            "stages": {k: {"wall_s": times.wall[k], "cpu_s": times.cpu[k]} for k in times.wall},
        })
        console.print(f"compile {i + 1}/{args.repeat} ({runs[-1]['run']}): "
                      f"{len(prog.graph.tasks)} tasks on {args.topology} in {wall:.2f} s "
                      f"(cpu {cpu:.2f} s)")
        del prog, module, inputs
    if args.profile:
        table = Table(title=f"compile stages, seconds (wall / cpu), {args.module} on "
                            f"{args.topology}")
        table.add_column("stage")
        for r in runs:
            table.add_column(f"{r['run']} #{runs.index(r) + 1}", justify="right")
        stages = [s for s in COMPILE_STAGES if any(s in r["stages"] for r in runs)]
        for stage in stages:
            table.add_row(stage, *(
                f"{r['stages'][stage]['wall_s']:.2f} / {r['stages'][stage]['cpu_s']:.2f}"
                if stage in r["stages"] else "-" for r in runs))
        table.add_row("other", *(
            f"{r['wall_s'] - sum(v['wall_s'] for v in r['stages'].values()):.2f}" for r in runs))
        table.add_row("total", *(f"{r['wall_s']:.2f} / {r['cpu_s']:.2f}" for r in runs))
        console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"module": args.module, "kwargs": kwargs, "inputs": shapes,
                       "topology": args.topology, "dtype": args.dtype, "runs": runs}, f, indent=1)
        console.print(f"wrote {args.json}")
    return 0


@command("simulate")
def cmd_simulate(args: argparse.Namespace) -> int:
    from .runtime.sim.cli import simulate_command

    return simulate_command(args, console)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mgraph", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="build (or load) a task graph and print its statistics")
    p.add_argument("file", nargs="?", help="a graph JSON written by --json")
    add_op_args(p, required=False)
    p.add_argument("--json", help="write the graph to this JSON file")
    p.add_argument("--network", action="store_true",
                   help="also print what the megakernel pushes to the host proxies per launch")
    sub.add_parser("ops", help="list the fused ops, their dims and options")
    p = sub.add_parser("schedule", help="schedule an op's graph; print the SM partition and queues")
    add_op_args(p)
    p.add_argument("--policy", default="critical_path", help="queue ordering policy")
    p.add_argument("--json", help="write the schedule to this JSON file")
    p = sub.add_parser("run", help="build, schedule and run an op; --check compares with torch")
    add_op_args(p)
    p.add_argument("--policy", default="critical_path", help="queue ordering policy")
    p.add_argument("--backend", default="reference",
                   help="reference (CPU), sim (predicted time), triton (CUDA GPU)")
    p.add_argument("--check", action="store_true", help="compare with the op's torch reference")
    p.add_argument("--trace", help="write the timeline (Chrome/Perfetto JSON) here")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p = sub.add_parser("demo", help="run the five fused ops on the CPU and check them")
    p.add_argument("--topology", default="2x2", help="NODESxGPUS")
    p.add_argument("--out", default="mgraph-demo", help="folder for the timelines")
    p = sub.add_parser("compile", help="compile a module from a Python file (mg.compile on the "
                       "reference backend); --profile prints the time of each stage")
    p.add_argument("module", help="FILE.py:NAME, NAME(**--set) builds the nn.Module")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a keyword argument of NAME (a Python literal)")
    p.add_argument("--input", action="append", default=[], required=True, metavar="SHAPE",
                   help="the shape of one example input (random), e.g. 1,4096,4096")
    p.add_argument("--plan", help="a function in FILE returning the parallel plan")
    p.add_argument("--topology", default="1x1", help="NODESxGPUS, e.g. 2x8")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    p.add_argument("--policy", default="critical_path", help="queue ordering policy")
    p.add_argument("--repeat", type=int, default=1,
                   help="compile N times in this process, each a freshly built module: the "
                   "first is cold, the others warm")
    p.add_argument("--profile", action="store_true", help="print the time of each stage")
    p.add_argument("--json", help="write the times per stage to this JSON file")
    p = sub.add_parser("simulate", help="predict an op's fused vs baseline time on a cluster")
    add_op_args(p)
    from .runtime.sim.cli import add_arguments as add_simulate_arguments

    add_simulate_arguments(p)
    from .viz.cli import add_subcommands as add_viz_subcommands  # plot, view

    add_viz_subcommands(sub, COMMANDS, console)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except MgraphError as exc:
        # soft_wrap: a path or a variable in the message must not be broken across lines
        # (and no markup: "tasks[3]" or "tile=[64]" in a message is text, not a rich tag)
        console.print(f"error: {type(exc).__name__}: {exc}", style="red", highlight=False,
                      soft_wrap=True, markup=False)
        return 2


if __name__ == "__main__":
    sys.exit(main())
