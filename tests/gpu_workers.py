"""Process bodies for the multi-GPU tests (spawned with torch.multiprocessing): each process is one
rank, runs the op on backend triton with its local shards, and checks against torch."""

from __future__ import annotations

import os


def setup(rank: int, world: int, port: int) -> None:
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # GPU.md: lazy loading can deadlock
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    join_group(rank, rank=rank, world_size=world)


def join_group(local_rank: int, **group: object) -> None:
    """This process's GPU and process group: NCCL on GPU ``local_rank``; or, with
    MGRAPH_TEST_SHARE_GPU=1, every rank on one GPU (correctness only: the processes' kernels
    time-slice) in a gloo group, since NCCL refuses two ranks on one device and the runtime
    needs only the group's barrier and store (it maps peers through CUDA IPC: ipc_share.py)."""
    import torch
    import torch.distributed as dist

    if os.environ.get("MGRAPH_TEST_SHARE_GPU") == "1":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        dist.init_process_group("gloo", **group)
        return
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank), **group)


def check_op(rank: int, world: int, port: int, op_name: str, kw: dict, relaunches: int, queue,
             topology: str | None = None, nic_gbps: float = 0.0, replays: int = 0) -> None:
    import faulthandler
    import sys

    # A rank that hangs or dies dumps its Python stack to the test log (the parent only sees an
    # empty queue): every Python thread, after 240 s without finishing.
    faulthandler.enable()
    faulthandler.dump_traceback_later(240, exit=True)
    try:
        setup(rank, world, port)
        import torch
        import torch.distributed as dist

        import mgraph as mg
        from mgraph.runtime.megakernel import TritonRuntime, local_shards
        from mgraph.runtime.memory import worst_tile_error as worst_tile
        from mgraph.settings import Settings

        op = mg.ops.get_op(op_name)
        graph = op(topology=topology or f"1x{world}", dtype=torch.bfloat16, **kw)
        trace_dir = os.environ.get("MGRAPH_TEST_TRACE_DIR")  # diagnostics: see _dump_trace
        rt = TritonRuntime(mg.schedule(graph, workers=_workers(graph)),
                           settings=Settings.from_env(nic_gbps=nic_gbps), trace=bool(trace_dir))
        worst = 0.0
        for i in range(relaunches):
            inputs = op.random_inputs(graph, seed=i)  # same seed on every rank: same global data
            want_global = op.run_reference({k: v.cuda().float() for k, v in inputs.items()}, graph.params)["out"]
            local = {k: v.cuda() for k, v in local_shards(graph, rank, inputs).items()}
            out = rt.run(local).outputs["out"]
            if relaunches >= 10 and i % 25 == 0:  # progress, so a stall shows where it stopped
                print(f"rank {rank}: launch {i}/{relaunches}", file=sys.stderr, flush=True)
            got = out.float()
            want = _local_reference(graph, rank, want_global)
            err = max(((got - want).norm() / want.norm()).item(), worst_tile(got, want))
            worst = max(worst, err)
            if replays:  # later launches replay a CUDA graph (no poison): check those too
                out.fill_(float("nan"))  # zeroed outputs are re-zeroed inside the graph
                for _ in range(replays):
                    rt.launch()
                torch.cuda.synchronize()
                rt.check()
                got = out.float()
                err = max(((got - want).norm() / want.norm()).item(), worst_tile(got, want))
                worst = max(worst, err)
        rt.close()  # multi-node graphs: stops the rank's host proxy
        dist.barrier()
        queue.put((rank, worst, None))
        faulthandler.cancel_dump_traceback_later()
        dist.destroy_process_group()
    except BaseException:  # reported to the parent test
        import traceback

        text = traceback.format_exc()
        if os.environ.get("MGRAPH_TEST_TRACE_DIR") and "rt" in locals():
            try:
                _dump_trace(rt, rank, os.environ["MGRAPH_TEST_TRACE_DIR"])
            except Exception as exc:  # noqa: BLE001 - the rank's own error comes first
                text += f"\n(trace dump failed: {exc!r})"
        queue.put((rank, None, text))


def _dump_trace(rt, rank: int, where: str) -> None:
    """MGRAPH_TEST_TRACE_DIR (diagnostics): a failed launch's per-task times, written to
    ``where/trace_rank{rank}.json``: every task that started, as [name, start, waits met, end,
    program] in %globaltimer ns (one clock for every process on one GPU, so two ranks sharing
    it line up), and the tasks that never started."""
    import json

    raw = rt.d["trace"].view(-1, 4).cpu().tolist()
    ran, never = [], []
    for local, tid in enumerate(rt.tables.local_tasks):
        name = rt.graph.tasks[tid].name
        if raw[local][0] > 0:
            ran.append([name, *raw[local]])
        else:
            never.append(name)
    ran.sort(key=lambda row: row[1])
    with open(os.path.join(where, f"trace_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "epoch": rt.epoch, "ran": ran, "never": never}, f)


def _workers(graph=None) -> dict[str, int] | None:
    """MGRAPH_TEST_WORKERS="compute=64,rdma=1" (diagnostics): the programs per role on every
    rank instead of the schedule's split of every SM, e.g. to leave SMs free for work a
    process queues beside its persistent kernel. Without it, ranks sharing one GPU
    (MGRAPH_TEST_SHARE_GPU=1) running a multi-node graph get one compute worker fewer than the
    default split: their proxies' same-device copies run as kernels on an SM the rank's own
    megakernel leaves free (runtime/megakernel/shared_gpu.py; on two GPUs they are copy-engine
    peer copies and the default split runs)."""
    spec = os.environ.get("MGRAPH_TEST_WORKERS")
    if not spec:
        if graph is None or os.environ.get("MGRAPH_TEST_SHARE_GPU") != "1":
            return None
        return shared_gpu_workers(graph)
    return {role: int(n) for role, n in (part.split("=") for part in spec.split(","))}


def shared_gpu_workers(graph) -> dict[str, int] | None:
    """The default split with one compute worker fewer, for a multi-node graph on a shared GPU
    (see _workers); None for a one-node graph (no proxy)."""
    import mgraph as mg

    if graph.topology.nodes == 1:
        return None
    workers = dict(mg.schedule(graph).ranks[0].workers)
    workers["compute"] -= 1
    return workers


def _local_reference(graph, rank, full):
    """The rank's part of a GLOBAL reference output, in the output buffer's layout."""
    buf = next(b for b in graph.buffers.values() if b.rank == rank and b.role == "output")
    parts = [full[tuple(slice(lo, hi) for lo, hi in p)] for p in buf.binding.pieces]
    import torch

    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=buf.binding.cat_dim)
