"""Run by tests/test_adaptive_threads.py in a subprocess (TRITON_INTERPRET=1 before triton's
import): the megakernel on AG+GEMM at 1x2 with Settings(adaptive=True), both ranks at once, every
program on its own thread (tests/interp_threads.py), three launches on fresh inputs. Prints one
JSON line: each launch's error against torch, the heads after each launch, decisions made."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import interp_threads  # noqa: E402

interp_threads.install()

import torch  # noqa: E402

import mgraph as mg  # noqa: E402
from mgraph.runtime.megakernel.control import C_DECISIONS  # noqa: E402
from mgraph.runtime.megakernel.runtime import TritonRuntime, _SharedMemory  # noqa: E402
from mgraph.settings import Settings  # noqa: E402


def main() -> None:
    op = mg.ops.get_op("allgather_gemm")
    # 4 chunks per shard, one per tile row: the GEMM tiles of the peer's shard wait for the
    # NVLink copies (hoisted to their segment), which pooled programs take.
    graph = op(
        M=512,
        N=256,
        K=64,
        topology="1x2",
        dtype=torch.float32,
        tile=[64, 64],
        chunk_bytes=64 * 64 * 4,
    )
    sched = mg.schedule(graph, workers={"compute": 3, "nvlink": 2})
    shared = _SharedMemory(graph, torch.device("cpu"))
    settings = Settings(adaptive=True, watchdog_s=2.0)
    rts = [
        TritonRuntime(
            sched, rank=r, interpret=True, interpret_roles=True, shared=shared, settings=settings
        )
        for r in (0, 1)
    ]
    errors, heads, failures = [], [], []
    for launch in range(3):
        inputs = op.random_inputs(graph, seed=launch)
        want = op.run_reference(inputs, graph.params)["out"]
        got, failed = interp_threads.run_ranks(rts, graph, inputs)
        failures += [f"launch {launch} rank {r}: {exc!r}"[:500] for r, exc in failed]
        if failures:
            break
        out = torch.cat(got, dim=1)  # out is sharded along N
        errors.append(((out - want).norm() / want.norm()).item())
        heads.append([rt.d["heads"].tolist()[:2] for rt in rts])
    print(
        json.dumps(
            {
                "adaptive": [rt.adaptive for rt in rts],
                "errors": errors,
                "heads": heads,
                "decisions": [int(rt.d["ctl"][C_DECISIONS]) for rt in rts],
                "failures": failures,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
