"""Issue 15's GPU check on 2 H200s, in one run under 9 minutes: the crash repro first, then the
emulated-node GPU tests, then the emulated benchmark at every chunk size, then a compact summary.

Run (repository root, 2 GPUs): python3 benchmarks/gpu_check_net.py [--budget 540]

Steps, each bounded by its own timeout and by what is left of ``--budget`` seconds (a step that
does not fit is recorded as skipped, never silently dropped):
1. build the native proxy (``pip install -e .``: the device gets a fresh tree every call);
2. the exact command of the crash: ``torchrun --nproc_per_node=2 benchmarks/bench_emulated.py
   --shapes 8192,8192,4096 --chunk-kib 1024`` (GEMM+AR, caps 50 and 0), fewer reps;
3. if it failed: the same at 1 MiB (cap 50) with one knob changed each time, to bisect the
   crash on the device: ``--warmup 0`` (no launch follows another without a host sync: the
   tests never launch back to back, the bench's warm-up does), ``MGRAPH_PROXY_BATCH=1`` (no
   merged WRITEs or raises) and ``MGRAPH_GPU_FLAGS=memop`` (no pinned staging words);
4. ``pytest -m multi_gpu tests/test_first_launch_meet.py`` (a rank held on its host past the
   watchdog before its first launch: the runtime's compile-and-meet), then ``pytest -m multi_gpu
   -k emulated tests/test_megakernel_gpu.py``;
5. proxy copy streams, 1 vs 4 (``Settings.proxy_streams``; step 2 is the 1-stream run): the
   fused GEMM+AR bench at 1 MiB (caps 50 and 0) with ``MGRAPH_PROXY_STREAMS=4``, then
   ``bench_proxy.py --quick --gpu-flags copy --streams 1 4`` (drains, latency, and bandwidth at
   256 KiB uncapped and capped, each with 1 and 4 streams);
6. the bench at 256 KiB and 4 MiB (cap 50), then GEMM+RS and AG+GEMM at 1 MiB (cap 50).
JSON: ``$OUT/gpu_check_net.json`` (OUT defaults to benchmarks/results), each bench's rows under
``$OUT/emulated_<kib>k*/``; the summary table is printed last (a failed fused row with every
rank's error: the first rank to fail is usually the cause).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = "8192,8192,4096"
ENV = {  # GPU.md: NVLink multicast is forbidden on these machines; keep it off in children too
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "CUDA_MODULE_LOADING": "EAGER",
    "PYTHONUNBUFFERED": "1",
}


def bench_cmd(kib: int, out: Path, *extra: str) -> list[str]:
    return ["torchrun", "--nproc_per_node=2", "benchmarks/bench_emulated.py", "--shapes", SHAPE,
            "--chunk-kib", str(kib), "--warmup", "2", "--reps", "5", "--out", str(out), *extra]


class Runner:
    def __init__(self, budget: float, out: Path) -> None:
        self.deadline = time.monotonic() + budget
        self.out = out
        self.steps: list[dict] = []

    def run(self, name: str, cmd: list[str], limit: float, env: dict[str, str] | None = None,
            rows: Path | None = None) -> dict:
        left = self.deadline - time.monotonic()
        step: dict = {"step": name, "cmd": " ".join(cmd), "env": env or {}}
        if left < 20:
            step.update(status="skipped", why=f"budget: {left:.0f} s left")
            self.steps.append(step)
            print(f"== {name}: skipped ({left:.0f} s left)", flush=True)
            return step
        limit = min(limit, left - 5)
        print(f"== {name} (<= {limit:.0f} s): {step['cmd']}", flush=True)
        start = time.monotonic()
        # Own session: on timeout the whole group goes (torchrun's workers hold the GPUs).
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **ENV, **(env or {})},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            text, _ = proc.communicate(timeout=limit)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            rc = 124
        step.update(status="ok" if rc == 0 else "failed", rc=rc,
                    seconds=round(time.monotonic() - start, 1))
        if rc != 0:  # what killed it: the lines naming errors, then the tail
            lines = text.splitlines()
            step["errors"] = [ln for ln in lines if "Error" in ln or "error" in ln][-12:]
            step["tail"] = "\n".join(lines[-40:])
        else:
            step["tail"] = "\n".join(text.splitlines()[-6:])
        if rows is not None and (rows / "bench_emulated.json").exists():
            step["rows"] = json.loads((rows / "bench_emulated.json").read_text())
        self.steps.append(step)
        print(f"   -> {step['status']} rc={rc} in {step['seconds']} s", flush=True)
        if rc != 0:
            print(step["tail"][-3000:], flush=True)
        return step


def summary(steps: list[dict]) -> str:
    lines = ["| step | status | s | op | chunk | NIC | fused ms | ce_paced ms | model ms | "
             "speedup vs faster | net GB/s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in steps:
        heads = [r for r in s.get("rows", []) if r.get("impl") == "mgraph_fused"]
        if not heads:
            lines.append(f"| {s['step']} | {s['status']} | {s.get('seconds', '-')} | | | | | | | | |")
            continue
        for r in heads:
            nic = f"{r['nic_gbps']:g}" if r["nic_gbps"] else "uncapped"
            if r.get("error"):  # every rank's, shortened: which one failed first matters
                errs = r.get("errors") or {"?": r["error"]}
                r = {**r, "ms": "; ".join(f"rank {k}: {e[:160]}" for k, e in errs.items())}
            lines.append(
                f"| {s['step']} | {s['status']} | {s.get('seconds', '-')} | {r['op']} | "
                f"{r.get('chunk_kib', '-')} KiB | {nic} | {r.get('ms')} | {r.get('ce_paced_ms')} | "
                f"{r.get('model_ms')} | {r.get('speedup')} | {r.get('net_gbps')} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for everything")
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = parser.parse_args(argv)
    out = Path(args.out)
    if not out.is_absolute():
        out = ROOT / out
    out.mkdir(parents=True, exist_ok=True)
    run = Runner(args.budget, out)
    run.run("build", [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation",
                      "--no-deps", "-e", "."], 90)
    crash = run.run("crash_1m", bench_cmd(1024, out / "emulated_1024k",
                                          "--ops", "gemm_allreduce"),
                    75, rows=out / "emulated_1024k")
    if crash["status"] != "ok":
        for name, env, extra in [
            ("crash_1m_warmup0", {}, ["--warmup", "0"]),  # no back-to-back launches
            ("crash_1m_batch1", {"MGRAPH_PROXY_BATCH": "1"}, []),
            ("crash_1m_memop", {"MGRAPH_GPU_FLAGS": "memop"}, []),
        ]:
            run.run(name, bench_cmd(1024, out / f"emulated_1024k_{name}", "--ops",
                                    "gemm_allreduce", "--nic-gbps", "50", *extra),
                    55, env, rows=out / f"emulated_1024k_{name}")
    run.run("tests_first_launch", [sys.executable, "-m", "pytest", "-q", "-x", "-m", "multi_gpu",
                                   "tests/test_first_launch_meet.py"], 90)
    run.run("tests_emulated", [sys.executable, "-m", "pytest", "-q", "-x", "-m", "multi_gpu",
                               "-k", "emulated", "tests/test_megakernel_gpu.py"], 160)
    run.run("ar_1m_streams4", bench_cmd(1024, out / "emulated_1024k_streams4", "--ops",
                                        "gemm_allreduce"),
            75, {"MGRAPH_PROXY_STREAMS": "4"}, rows=out / "emulated_1024k_streams4")
    run.run("bench_proxy_streams", [sys.executable, "benchmarks/bench_proxy.py", "--out",
                                    str(out / "bench_proxy_streams"), "--quick", "--gpu-flags",
                                    "copy", "--streams", "1", "4"], 120)
    for kib in (256, 4096):
        run.run(f"ar_{kib}k", bench_cmd(kib, out / f"emulated_{kib}k", "--ops", "gemm_allreduce",
                                        "--nic-gbps", "50"), 60, rows=out / f"emulated_{kib}k")
    run.run("rs_ag_1m", bench_cmd(1024, out / "emulated_1024k_rs_ag", "--ops",
                                  "gemm_reduce_scatter", "allgather_gemm", "--nic-gbps", "50"),
            70, rows=out / "emulated_1024k_rs_ag")
    (out / "gpu_check_net.json").write_text(json.dumps(run.steps, indent=1))
    table = summary(run.steps)
    (out / "gpu_check_net.md").write_text(table + "\n")
    print(table, flush=True)
    return 0 if all(s["status"] != "failed" for s in run.steps) else 1


if __name__ == "__main__":
    sys.exit(main())
