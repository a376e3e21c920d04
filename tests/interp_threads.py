"""Triton's interpreter with every program of a launch on its own thread (tests only).

The interpreter runs a grid's programs one after another, so a kernel whose programs wait for
each other (the megakernel's queues, its entry barrier across ranks) can only run there with one
program. ``install()`` replaces the interpreter's grid loop in THIS process: each program runs on
its own Python thread (the program id and grid size are per thread), so programs spin on each
other's flags as on a GPU, interleaved by the GIL. Two ranks' launches may run at once (each
from its own host thread). Atomics stay atomic (the interpreter's C++ read-modify-write);
everything else races as it would on a GPU. A program that raises fails its launch.

Import this before launching anything, after setting TRITON_INTERPRET=1 (the scripts that use it
run in a subprocess for that reason). Not for production: the language patches the interpreter
applies per launch are applied once here and never undone (two launches in flight would undo
each other's).
"""

from __future__ import annotations

import inspect
import sys
import threading

__all__ = ["install", "run_ranks"]

_installed = False


def install() -> None:
    """Run every later interpreted launch of this process with one thread per program."""
    global _installed
    if _installed:
        return
    from triton.runtime import interpreter as it

    local = threading.local()
    it.InterpreterBuilder.grid_idx = property(
        lambda self: local.idx, lambda self, value: setattr(local, "idx", value)
    )
    it.InterpreterBuilder.grid_dim = property(
        lambda self: local.dim, lambda self, value: setattr(local, "dim", value)
    )
    lock = threading.Lock()
    patched: set = set()

    def call(self, *args, **kwargs):  # GridExecutor.__call__, CPU tensors only
        spec = inspect.getfullargspec(self.fn)
        kwargs = {k: v for k, v in kwargs.items() if k in spec.args or k in spec.kwonlyargs}
        with lock:
            if self.fn not in patched:
                it._patch_lang(self.fn)
                patched.add(self.fn)
        bound = inspect.getcallargs(self.fn, *args, **kwargs)
        bound = {n: v if n in self.constexprs else it._implicit_cvt(v) for n, v in bound.items()}
        grid = self.grid(bound) if callable(self.grid) else self.grid
        grid = tuple(grid) + (1,) * (3 - len(grid))
        errors: list[BaseException] = []

        def program(x: int, y: int, z: int) -> None:
            it.interpreter_builder.set_grid_dim(*grid)
            it.interpreter_builder.set_grid_idx(x, y, z)
            try:
                self.fn(**bound)
            except BaseException as exc:  # noqa: BLE001 - reported by the launching thread
                errors.append(exc)

        threads = [
            threading.Thread(target=program, args=(x, y, z), daemon=True)
            for x in range(grid[0])
            for y in range(grid[1])
            for z in range(grid[2])
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise it.InterpreterError(repr(errors[0])) from errors[0]

    it.GridExecutor.__call__ = call
    rewrite_lock = threading.Lock()

    def device_call(self, *args, **kwargs):  # InterpretedFunction.__call__, its first two steps
        # locked: they iterate the function's module globals (_patch_lang) and, on its first
        # call, add the interpreter's names to them (rewrite): two programs' threads doing both
        # at once failed the launch ("dictionary changed size during iteration", ~1 run in 8 of
        # adaptive_threads_interp.py)
        with rewrite_lock:
            it._patch_lang(self.fn)
            fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise it.InterpreterError(repr(e)) from e

    it.InterpretedFunction.__call__ = device_call
    # Spinning programs hand the GIL over often, so the one they wait for gets to run.
    sys.setswitchinterval(1e-4)
    _installed = True


def run_ranks(rts: list, graph, inputs: dict) -> tuple[list, list[tuple[int, Exception]]]:
    """One launch of every rank's runtime of ``graph`` at once, each from its own host thread
    (as the ranks' processes would), on the GLOBAL ``inputs``: (each rank's "out", cloned out
    of its buffer, or None where it raised; (rank, exception) for each that raised)."""
    from mgraph.runtime.megakernel import local_shards

    outs: list = [None] * len(rts)
    failed: list[tuple[int, Exception]] = []

    def rank(r: int) -> None:
        try:
            outs[r] = rts[r].run(local_shards(graph, r, inputs)).outputs["out"].clone()
        except Exception as exc:  # noqa: BLE001 - the caller reports it
            failed.append((r, exc))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(rts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs, failed
