"""Tensor-parallel Llama MLP: ``down(silu(gate(x)) * up(x))``, column-parallel then row-parallel.

The plan uses torch.distributed.tensor.parallel's vocabulary. gate_proj and up_proj shard their
output features (a local GEMM each: the replicated input needs no communication), SiLU and the
product run on each rank's columns, and down_proj shards its input features: its partial sums
are reduced by the fused GEMM+AllReduce, hierarchically over NVLink and RDMA.

    python examples/tp_mlp.py            # 2 nodes x 2 GPUs, on the CPU reference backend
    torchrun --nproc_per_node=2 examples/tp_mlp.py --gpu   # the megakernel, one process per GPU

With ``--gpu`` every rank builds the same bf16 model, passes the whole input (ColwiseParallel
reads it replicated, as under parallelize_module) and gets the whole output back (the
row-parallel result is replicated), checked against eager torch on its GPU.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import mgraph as mg


class LlamaMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


PLAN = {
    "gate_proj": mg.ColwiseParallel(),
    "up_proj": mg.ColwiseParallel(),
    "down_proj": mg.RowwiseParallel(),
}


def main(topology: str = "2x2", backend: str = "reference") -> float:
    torch.manual_seed(0)
    model = LlamaMLP(hidden=128, ffn=256).eval()
    x = torch.randn(2, 32, 128)
    prog = mg.compile(model, (x,), plan=PLAN, topology=topology, backend=backend)
    got = prog(x)
    with torch.no_grad():
        want = model(x)
    err = ((got - want).norm() / want.norm()).item()
    print(prog)
    print(prog.opgraph.to_text())
    print(f"relative error vs eager torch: {err:.2e}")
    assert err < 1e-4, err
    return err


# The same plan on GPUs: down_proj's all-reduce is its GEMM epilogue's reduce-add into both
# GPUs' outputs (gemm_allreduce's default on 2 GPUs).
GPU_PLAN = PLAN


def main_gpu() -> float:
    """Under torchrun: the Program on backend="triton", SPMD, against eager torch (bf16)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        torch.manual_seed(0)  # the same weights and input on every rank
        model = LlamaMLP(hidden=1024, ffn=4096).to("cuda", torch.bfloat16).eval()
        x = torch.randn(2, 256, 1024, device="cuda", dtype=torch.bfloat16)
        prog = mg.compile(model, (x,), plan=GPU_PLAN, topology=f"1x{world}", backend="triton")
        with torch.no_grad():
            want = model(x).float()
        # relaunches reuse the rank's runtime; on one GPU a call returns without waiting for
        # its kernel (as an eager module's does), so the three are issued back to back
        outs = [prog(x) for _ in range(3)]
        prog.synchronize()  # waits for them: a watchdog timeout in any of them is raised here
        errs = [((got.float() - want).norm() / want.norm()).item() for got in outs]
        if rank == 0:
            print(prog)
            print(f"relative error vs eager torch (bf16), 3 calls: {max(errs):.2e}")
        assert max(errs) < 2e-2, errs
        return max(errs)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main_gpu() if "--gpu" in sys.argv[1:] else main()
