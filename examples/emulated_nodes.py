"""GEMM+AllReduce across nodes, with the GPUs of one host acting as nodes.

Topology "2x1" is two nodes of one GPU: every byte between the ranks crosses the "network". On
the megakernel (backend triton) an RDMA worker pushes each chunk's command into a FIFO in pinned
host memory, the rank's native host proxy copies the chunk into the peer with the copy engine,
paced like a NIC of ``--nic-gbps``, and raises the peer's flag; the consumer tiles wait for it.

    python examples/emulated_nodes.py                                  # CPU reference backend
    torchrun --nproc_per_node=2 examples/emulated_nodes.py --gpu --nic-gbps 50   # 2 GPUs

Chunks of 1 MiB or more keep the proxy ahead of a 50 GB/s link (benchmarks/NOTES.md: a command
costs the proxy ~17 us whatever its size).
"""

from __future__ import annotations

import argparse

import torch

import mgraph as mg


def main(topology: str = "2x1", backend: str = "reference") -> float:
    """One fused GEMM+AllReduce on ``topology`` (fp32, CPU backends), checked against torch."""
    graph = mg.ops.gemm_allreduce(M=128, N=128, K=256, topology=topology, tile=[32, 32])
    op = mg.ops.get_op("gemm_allreduce")
    inputs = op.random_inputs(graph, seed=0)
    got = mg.run(mg.schedule(graph), inputs, backend=backend).outputs["out"]
    want = inputs["a"] @ inputs["b"]
    err = ((got - want).norm() / want.norm()).item()
    stats = graph.stats()
    print(f"{graph.op} on {topology}: {len(graph.tasks)} tasks, bytes per link class "
          f"{stats.bytes_by_link}, RDMA bytes sent per node {stats.rdma_sent_per_node}")
    print(f"relative error vs torch: {err:.2e}")
    assert err < 1e-4, err
    return err


def main_gpu(nic_gbps: float, chunk_kib: int) -> None:
    """SPMD under torchrun: each rank passes its local shards and gets its local output."""
    import os

    import torch.distributed as dist

    from mgraph.runtime.megakernel import TritonRuntime, local_shards
    from mgraph.settings import Settings

    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # GPU.md: lazy loading vs spinning
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    graph = mg.ops.gemm_allreduce(M=4096, N=4096, K=4096, topology="2x1", dtype=torch.bfloat16,
                                  chunk_bytes=chunk_kib * 1024)
    inputs = mg.ops.get_op("gemm_allreduce").random_inputs(graph, seed=0)
    local = {k: v.cuda() for k, v in local_shards(graph, rank, inputs).items()}
    want = local["a"].float() @ local["b"].float()
    dist.all_reduce(want)
    with TritonRuntime(mg.schedule(graph), settings=Settings(nic_gbps=nic_gbps)) as rt:
        got = rt.run(local).outputs["out"].float()
    err = ((got - want).norm() / want.norm()).item()
    print(f"rank {rank}: relative error vs torch (bf16): {err:.2e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="the megakernel, under torchrun")
    parser.add_argument("--nic-gbps", type=float, default=50.0, help="0: uncapped")
    parser.add_argument("--chunk-kib", type=int, default=1024)
    args = parser.parse_args()
    if args.gpu:
        main_gpu(args.nic_gbps, args.chunk_kib)
    else:
        main()
