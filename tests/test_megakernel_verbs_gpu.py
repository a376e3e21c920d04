"""``MGRAPH_TRANSPORT=verbs`` on two GPUs (`pytest -m multi_gpu`), one process per rank as
under torchrun: each rank builds a 2x1 GEMM+AllReduce runtime with ``Settings(transport=
"verbs")``. On a host without an RDMA device (the project's H200 machines) both ranks must get
RdmaUnavailableError while the runtime is built, before any launch, and neither may hang. On a
host with one, the run must match torch (it has not run on such a host yet)."""

from __future__ import annotations

import random

import pytest

TOL = 2e-2  # bf16 inputs and outputs


def _rank(rank: int, world: int, port: int, queue) -> None:
    import faulthandler
    import traceback

    faulthandler.dump_traceback_later(240, exit=True)  # a hang shows its stacks in the log
    try:
        import gpu_workers

        gpu_workers.setup(rank, world, port)
        import torch
        import torch.distributed as dist

        import mgraph as mg
        from mgraph.errors import RdmaUnavailableError
        from mgraph.runtime.megakernel import TritonRuntime, local_shards
        from mgraph.settings import Settings

        op = mg.ops.get_op("gemm_allreduce")
        graph = op(topology="2x1", dtype=torch.bfloat16, M=1024, N=1024, K=1024)
        try:
            rt = TritonRuntime(mg.schedule(graph), settings=Settings(transport="verbs"))
        except RdmaUnavailableError as exc:
            queue.put((rank, "unavailable", str(exc)))
            dist.barrier()
            dist.destroy_process_group()
            return
        worst = 0.0
        for i in range(2):
            inputs = op.random_inputs(graph, seed=i)
            full = op.run_reference({k: v.cuda().float() for k, v in inputs.items()}, graph.params)[
                "out"
            ]
            local = {k: v.cuda() for k, v in local_shards(graph, rank, inputs).items()}
            got = rt.run(local).outputs["out"].float()
            want = gpu_workers._local_reference(graph, rank, full)
            worst = max(worst, ((got - want).norm() / want.norm()).item())
        rt.close()
        dist.barrier()
        queue.put((rank, "ran", worst))
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.mark.multi_gpu(2)
def test_verbs_selection_on_two_gpus() -> None:
    import rank_reports
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = random.randint(20000, 40000)
    procs = [ctx.Process(target=_rank, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = rank_reports.collect(queue, procs, timeout=300)
    failed = rank_reports.failures(results, failed=lambda r: r[1] in ("error", None))
    assert not failed, failed
    outcomes = {what for _, what, _ in results}
    assert len(outcomes) == 1, results  # both ranks alike: no half-built network
    if outcomes == {"unavailable"}:
        for _, _, message in results:
            assert "no RDMA device" in message or "cannot load libibverbs" in message, message
    else:
        for rank, _, err in results:
            assert err < TOL, (rank, err)
