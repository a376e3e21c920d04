"""The Llama-8B-size decoder layer of examples/llama_block.py under TP + SP, compiled at each
topology given and predicted by the simulator (mgraph/profiles/h200.json): tasks, predicted
time, bytes over NVLink and RDMA. A prediction, not a measurement: the 2-GPU and 16-GPU machines
it describes are not lent (benchmarks/NOTES.md v21 compares it across commits).

Run: python benchmarks/sim_llama_layer.py [--topologies 2x8 1x2] [--label NAME]
         [--out benchmarks/results/v21/sim/rows.jsonl]
Appends one JSON row per topology to --out (label, commit, topology, tasks, predicted_ms, ...).
"""

from __future__ import annotations

import argparse
import json
import runpy
import subprocess
from pathlib import Path

import torch

import mgraph as mg
from mgraph.runtime.sim import simulate

HERE = Path(__file__).resolve().parent


def row(topology: str, dtype: torch.dtype) -> dict:
    ns = runpy.run_path(str(HERE.parent / "examples" / "llama_block.py"), run_name="sim_layer")
    torch.manual_seed(0)
    with torch.no_grad():
        model = ns["DecoderBlock"](hidden=4096, heads=32, kv_heads=8, ffn=14336).to(dtype)
    x = torch.randn(1, 4096, 4096, dtype=dtype)
    prog = mg.compile(model.eval(), (x,), plan=ns["block_plan"](), topology=topology)
    result = simulate(prog.schedule, baselines=False)
    return {
        "topology": topology,
        "dtype": str(dtype).removeprefix("torch."),
        "tasks": len(prog.graph.tasks),
        "predicted_ms": result.predicted_s * 1e3,
        "makespan_ms": result.makespan_s * 1e3,
        "nvlink_mib": result.bytes_by_link.get("nvlink", 0) / 2**20,
        "rdma_mib": result.bytes_by_link.get("rdma", 0) / 2**20,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--topologies", nargs="+", default=["2x8", "1x2"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--label", default="HEAD")
    p.add_argument("--out", default=str(HERE / "results" / "v21" / "sim" / "rows.jsonl"))
    args = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for topology in args.topologies:
        r = {"label": args.label, "commit": commit, **row(topology, getattr(torch, args.dtype))}
        print(json.dumps(r))
        with out.open("a") as f:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
