"""The CPU tests' interpreter scripts, each in a fresh process forked from one server per pytest
process that has imported torch, triton (TRITON_INTERPRET=1) and mgraph, instead of a fresh
``python`` importing them again for every script (~3 s a script on CI's two cores; the suite runs
~30 such scripts).

What a script sees is what ``python script.py args`` (or ``python -c code args``) would give it:
its own process (forked from a server that has done nothing but import those modules: no kernel
run, no graph built, no thread of its own besides OpenBLAS's idle pool), the environment the test
passes (TRITON_INTERPRET must be "1": triton was imported under it), ``sys.argv``, ``sys.path``
(the script's directory, then PYTHONPATH's entries, then the standard ones), ``__main__`` and
stdin (``input``). Its exit status is the script's (an uncaught exception: 1, as Python's), after
non-daemon threads and atexit handlers ran, as at an interpreter's exit. stdout and stderr come
back as from ``subprocess.run(..., capture_output=True, text=True)``. A script past its timeout
is killed with everything it started (its own session) and raises ``subprocess.TimeoutExpired``.
What a process reads only at its start or when those modules are imported (the loader's LD_*
variables, PYTHON*, TRITON_*, TORCH_*, thread counts) is the script's own: the server is
started with the script's values, and started again when a script comes with others.

Protocol: JSON lines over the server's stdin and stdout; a request names the script, its
arguments, environment, directory and the files of its stdin, stdout and stderr; the server
answers the child's pid at once, then its exit status. One request at a time per pytest process
(tests run one at a time in each). The server ends when its stdin closes (the pytest process
exits).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

__all__ = ["run_script"]

HERE = Path(__file__).resolve().parent
PRELOAD = ("numpy", "torch", "triton", "triton.language", "mgraph", "mgraph.runtime.megakernel")

# Read when a process starts (the dynamic loader) or when these modules are imported: a script
# runs in a server started with its values (a forked child cannot change them).
FIXED = ("LD_", "PYTHON", "TRITON_", "TORCH_", "OMP_", "MKL_", "OPENBLAS_")

_server: subprocess.Popen | None = None
_server_env: dict[str, str] = {}
_lock = threading.Lock()


def _fixed(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items()
            if k.startswith(FIXED) and k not in ("PYTHONPATH", "PYTHONUNBUFFERED")}


def _start(request_env: dict[str, str]) -> subprocess.Popen:
    global _server_env
    env = dict(request_env, PYTHONPATH=str(HERE))
    _server_env = env
    proc = subprocess.Popen(
        [sys.executable, "-c", "import interp_server; interp_server.serve()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=str(HERE), bufsize=0,
    )
    proc.pending = b""  # bytes read past the last whole line
    ready = _readline(proc, time.monotonic() + 300)
    if json.loads(ready or "{}").get("ready") is not True:
        proc.kill()
        raise RuntimeError(f"interp_server did not start: {ready!r}")
    atexit.register(_stop, proc)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _readline(proc: subprocess.Popen, deadline: float | None) -> str | None:
    """The server's next line, or None at the deadline. Read by hand from the pipe: a buffered
    reader could hold the next line where select() does not see it."""
    fd = proc.stdout.fileno()
    while b"\n" not in proc.pending:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            data = os.read(fd, 65536)
            if not data:
                raise RuntimeError("interp_server exited")
            proc.pending += data
    line, _, proc.pending = proc.pending.partition(b"\n")
    return line.decode()


def run_script(args: list[str], env: dict[str, str], timeout: float, cwd: str | None = None,
               input: str | None = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True,
    timeout=timeout, cwd=cwd, input=input)`` for an interpreter script: ``args`` is a script's
    path and its arguments, or ``-c``, code and its arguments."""
    global _server
    if env.get("TRITON_INTERPRET") != "1":
        raise ValueError("interp_server runs interpreter scripts only (TRITON_INTERPRET=1)")
    with _lock, tempfile.TemporaryDirectory(prefix="interp-") as tmp:
        if _server is not None and _fixed(env) != _fixed(_server_env):
            _stop(_server)  # another value of a variable read at start: a server of its own
        if _server is None or _server.poll() is not None:
            _server = _start(env)
        out, err, stdin = (Path(tmp) / name for name in ("stdout", "stderr", "stdin"))
        stdin.write_text(input or "")
        request = dict(args=list(args), env=dict(env), cwd=cwd or os.getcwd(), out=str(out),
                       err=str(err), stdin=str(stdin))
        _server.stdin.write((json.dumps(request) + "\n").encode())
        pid = json.loads(_readline(_server, None))["pid"]
        line = _readline(_server, time.monotonic() + timeout)
        if line is None:  # past the timeout: the script and whatever it started
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _readline(_server, None)  # the server reaps it and reports
            raise subprocess.TimeoutExpired([sys.executable, *args], timeout,
                                            out.read_text(errors="replace"),
                                            err.read_text(errors="replace"))
        rc = json.loads(line)["rc"]
        return subprocess.CompletedProcess([sys.executable, *args], rc,
                                           out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


# -- the server -------------------------------------------------------------------------------
def serve() -> None:
    import gc
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    # the imported modules' objects out of the collector's reach: a child's collections would
    # otherwise walk (and so copy, page by page) all of them
    gc.collect()
    gc.freeze()
    # sys.path as a plain interpreter has it, without this server's script directory ("" for
    # -c) and PYTHONPATH's entries: each child puts its own in front
    own = {"", str(HERE), *os.environ.get("PYTHONPATH", "").split(os.pathsep)}
    base = [p for p in sys.path if p not in own]
    reply = sys.stdout
    reply.write(json.dumps({"ready": True}) + "\n")
    reply.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request, base)  # never returns
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status = os.waitpid(pid, 0)
        reply.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")
        reply.flush()
    os._exit(0)  # no interpreter teardown: the frozen modules would be reported as leaks


def _child(request: dict, base: list[str]) -> None:
    import io
    import runpy
    import traceback
    import types

    code = 1
    try:
        os.setsid()  # its own session: a timeout kills everything it started
        fd = os.open(request["stdin"], os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
        for target, path in ((1, request["out"]), (2, request["err"])):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, target)
            os.close(fd)
        env = request["env"]
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=unbuffered)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True,
                                      write_through=unbuffered)
        os.environ.clear()
        os.environ.update(env)
        # fresh entropy, as a new interpreter's: the server's generators are every child's
        import random

        import numpy

        random.seed()
        numpy.random.seed()
        os.chdir(request["cwd"])
        args = request["args"]
        first = "" if args[0] == "-c" else str(Path(args[0]).resolve().parent)
        extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [first, *extra, *base]
        try:
            if args[0] == "-c":
                sys.argv = ["-c", *args[2:]]
                main = types.ModuleType("__main__")
                sys.modules["__main__"] = main
                exec(compile(args[1], "<string>", "exec"), main.__dict__)
            else:
                sys.argv = list(args)
                runpy.run_path(args[0], run_name="__main__")
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException as exc:  # as Python reports an uncaught exception: the script's
            tb = exc.__traceback__  # frames only, not this module's or runpy's
            while tb is not None and (tb.tb_frame.f_code.co_filename == __file__
                                      or "runpy" in tb.tb_frame.f_code.co_filename):
                tb = tb.tb_next
            traceback.print_exception(type(exc), exc, tb)
            code = 1
        # what an exiting interpreter does: wait for non-daemon threads, run atexit handlers
        threading._shutdown()
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - exiting regardless
                pass
        os._exit(code)
