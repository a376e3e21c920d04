"""Where the Llama layer's megakernel build goes: each Triton stage timed for sm_90 on the CPU.

The layer (bench_layer's model and plan, one GPU, bf16) is traced and scheduled here; rank 0's
kernel arguments are built as a GPU process builds them (glu_sass.kernel_and_args) and the
generated megakernel goes through Triton's stages one by one (AST -> TTIR, TTGIR, LLIR, PTX,
ptxas), each timed, nothing cached. Per run it prints one JSON line: seconds per stage, the
call sites of each ``@triton.jit`` function in the AST's IR (each one is inlined: that many
copies of its body), the size of each stage's text, ptxas's registers and spills, and the SASS:
instructions in all and per innermost loop (HGMMA, DEPBAR, LDL/STL: the GEMM K loop and the
attention loops), as tests/test_attention_compile.py counts them.

Run it under the GPU machine's Triton (3.6; the wheel unpacked into a folder)::

    PYTHONPATH=/tmp/t36 python benchmarks/build_time.py --out /tmp/build_time

Measured (2-core CPU, Triton 3.6.0, bundled ptxas 12.8, wall / CPU seconds): before 24cd031
ast 2.6, ttir 0.7, ttgir 53.0 (TritonGPUCoalesce ~90% of it), llir 10.1, ptx 3.5, cubin 21.7:
91.5 s (85.9 CPU); after: 2.5, 0.3, 3.1, 12.2, 4.3, 15.0: 37.5 s (23.7 CPU).

``--seq 512`` compiles the same kernel as 4096 (tests/test_kernel_reuse.py: power-of-two
lengths give one kernel) with less tracing; ``--glu`` the gated-unit variant; ``--last``
stops after a stage. Writes ``<out>/<name>.{ttir,ttgir,ptx,sass,ptxas.log}`` and
``<out>/<name>.json``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))


def layer_kernel(seq: int, glu: bool):
    """(the megakernel JITFunction of the layer's rank 0, its kernel arguments on a GPU)."""
    import torch
    from bench_layer import mgraph_plan
    from glu_sass import kernel_and_args
    from llama_layer import build_layer

    import mgraph as mg

    sizes = argparse.Namespace(hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=seq, batch=1,
                               dtype=torch.bfloat16)
    torch.manual_seed(0)
    layer = build_layer(sizes, torch.device("cpu"))
    x = torch.randn(1, seq, sizes.hidden, dtype=sizes.dtype)
    prog = mg.compile(layer, (x,), plan=mgraph_plan(), glu=glu, topology="1x1",
                      backend="triton")
    return kernel_and_args(prog.schedule)


def inlined_copies(ir_text: str, top: int = 25) -> list[dict]:
    """What the inliner makes of the AST's IR: per ``@triton.jit`` function (one specialisation),
    its lines there, how many copies of it the kernel holds once every call is inlined (the
    sum over its call sites of its caller's copies) and lines x copies, largest first."""
    lines: dict[str, int] = {}
    calls: dict[str, collections.Counter] = {}
    noinline: set[str] = set()
    current = None
    for line in ir_text.splitlines():
        head = re.match(r'\s*tt\.func (?:public |private )?@("[^"]+"|[\w.$-]+)', line)
        if head:
            current = head.group(1)
            lines[current], calls[current] = 0, collections.Counter()
            if "noinline = true" in line:
                noinline.add(current)
            continue
        if current is not None and re.match(r"  \}", line):
            current = None  # the function's closing brace
        if current is not None:
            lines[current] += 1
            for callee in re.findall(r'tt\.call @("[^"]+"|[\w.$-]+)', line):
                calls[current][callee] += 1
    copies: dict[str, int] = collections.Counter()

    def visit(fn: str, times: int) -> None:
        copies[fn] += times
        for callee, n in calls.get(fn, {}).items():
            if callee not in noinline:
                visit(callee, times * n)
            elif copies[callee] == 0:  # a noinline callee stays one function
                visit(callee, 1)

    visit(next(n for n in lines if n == "megakernel"), 1)
    rows = [dict(fn=re.sub(r"__.*", "", fn.strip('"')), lines=lines.get(fn, 0), copies=c,
                 inlined_lines=lines.get(fn, 0) * c, noinline=fn in noinline)
            for fn, c in copies.items()]
    rows.sort(key=lambda r: -r["inlined_lines"])
    return rows[:top]


def sass_loops(cubin: Path) -> list[dict]:
    """Every innermost loop of ``cubin``'s SASS (nvdisasm with line info), per function: its
    instructions, HGMMA, WARPGROUP.DEPBAR (1-2 an iteration: pipelined; one per HGMMA:
    serialised), LDL/STL (spill traffic), 16-byte and 2-byte global loads, and the source line
    it mostly comes from (file:line of its most frequent line), so loops can be matched across
    builds that inline differently."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    text = subprocess.run([str(tool), "--print-line-info", "-c", str(cubin)],
                          capture_output=True, text=True, check=True).stdout
    funcs: dict[str, list[tuple[int, str, str]]] = {}
    func, where = "?", "?"
    labels: dict[str, int] = {}  # nvdisasm's branch targets: label -> next instruction's address
    pending: list[str] = []
    for line in text.splitlines():
        label = re.match(r"(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        head = re.match(r"(?:\$megakernel\$)?([^\s.$/][^\s:]*|\$__internal\w+):\s*$", line)
        if head:  # a function's label: the entry, then each noinline callee
            func = head.group(1)
            funcs[func] = []
            continue
        src = re.match(r'\s*//## File "([^"]+)", line (\d+)', line)
        if src:
            where = f"{Path(src.group(1)).name}:{src.group(2)}"
            continue
        ins = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if ins and func in funcs:
            funcs[func].append((int(ins.group(1), 16), ins.group(2), where))
            labels.update((name, int(ins.group(1), 16)) for name in pending)
            pending = []
    rows = []
    for func, ins in funcs.items():
        spans = []
        for addr, op, _where in ins:
            back = re.match(r"@!?U?P\w+\s+BRA\s+(?:`\()?(\.L_x_\d+)", op)
            if back and addr - labels.get(back.group(1), addr) > 0x20:
                spans.append((labels[back.group(1)], addr))
        for lo, hi in spans:
            if any(o != (lo, hi) and lo <= o[0] and o[1] <= hi for o in spans):
                continue  # not innermost
            body = [(op, w) for addr, op, w in ins if lo <= addr <= hi]
            ops = [op for op, _w in body]

            def count(name: str, ops: list[str] = ops) -> int:
                return sum(bool(re.search(rf"(^|\s){re.escape(name)}(\.|\s|$)", o)) for o in ops)

            source = collections.Counter(w for _op, w in body).most_common(1)[0][0]
            rows.append(dict(func=_short(func), n=len(ops),
                             source=source, HGMMA=count("HGMMA"),
                             DEPBAR=sum("WARPGROUP.DEPBAR" in o for o in ops),
                             LDL=count("LDL"), STL=count("STL"),
                             LDG128=sum("LDG.E.128" in o for o in ops),
                             LDG16=sum("LDG.E.U16" in o for o in ops),
                             STG128=sum("STG.E.128" in o for o in ops)))
    return rows


def _short(symbol: str) -> str:
    """A compiled function's name without module path and specialisation suffix."""
    return re.sub(r"__.*", "", symbol.replace("_$_", ".")).split(".")[-1]


def ptxas_figures(log: str) -> dict:
    """Registers, spills, stack and wgmma warnings (C751x) from a ``ptxas -v`` log, the
    entry's seconds (ptxas's own "Compile time") and each function's spills."""
    regs = re.findall(r"Used (\d+) registers", log)
    spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.findall(r"(\d+) bytes stack frame", log)
    per_function = re.findall(r"Function properties for (\S+)\n\s*(\d+) bytes stack frame, "
                              r"(\d+) bytes spill stores, (\d+) bytes spill", log)
    compile_ms = re.findall(r"Compile time = ([\d.]+) ms", log)
    return dict(regs=max(map(int, regs)) if regs else None,
                spill_stores=sum(int(s) for s, _ in spill),
                spill_loads=sum(int(lo) for _, lo in spill),
                stack=max(map(int, stack)) if stack else None,
                entry_ptxas_s=round(float(compile_ms[0]) / 1e3, 1) if compile_ms else None,
                functions={_short(f): dict(stack=int(a), spill_stores=int(b),
                                           spill_loads=int(c))
                           for f, a, b, c in per_function},
                warnings=sorted(set(re.findall(r"\(C75\d\d\)", log))))


def staged_compile(fn, args: dict, last: str, out: Path, name: str) -> dict:
    """``fn`` through Triton's sm_90 stages up to ``last``, each timed (wall and CPU seconds:
    this process's, plus ptxas's as a child); the texts under ``out``. The arguments are
    specialised as at a launch (tests/test_gpu_compile.py's compile_for_sm90)."""
    import resource

    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, launch_opts = binder(**args)
    options, signature, constexprs, attrs = fn._pack_args(
        backend, launch_opts, bound, specialization, launch_opts)
    src = ASTSource(fn, signature, constexprs, attrs)
    stages: dict = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)

    def clock() -> tuple[float, float]:
        child = resource.getrusage(resource.RUSAGE_CHILDREN)
        return time.perf_counter(), time.process_time() + child.ru_utime + child.ru_stime

    seconds, cpu, texts = {}, {}, {}
    t0 = clock()
    module = src.make_ir(target, options, backend.get_codegen_implementation(options),
                         backend.get_module_map(), context)
    t1 = clock()
    seconds["ast"], cpu["ast"] = t1[0] - t0[0], t1[1] - t0[1]
    ast_text = {"ast": str(module)}
    metadata: dict = {}
    from triton import knobs

    knobs.nvidia.dump_ptxas_log = True  # ptxas -v's log, printed: caught below
    ptxas_log = io.StringIO()
    for stage, run in stages.items():
        t0 = clock()
        with contextlib.redirect_stdout(ptxas_log):
            module = run(module, metadata)
        t1 = clock()
        seconds[stage], cpu[stage] = t1[0] - t0[0], t1[1] - t0[1]
        if not isinstance(module, bytes):
            texts[stage] = str(module)
        if stage == last:
            break
    row = dict(seconds={k: round(v, 1) for k, v in seconds.items()},
               cpu_seconds={k: round(v, 1) for k, v in cpu.items()})
    row["total_s"] = round(sum(seconds.values()), 1)
    row["total_cpu_s"] = round(sum(cpu.values()), 1)
    print(json.dumps(row), flush=True)
    row["inlined"] = inlined_copies(ast_text["ast"])
    row["chars"] = {k: len(v) for k, v in [("ast", ast_text["ast"]), *texts.items()]}
    (out / f"{name}.ast").write_text(ast_text["ast"])
    for stage, text in texts.items():
        if stage in ("ttir", "ttgir", "ptx"):
            (out / f"{name}.{stage}").write_text(text)
    if "ttgir" in texts:
        ttgir = texts["ttgir"]
        row["ttgir_for"] = ttgir.count("scf.for ")
        row["ttgir_wgmma"] = ttgir.count("ttng.warp_group_dot ")
        row["ttgir_tma_loads"] = ttgir.count("ttng.async_tma_copy_global_to_local")
    if "ptx" in texts:
        row["ptx_lines"] = texts["ptx"].count("\n")
    if isinstance(module, bytes):
        from test_attention_compile import sass_stats

        stats = sass_stats(module, out, per_loop=True)
        sass = subprocess.run([str(Path(sys.modules["triton"].__file__).parent / "backends" /
                                   "nvidia" / "bin" / "cuobjdump"), "-sass",
                               str(out / "kernel.cubin")], capture_output=True, text=True).stdout
        (out / f"{name}.sass").write_text(sass)
        row["loops"] = sass_loops(out / "kernel.cubin")
        row["sass_instructions"] = len(re.findall(r"/\*[0-9a-f]{4,}\*/", sass))
        row["cubin_bytes"] = len(module)
        # the hot loops: every innermost loop with wgmma (GEMM K loops, attention loops)
        row["wgmma_loops"] = [lp for lp in stats.pop("per_loop") if lp["HGMMA"]]
        row["sass"] = stats
        (out / f"{name}.ptxas.log").write_text(ptxas_log.getvalue())
        row["ptxas"] = ptxas_figures(ptxas_log.getvalue())
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/build_time")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--glu", action="store_true")
    p.add_argument("--last", default="cubin", choices=["ttir", "ttgir", "llir", "ptx", "cubin"])
    p.add_argument("--name", default=None)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    import triton

    name = a.name or f"layer-{'glu' if a.glu else 'plain'}-{triton.__version__}"
    start = time.perf_counter()
    fn, args = layer_kernel(a.seq, a.glu)
    row = dict(name=name, triton=triton.__version__, seq=a.seq, glu=a.glu,
               trace_s=round(time.perf_counter() - start, 1),
               constexprs={k: str(v) for k, v in args.items()
                           if k.isupper() and not isinstance(v, (list, tuple))})
    row.update(staged_compile(fn, args, a.last, out, name))
    (out / f"{name}.json").write_text(json.dumps(row, indent=1))
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    main()
