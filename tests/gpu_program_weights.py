"""A Program's weights stay in the megakernel's buffers between calls, on real GPUs; run by the
lead on 2 H200:

    torchrun --nproc_per_node=2 tests/gpu_program_weights.py   # writes $OUT/gpu_program_weights.json

A SwiGLU MLP (bf16) compiled with backend="triton" on 1 GPU (rank 0, global tensors) and SPMD on
2 (both ranks, whole input, tensor parallel), called while its input and weights change between
calls: each call against eager torch in fp32 (relative error < 2e-2) and with the weights it
must copy (those torch saw change; the input every call). Then the steady call's time against
its megakernel relaunched alone (CUDA events, medians): what a call costs outside the kernel.
One JSON row per case; "FAIL" in a row's status fails the run.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import traceback
from collections import Counter
from pathlib import Path

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # GPU.md: lazy loading can deadlock
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]

import mgraph as mg  # noqa: E402
from helpers import rel_err  # noqa: E402
from mgraph.runtime.megakernel import calls as calls_module  # noqa: E402
from mgraph.runtime.megakernel import runtime as rt_module  # noqa: E402

TOL = 2e-2
BF16 = torch.bfloat16
COPIES: Counter = Counter()


def count_copies() -> None:
    """Count the input tensors cut for the kernel's buffers, by name (one buffer_shard call per
    buffer loaded on one rank; one per name SPMD, where local_shards cuts them)."""
    shard = calls_module.buffer_shard

    def counted(buf, inputs):
        COPIES[buf.binding.tensor] += 1
        return shard(buf, inputs)

    # both names: the runtime's load (one process) and calls.local_shards (SPMD), which since
    # calls.py was split out of runtime.py call their own module's binding
    rt_module.buffer_shard = counted
    calls_module.buffer_shard = counted


def events_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def case(world: int) -> list[dict]:
    from tp_mlp import GPU_PLAN, LlamaMLP

    gen = torch.Generator(device="cuda").manual_seed(0)  # the same on every rank

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(BF16)

    torch.manual_seed(0)
    model = LlamaMLP(hidden=1024, ffn=4096).to("cuda", BF16).eval()
    x = randn(2, 256, 1024)
    plan = GPU_PLAN if world > 1 else None
    prog = mg.compile(model, (x,), plan=plan, topology=f"1x{world}", backend="triton")
    weights = {f"{n}.weight.T" for n in ("gate_proj", "up_proj", "down_proj")}
    rows = []

    def call(step: str, x: torch.Tensor, copied: set[str]) -> None:
        COPIES.clear()
        with torch.no_grad():
            want = copy.deepcopy(model).float()(x.float())
        got = prog(x)
        torch.cuda.synchronize()
        row = {"case": f"mlp-1x{world}", "step": step, "error": rel_err(got, want),
               "copies": dict(COPIES)}
        ok = row["error"] < TOL and COPIES == Counter({"x": 1, **dict.fromkeys(copied, 1)})
        row["status"] = "ok" if ok else "FAIL"
        rows.append(row)

    call("first", x, weights)
    call("new-input", randn(2, 256, 1024), set())
    call("same-input", x, set())
    with torch.no_grad():
        model.up_proj.weight.mul_(-0.5)
    call("in-place", x, {"up_proj.weight.T"})
    model.down_proj.weight = nn.Parameter(randn(1024, 4096, scale=4096**-0.5))
    call("new-parameter", x, {"down_proj.weight.T"})
    model.gate_proj.weight.data = randn(4096, 1024, scale=1024**-0.5)
    call("data-assigned", x, {"gate_proj.weight.T"})
    call("steady", x, set())
    runtime = prog._runtime  # Program has no public accessor for it
    call_ms = events_ms(lambda: prog(x))
    kernel_ms = events_ms(runtime.launch)
    rows.append({"case": f"mlp-1x{world}", "step": "timing", "call_ms": call_ms,
                 "kernel_ms": kernel_ms, "outside_ms": call_ms - kernel_ms, "status": "ok"})
    return rows


def run(world: int, rank: int) -> list[dict]:
    try:
        rows = case(world)
    except Exception as exc:  # noqa: BLE001 - reported as a row, the other case still runs
        rows = [{"case": f"mlp-1x{world}", "status": f"FAIL {type(exc).__name__}: "
                 f"{str(exc)[:300]}", "trace": traceback.format_exc()[-1500:]}]
    for row in rows:
        row["rank"] = rank
        print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
    return rows


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from gpu_workers import join_group

    join_group(int(os.environ.get("LOCAL_RANK", rank)))  # MGRAPH_TEST_SHARE_GPU: see there
    count_copies()
    rows = run(1, rank) if rank == 0 else []
    dist.barrier()
    if world > 1:
        rows += run(world, rank)
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    dist.destroy_process_group()
    flat = [r for rs in everyone for r in rs]
    if rank == 0:
        out = Path(os.environ.get("OUT", "."))
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_program_weights.json").write_text(json.dumps(flat, indent=1))
        failed = [(r["case"], r.get("step")) for r in flat if r["status"] != "ok"]
        print(f"gpu_program_weights: {len(flat) - len(failed)}/{len(flat)} ok; failed: {failed}")
    return 0 if all(r["status"] == "ok" for r in flat) else 1


if __name__ == "__main__":
    sys.exit(main())
