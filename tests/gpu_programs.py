"""Programs on backend="triton" on real GPUs, run by the lead on 2 H200:

    torchrun --nproc_per_node=2 tests/gpu_programs.py     # writes $OUT/gpu_programs.json

Every case is a traced module compiled with mg.compile(..., backend="triton") and checked against
eager torch on the same GPU (bf16, relative error < 2e-2 over the output and over each 64-row
tile, three calls each: relaunches reuse the
runtime). Rank 0 alone runs the 1-GPU cases (topology 1x1, global tensors); both ranks run the
SPMD cases (the convention of mgraph/program.py: whole inputs for tensor parallelism, sequence
chunks for sequence parallelism). One JSON row per case; "FAIL" in a row's status fails the run.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # GPU.md: lazy loading can deadlock
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]

from test_program_triton import chain_case, ewise_tasks_per_tile  # noqa: E402
from test_rowwise_gpu import RowOps  # noqa: E402

import mgraph as mg  # noqa: E402

TOL = 2e-2
BF16 = torch.bfloat16


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def worst_tile(got: torch.Tensor, want: torch.Tensor) -> float:
    """The worst 64-row tile's relative error over the output's rows (a racy or unwritten tile
    shows here when the whole output's norm hides it)."""
    from mgraph.runtime.memory import worst_tile_error

    cols = want.shape[-1]
    return worst_tile_error(got.reshape(-1, cols), want.reshape(-1, cols), rows=64,
                            cols=min(128, cols))


def check(prog: mg.Program, model: nn.Module, args: tuple, local=None) -> dict:
    """Three calls against eager torch in fp32 on the same bf16 inputs (eager bf16 rounds every
    intermediate of a chain, the fused body none: fp32 is the fair reference for both), then
    three issued back to back before one synchronize;
    ``local(args, out)`` -> (this rank's args, its output as the convention returns it)."""
    import copy

    exact = copy.deepcopy(model).float()
    errs = []
    for call in range(3):
        scaled = tuple(a * (1.0 - 0.25 * call) for a in args)
        with torch.no_grad():
            want = exact(*(a.float() for a in scaled))
        mine, want = local(scaled, want) if local else (scaled, want)
        start = time.perf_counter()
        got = prog(*mine)
        torch.cuda.synchronize()
        errs.append(max(rel(got, want), worst_tile(got, want)))
    # Calls issued back to back (they do not wait for their kernels, one GPU or SPMD): each
    # output must stay its own call's while the later launches rewrite the buffers
    burst = [tuple(a * (0.5 + 0.25 * call) for a in args) for call in range(3)]
    wants, gots = [], []
    for scaled in burst:
        with torch.no_grad():
            want = exact(*(a.float() for a in scaled))
        mine, want = local(scaled, want) if local else (scaled, want)
        wants.append(want)
        gots.append(prog(*mine))
    prog.synchronize()
    errs += [max(rel(got, want), worst_tile(got, want)) for got, want in zip(gots, wants, strict=True)]
    has_ewise = any(t.kind == "ewise" for t in prog.graph.tasks)
    return {
        "error": max(errs),
        "last_call_s": time.perf_counter() - start,
        "tasks": len(prog.graph.tasks),
        "ewise_per_tile": ewise_tasks_per_tile(prog) if has_ewise else None,
    }


def one_gpu_cases() -> dict:
    from tp_mlp import PLAN, LlamaMLP

    cases = {}
    torch.manual_seed(0)
    model = LlamaMLP(hidden=1024, ffn=4096).to("cuda", BF16).eval()
    x = torch.randn(2, 256, 1024, device="cuda", dtype=BF16)
    cases["mlp-1x1"] = lambda: check(
        mg.compile(model, (x,), plan=PLAN, backend="triton"), model, (x,)
    )
    for seed in range(3):

        def chain(seed=seed):
            m, args = chain_case(seed, shape=(2, 256, 1024))
            m = m.to("cuda", BF16)
            args = tuple(a.to("cuda", BF16) for a in args)
            return check(mg.compile(m, args, backend="triton"), m, args)

        cases[f"chain-1x1-{seed}"] = chain
    cases["custom-1x1"] = custom_case
    cases["rowops-1x1"] = rowops_case
    return cases


def rowops_case() -> dict:
    torch.manual_seed(1)
    model = RowOps(1024).to("cuda", BF16).eval()
    x = torch.randn(2, 1024, 1024, device="cuda", dtype=BF16)
    prog = mg.compile(model, (x,), backend="triton")
    kinds = {t.kind for t in prog.graph.tasks}
    assert {"layer_norm", "softmax", "row_reduce"} <= kinds, kinds
    return check(prog, model, (x,))


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mgraph.ops.abi import F_READ0, F_WRITE0, load_region, param_f32  # noqa: E402
from mgraph.ops.tilewise import tile_ptrs  # noqa: E402

_READ0, _WRITE0 = tl.constexpr(F_READ0), tl.constexpr(F_WRITE0)


@triton.jit
def scaled_residual(
    tp, params, regions, bufaddr, bufcols, DT: tl.constexpr, RB_M: tl.constexpr, RB_N: tl.constexpr
):
    """out = x + scale * y over the task's row tile (a user op's triton= body)."""
    r0 = tl.load(tp + _READ0)
    w0 = tl.load(tp + _WRITE0)
    scale = param_f32(params, tp, 0)
    _s, m0, m1, n0, n1 = load_region(regions, r0)
    for i in range(0, m1 - m0, RB_M):
        for j in range(0, n1 - n0, RB_N):
            om = i + tl.arange(0, RB_M)
            on = j + tl.arange(0, RB_N)
            mask = (om < m1 - m0)[:, None] & (on < n1 - n0)[None, :]
            x = tl.load(tile_ptrs(regions, bufaddr, bufcols, r0, om, on, DT), mask=mask)
            y = tl.load(tile_ptrs(regions, bufaddr, bufcols, r0 + 1, om, on, DT), mask=mask)
            out = x.to(tl.float32) + scale * y.to(tl.float32)
            tl.store(tile_ptrs(regions, bufaddr, bufcols, w0, om, on, DT), out.to(DT), mask=mask)


def custom_case() -> dict:
    """register_op(..., triton=body): the user's body runs in the megakernel."""

    @mg.register_op("gpu_scaled_residual", triton=scaled_residual, whole_rows=False)
    def op(x: torch.Tensor, y: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
        return x + scale * y

    class M(nn.Module):
        def forward(self, x, y):
            return op(x, y, 0.75)

    args = tuple(torch.randn(2, 128, 512, device="cuda", dtype=BF16) for _ in range(2))
    prog = mg.compile(M(), args, backend="triton")
    return check(prog, M(), args)


def spmd_cases(rank: int, world: int) -> dict:
    import transformer_block as tb
    from tp_mlp import GPU_PLAN, LlamaMLP

    cases = {}

    def mlp() -> dict:
        torch.manual_seed(0)
        model = LlamaMLP(hidden=1024, ffn=4096).to("cuda", BF16).eval()
        x = torch.randn(2, 256, 1024, device="cuda", dtype=BF16)
        prog = mg.compile(model, (x,), plan=GPU_PLAN, topology=f"1x{world}", backend="triton")
        return check(prog, model, (x,))  # whole input in, whole output back

    def block() -> dict:
        torch.manual_seed(0)
        model = tb.Block(hidden=1024, heads=8, ffn=4096).to("cuda", BF16).eval()
        x = torch.randn(1, 512, 1024, device="cuda", dtype=BF16)
        prog = mg.compile(model, (x,), plan=tb.gpu_plan(), topology=f"1x{world}", backend="triton")
        return check(
            prog,
            model,
            (x,),
            lambda a, out: ((a[0].chunk(world, 1)[rank],), out.chunk(world, 1)[rank]),
        )

    def chain() -> dict:
        m, args = chain_case(3, shape=(2, 256, 1024))
        m = m.to("cuda", BF16)
        args = tuple(a.to("cuda", BF16) for a in args)
        return check(mg.compile(m, args, topology=f"1x{world}", backend="triton"), m, args)

    def llama(heads: int, kv_heads: int, tokens: int, seed: int) -> dict:
        import llama_block as lb

        torch.manual_seed(seed)
        model = lb.DecoderBlock(hidden=512, heads=heads, kv_heads=kv_heads, ffn=1024)
        model = model.to("cuda", BF16).eval()
        x = torch.randn(1, tokens, 512, device="cuda", dtype=BF16)
        prog = mg.compile(model, (x,), plan=lb.block_plan(), topology=f"1x{world}",
                          backend="triton")
        (att,) = [n for n in prog.lowered.nodes if n.op == "attention"]
        assert att.params.get("kv_heads", heads) == kv_heads, att.params
        return check(
            prog,
            model,
            (x,),
            lambda a, out: ((a[0].chunk(world, 1)[rank],), out.chunk(world, 1)[rank]),
        )

    def llama_gqa() -> dict:
        """A Llama block whose KV heads are fewer than the ranks (1 KV head of 128 over 2+
        ranks): each rank's attention binds the KV head its query heads share (v21)."""
        return llama(heads=4, kv_heads=1, tokens=512, seed=0)

    def llama_gqa_pruned() -> dict:
        """8 heads, 2 KV heads: from 4 ranks on, two ranks share a KV head and k's columns are
        cut mid-head, so k is gathered and each rank's split and RoPE of the other KV head
        are pruned (mgraph/prune.py, v22)."""
        return llama(heads=8, kv_heads=2, tokens=1024, seed=1)

    cases[f"mlp-1x{world}"] = mlp
    cases[f"block-sp-1x{world}"] = block
    cases[f"llama-gqa-1x{world}"] = llama_gqa
    cases[f"llama-gqa-pruned-1x{world}"] = llama_gqa_pruned
    cases[f"chain-1x{world}"] = chain
    return cases


def run(cases: dict, rank: int) -> list[dict]:
    # GPU_PROGRAMS_CASES=name,name: only those cases (a short device call re-running a few)
    only = [c for c in os.environ.get("GPU_PROGRAMS_CASES", "").split(",") if c]
    rows = []
    for name, fn in cases.items():
        if only and name not in only:
            continue
        try:
            row = {"case": name, **fn()}
            row["status"] = "ok" if row["error"] < TOL else "FAIL (error)"
        except Exception as exc:  # noqa: BLE001 - one broken case must not hide the others
            row = {
                "case": name,
                "status": f"FAIL {type(exc).__name__}: {str(exc)[:300]}",
                "trace": traceback.format_exc()[-1500:],
            }
        row["rank"] = rank
        print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
        rows.append(row)
    return rows


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from gpu_workers import join_group

    join_group(int(os.environ.get("LOCAL_RANK", rank)))  # MGRAPH_TEST_SHARE_GPU: see there
    rows = run(one_gpu_cases(), rank) if rank == 0 else []
    dist.barrier()
    rows += run(spmd_cases(rank, world), rank)
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    dist.destroy_process_group()
    if rank == 0:
        out = Path(os.environ.get("OUT", "."))
        out.mkdir(parents=True, exist_ok=True)
        flat = [r for rs in everyone for r in rs]
        (out / "gpu_programs.json").write_text(json.dumps(flat, indent=1))
        failed = [r["case"] for r in flat if r["status"] != "ok"]
        print(f"gpu_programs: {len(flat) - len(failed)}/{len(flat)} ok; failed: {failed}")
    return 0 if all(r["status"] == "ok" for rs in everyone for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
