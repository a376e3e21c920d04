"""Random DAG + random schedule cases on the reference runtime: no deadlock, memory equal to a
sequential topological execution. The cases come from test_runtime_property's generators
(random topologies, roles, cross-rank and cross-node reads, extra ordering edges, random queue
orders consistent with a topological order, random worker/thread counts, small FIFOs).

CI runs 1,000 cases (seeds 10,000 and up, disjoint from test_runtime_property's 500);
``MGRAPH_PROPERTY_CASES=10000 pytest tests/test_random_dags.py`` runs the full 10,000. Each case
also checks NaN handling: one input element is NaN, and the runtime must carry it exactly where
the sequential execution does (NaN is data, not the "unwritten" marker).
"""

from __future__ import annotations

import os
import random

import torch
from test_runtime_property import random_graph, random_schedule

from mgraph.runtime.reference import ReferenceRuntime
from mgraph.runtime.sequential import execute_sequential
from mgraph.settings import Settings

CASES = int(os.environ.get("MGRAPH_PROPERTY_CASES", "1000"))
FIRST_SEED = 10_000


def test_random_dags_and_schedules():
    for case in range(FIRST_SEED, FIRST_SEED + CASES):
        rng = random.Random(case)
        graph = random_graph(rng)
        graph.validate()
        sched = random_schedule(graph, rng)
        x = torch.randn(graph.inputs["x"].shape, generator=torch.Generator().manual_seed(case))
        if rng.random() < 0.5:  # NaN in the user's data must flow through like any value
            x[rng.randrange(x.shape[0]), rng.randrange(x.shape[1])] = float("nan")
        inputs = {"x": x}
        want = execute_sequential(graph, inputs)
        settings = Settings(watchdog_s=5.0, threads_per_role=rng.randint(1, 3),
                            fifo_slots=rng.choice([2, 4, 64]), proxy=rng.choice(["native", "python"]))
        with ReferenceRuntime(sched, settings) as rt:
            rt.run(inputs)
            for buf_id, tensor in want.items():
                got = rt.memory[buf_id]
                assert torch.equal(got.isnan(), tensor.isnan()), f"seed {case}: {buf_id} NaN differ"
                assert torch.equal(got.nan_to_num(), tensor.nan_to_num()), f"seed {case}: {buf_id}"
