"""Multi-node megakernel graphs under the Triton interpreter with the native proxy at
``Settings(proxy_streams=1)`` and ``proxy_streams=4`` (tests/megakernel_streams_interp.py, in a
subprocess: TRITON_INTERPRET must be set before triton is imported). Each case has rdma tasks
on more than one lane, so events and exits sum per-lane net words; outputs match torch over
relaunches, every net word ends at exactly epochs x its raises per launch, and every launch's
commands were executed once. One subprocess runs both stream counts (the interpreter's start-up
paid once); each count's test reads its own rows."""

from __future__ import annotations

import json
import os
from functools import cache
from pathlib import Path

import pytest

from helpers import run_interpreted
from mgraph.runtime.proxy.native import available

HERE = Path(__file__).resolve().parent

if not available():
    pytest.skip("the native proxy extension is not built", allow_module_level=True)


STREAMS = [1, 4]


@cache
def all_rows() -> list[dict]:
    """The script's rows for every stream count, from one interpreter process."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(HERE))
    env.pop("MGRAPH_PROXY_STREAMS", None)  # the script passes Settings(proxy_streams=...)
    proc = run_interpreted([str(HERE / "megakernel_streams_interp.py"), *map(str, STREAMS)], env,
                           timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
@pytest.mark.parametrize("streams", STREAMS)
def test_multi_node_graphs_with_proxy_streams(streams: int) -> None:
    rows = [r for r in all_rows() if r["streams"] == streams]
    assert [r["case"] for r in rows] == ["gemm_allreduce-2x1", "gemm_reduce_scatter-2x1"]
    for row in rows:
        assert len(row["errors"]) == row["epochs"] == 3, row  # three launches, each checked
        assert max(row["errors"]) < 1e-5, row
        assert row["proxy_streams"] == streams, row
        assert row["exact"], row
        assert row["commands"] == row["epochs"] * row["per_launch_commands"], row
        assert len(row["lanes"]) > 1, row  # several lanes: per-lane words really summed
        assert {w for w in row["lane_words"] if w.startswith("('sent'")} == {
            f"('sent', {lane})" for lane in row["lanes"]
        }, row
