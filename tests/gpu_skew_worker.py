"""Process body for tests/test_first_launch_meet.py's multi-GPU test (spawned with
torch.multiprocessing): one rank of a 2x1 emulated GEMM+AR whose rank 1 is held up on its host
for longer than the watchdog before its first launch, as a rank still compiling was in issue 15."""

from __future__ import annotations

import time


def skewed_first_launch(rank: int, world: int, port: int, hold_s: float, watchdog_s: float,
                        queue) -> None:  # fmt: skip
    import faulthandler

    faulthandler.enable()
    faulthandler.dump_traceback_later(240, exit=True)
    try:
        from gpu_workers import _local_reference, setup

        setup(rank, world, port)
        import torch
        import torch.distributed as dist

        import mgraph as mg
        from mgraph.runtime.megakernel import TritonRuntime, local_shards
        from mgraph.settings import Settings

        op = mg.ops.get_op("gemm_allreduce")
        graph = op(topology="2x1", dtype=torch.bfloat16, M=1024, N=768, K=1024, tile=[128, 128])
        rt = TritonRuntime(mg.schedule(graph), settings=Settings(watchdog_s=watchdog_s))
        inputs = op.random_inputs(graph, seed=0)
        local = {k: v.cuda() for k, v in local_shards(graph, rank, inputs).items()}
        if rank == 1:
            time.sleep(hold_s)  # a peer still compiling, or building its runtime
        out = rt.run(local).outputs["out"].float()
        ref = {k: v.cuda().float() for k, v in inputs.items()}
        want = _local_reference(graph, rank, op.run_reference(ref, graph.params)["out"])
        err = ((out - want).norm() / want.norm()).item()
        rt.close()
        dist.barrier()
        queue.put((rank, err, None))
        faulthandler.cancel_dump_traceback_later()
        dist.destroy_process_group()
    except BaseException:  # reported to the parent test
        import traceback

        queue.put((rank, None, traceback.format_exc()))
