"""Calls that do not wait for their kernel (runtime/megakernel/inflight.py), on the CPU: the
bookkeeping with fake CUDA events, and TritonRuntime.run(wait=False) with its launch stubbed
by a stand-in kernel that copies x to out and may leave a timeout in the watchdog record. The
GPU side (real events, pinned records, the CUDA graph's replays) is
test_program_call_cost.py's GPU test."""

from __future__ import annotations

import pytest
import torch
from test_program_call_cost import copy_graph

import mgraph as mg
from mgraph.runtime.megakernel.inflight import InFlight, Slot

TIMEOUT = [1, 0, 0, -1, 0, 7, 9, 3]  # the entry barrier timed out (runtime._what: task -1)


class FakeEvent:
    """A CUDA event whose kernel finishes when the test says so."""

    def __init__(self, log: list) -> None:
        self.done, self.log = False, log

    def record(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.log.append("waited")
        self.done = True


def fake_slots(log: list):
    made = []

    def new_slot(like: torch.Tensor) -> Slot:
        made.append(Slot(FakeEvent(log), torch.zeros_like(like)))
        return made[-1]

    return new_slot, made


def three_calls(limit: int, check) -> tuple[InFlight, list, list, torch.Tensor]:
    """An InFlight of fake slots after three calls were added: (it, its slots, the log, err)."""
    log: list = []
    new_slot, made = fake_slots(log)
    flight = InFlight(new_slot, limit=limit)
    err = torch.zeros(8, dtype=torch.int64)
    for _ in range(3):
        flight.add(flight.queue(err), check if check else log.append)
    return flight, made, log, err


def test_poll_checks_only_finished_calls_oldest_first_and_reuses_their_slots():
    flight, made, log, err = three_calls(4, None)
    assert len(made) == 3 and len(flight.calls) == 3
    made[0].event.done = made[2].event.done = True  # the second has not finished
    flight.poll(lambda record: log.append(int(record[0])))
    assert log == [0] and len(flight.calls) == 2  # stops at the unfinished call, no wait
    flight.add(flight.queue(err), log.append)
    assert len(made) == 3  # the checked call's slot is used again
    flight.poll(lambda record: log.append("checked"), wait=True)
    assert log == [0, "waited", "checked", "waited", "checked", "waited", "checked"]
    assert not flight.calls


def test_past_the_limit_a_call_waits_for_the_oldest():
    checked: list = []
    flight, _, log, _ = three_calls(2, lambda record: checked.append(int(record[0])))
    assert log == ["waited"] and checked == [0] and len(flight.calls) == 2


def test_a_timeout_is_raised_once_and_the_calls_after_it_are_dropped():
    log: list = []
    new_slot, made = fake_slots(log)
    flight = InFlight(new_slot, limit=8)
    err = torch.zeros(8, dtype=torch.int64)
    flight.add(flight.queue(err), log.append)
    err[0] = 1
    for _ in range(2):
        flight.add(flight.queue(err), log.append)

    def check(record: torch.Tensor) -> None:
        if record[0]:
            raise mg.WatchdogTimeout("timed out")

    for slot in made:
        slot.event.done = True
    with pytest.raises(mg.WatchdogTimeout):
        flight.poll(check)
    assert not flight.calls  # the third call is not raised a second time
    flight.poll(check, wait=True)
    with pytest.raises(ValueError):
        InFlight(new_slot, limit=0)


@pytest.fixture
def runtime():
    """A runtime of copy_graph as a GPU process would run it: no interpreter, launch stubbed
    by a stand-in kernel (out = 2 x, or a timeout record), fake events."""
    from mgraph.runtime.megakernel import TritonRuntime

    rt = stand_in(TritonRuntime(mg.schedule(copy_graph()), interpret=True))
    yield rt
    rt.failed = None


def stand_in(rt):
    """``rt`` as a GPU process would run it: run() takes the GPU's paths (nothing reaches
    Triton), fake events, and a launch that writes out = 2 x into the rank's buffers or leaves a
    timeout in the watchdog record when ``rt.timeout_next``."""
    rt.interpret = False
    rt.log = []
    rt.inflight = InFlight(fake_slots(rt.log)[0], limit=4)
    rt.timeout_next = False

    def launch(poison: bool = False) -> None:
        if rt.failed is not None:
            raise rt.failed
        rt.epoch += 1
        out = next(v for b, v in rt.views.items() if b.startswith("out"))
        out.copy_(2 * next(v for b, v in rt.views.items() if b.startswith("x")))
        if rt.timeout_next:
            rt.d["err"].copy_(torch.tensor(TIMEOUT))

    rt.launch = launch
    return rt


def test_a_call_that_does_not_wait_returns_the_output_and_a_timeout_comes_at_the_next(runtime):
    x, w = torch.randn(32, 16), torch.randn(32, 16)
    got = runtime.run({"x": x, "w": w}, wait=False).outputs["out"]
    assert torch.equal(got, 2 * x) and len(runtime.inflight.calls) == 1
    runtime.timeout_next = True
    bad = runtime.run({"x": x, "w": w}, wait=False).outputs["out"]
    assert bad.isnan().all()  # masked with the record: a timed-out call's output is NaN
    for slot in runtime.inflight.calls:
        slot.event.done = True
    with pytest.raises(mg.WatchdogTimeout, match="entry barrier.*value 7, target 9, epoch 3"):
        runtime.run({"x": x, "w": w}, wait=False)  # raised before anything is loaded
    with pytest.raises(mg.WatchdogTimeout):  # the runtime stays failed
        runtime.run({"x": x, "w": w}, wait=False)


def test_synchronize_waits_for_every_call_and_raises_its_timeout(runtime):
    x, w = torch.randn(32, 16), torch.randn(32, 16)
    runtime.run({"x": x, "w": w}, wait=False)
    runtime.synchronize()
    assert runtime.log == ["waited"] and not runtime.inflight.calls
    runtime.timeout_next = True
    runtime.run({"x": x, "w": w}, wait=False)
    with pytest.raises(mg.WatchdogTimeout):
        runtime.synchronize()


def test_a_waiting_call_raises_its_own_timeout(runtime, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # a CPU here
    runtime._record_host = torch.zeros(8, dtype=torch.int64)  # the pinned copy, on the CPU
    x, w = torch.randn(32, 16), torch.randn(32, 16)
    assert torch.equal(runtime.run({"x": x, "w": w}).outputs["out"], 2 * x)
    runtime.timeout_next = True
    with pytest.raises(mg.WatchdogTimeout):
        runtime.run({"x": x, "w": w}, wait=True)


def two_rank_copy_graph():
    """Each rank copies its 16 rows of x to its rows of out (a 1x2 graph, outputs sharded)."""
    from mgraph.builder import GraphBuilder
    from mgraph.kinds import Role

    b = GraphBuilder("two_ranks", mg.Topology.parse("1x2"), "float32", {})
    b.global_input("x", (32, 16))
    b.global_output("out", (32, 16))
    for r in range(2):
        rows = ((16 * r, 16 * r + 16), (0, 16))
        x = b.bound_buffer(f"x{r}", r, "x", [rows])
        out = b.bound_buffer(f"out{r}", r, "out", [rows], role="output")
        b.task(r, Role.COMPUTE, "copy", [x.region()], [out.region()], name=f"x{r}")
    return b.finish()


@pytest.fixture
def spmd_runtime():
    """Rank 0 of a 1x2 graph as its SPMD process runs it (no interpreter, launch stubbed: out
    = 2 x on the rank's rows, or a timeout record; fake events)."""
    from mgraph.runtime.megakernel import TritonRuntime
    from mgraph.runtime.megakernel.runtime import _SharedMemory

    graph = two_rank_copy_graph()
    rt = stand_in(TritonRuntime(mg.schedule(graph), rank=0, interpret=True,
                                shared=_SharedMemory(graph, torch.device("cpu"))))
    assert set(rt.views) == {"x0@0", "out0@0"}  # rank 0's buffers only
    yield rt
    rt.failed = None


def test_an_spmd_call_that_does_not_wait_returns_a_masked_copy_of_its_shard(spmd_runtime):
    rt = spmd_runtime
    x = torch.randn(16, 16)
    got = rt.run({"x": x}, wait=False).outputs["out"]
    assert not rt.last_waited and len(rt.inflight.calls) == 1
    assert torch.equal(got, 2 * x)
    rt.views["out0@0"].fill_(5.0)  # the next launch rewrites the buffer: the output is a copy
    assert torch.equal(got, 2 * x)
    rt.timeout_next = True
    bad = rt.run({"x": x}, wait=False).outputs["out"]
    assert bad.isnan().all()  # a timed-out call's shard is NaN, never the buffer's stale rows
    for slot in rt.inflight.calls:
        slot.event.done = True
    with pytest.raises(mg.WatchdogTimeout, match="entry barrier"):
        rt.run({"x": x}, wait=False)


def test_an_spmd_call_that_waits_returns_views(spmd_runtime, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)  # a CPU here
    spmd_runtime._record_host = torch.zeros(8, dtype=torch.int64)
    x = torch.randn(16, 16)
    got = spmd_runtime.run({"x": x}, wait=True).outputs["out"]
    assert spmd_runtime.last_waited and not spmd_runtime.inflight.calls
    assert torch.equal(got, 2 * x) and got.data_ptr() == spmd_runtime.views["out0@0"].data_ptr()
