"""A pre-norm transformer block (RMSNorm, causal attention, Llama MLP, residuals) with tensor
and sequence parallelism.

Plan: the norms run on a shard of the tokens (SequenceParallel); every column-parallel linear
meets a token-sharded input, so it becomes the fused AllGather+GEMM; every row-parallel linear
feeds a sequence-parallel region, so it becomes the fused GEMM+ReduceScatter. Attention runs on
each rank's heads (the q/k/v projections shard them) and reads the head split and writes the
merge in place, in the projections' [tokens, heads x head_dim] layout (no relayout task); the
residual adds stay token-sharded. One TaskGraph holds the whole block, so the
next op's tiles start while the previous op's collective is still moving data.

    python examples/transformer_block.py
    torchrun --nproc_per_node=2 examples/transformer_block.py --gpu   # the megakernel

With ``--gpu`` every rank builds the same bf16 block and passes its chunk of the sequence
(``x.chunk(world, 1)[rank]``, what SequenceParallel reads under parallelize_module); it gets its
chunk of the output back, checked against the same chunk of eager torch's output.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import mgraph as mg


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, H = x.shape
        q = self.q_proj(x).view(B, S, self.heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(B, S, self.heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, S, self.heads, -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, S, H))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, hidden: int = 128, heads: int = 4, ffn: int = 256) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(hidden)
        self.attn = Attention(hidden, heads)
        self.mlp_norm = nn.RMSNorm(hidden)
        self.mlp = MLP(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x))
        return h + self.mlp(self.mlp_norm(h))


def block_plan(
    prefix: str = "", sequence_parallel: bool = True
) -> dict[str, mg.plans.ParallelStyle]:
    """The tensor(+sequence)-parallel plan of one Block whose path is ``prefix``."""
    plan = {
        f"{prefix}attn.q_proj": mg.ColwiseParallel(),
        f"{prefix}attn.k_proj": mg.ColwiseParallel(),
        f"{prefix}attn.v_proj": mg.ColwiseParallel(),
        f"{prefix}attn.o_proj": mg.RowwiseParallel(),
        f"{prefix}mlp.gate_proj": mg.ColwiseParallel(),
        f"{prefix}mlp.up_proj": mg.ColwiseParallel(),
        f"{prefix}mlp.down_proj": mg.RowwiseParallel(),
    }
    if sequence_parallel:
        plan[f"{prefix}attn_norm"] = mg.SequenceParallel()
        plan[f"{prefix}mlp_norm"] = mg.SequenceParallel()
    return plan


def main(topology: str = "2x2", backend: str = "reference") -> float:
    torch.manual_seed(0)
    model = Block().eval()
    x = torch.randn(1, 64, 128)
    prog = mg.compile(model, (x,), plan=block_plan(), topology=topology, backend=backend)
    got = prog(x)
    with torch.no_grad():
        want = model(x)
    err = ((got - want).norm() / want.norm()).item()
    print(prog)
    print(prog.opgraph.to_text())
    stats = prog.graph.stats()
    print("tasks per (role, kind):", dict(stats.by_role_kind()))
    print(f"relative error vs eager torch: {err:.2e}")
    assert err < 1e-4, err
    return err


def gpu_plan() -> dict[str, mg.plans.ParallelStyle]:
    """block_plan() as it is: on 2 GPUs the row-parallel GEMMs' reduce-scatter is their
    epilogue's reduce-add into the row owner's output (the default)."""
    return block_plan()


def main_gpu() -> float:
    """Under torchrun: the Program on backend="triton", SPMD, against eager torch (bf16)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        torch.manual_seed(0)  # the same weights and input on every rank
        model = Block(hidden=1024, heads=8, ffn=4096).to("cuda", torch.bfloat16).eval()
        x = torch.randn(1, 512, 1024, device="cuda", dtype=torch.bfloat16)
        prog = mg.compile(model, (x,), plan=gpu_plan(), topology=f"1x{world}", backend="triton")
        with torch.no_grad():
            want = model(x).float().chunk(world, 1)[rank]
        errs = []
        for _ in range(3):  # relaunches reuse the rank's runtime
            got = prog(x.chunk(world, 1)[rank])
            errs.append(((got.float() - want).norm() / want.norm()).item())
        if rank == 0:
            print(prog)
            print(f"relative error vs eager torch (bf16), 3 calls: {max(errs):.2e}")
        assert max(errs) < 2e-2, errs
        return max(errs)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main_gpu() if "--gpu" in sys.argv[1:] else main()
