"""The verbs transport. Without an RDMA device (CI) the hardware test skips with the transport's
own "no RDMA device" error; the transport's logic (QP setup through the store, RC WRITE + flag
WRITE, WRITE_WITH_IMM, fences) is exercised against a small in-memory stand-in for pyverbs that
copies at post time, which is what an RC queue pair looks like from the outside."""

from __future__ import annotations

import ctypes
import sys
import threading
import time
import types
from collections import deque
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from mgraph.errors import ProxyError, RdmaUnavailableError
from mgraph.runtime.proxy import Command, CommandFifo, Proxy, Rect
from mgraph.topology import Topology

ROWS, COLS, EVENTS = 16, 32, 8


def test_importing_never_imports_pyverbs() -> None:
    import mgraph.runtime.proxy.verbs  # noqa: F401

    assert "pyverbs" not in sys.modules  # only building a transport loads it


def test_on_real_hardware_or_skip() -> None:
    from mgraph.runtime.proxy.verbs import rdma_devices

    try:
        rdma_devices()
    except RdmaUnavailableError as err:
        assert str(err).startswith("no RDMA device")
        pytest.skip(str(err).splitlines()[0])
    for mode in ("write_flag", "write_imm"):
        loopback(mode)


# -- a stand-in for pyverbs --------------------------------------------------------------------
E = SimpleNamespace(
    IBV_ACCESS_LOCAL_WRITE=1,
    IBV_ACCESS_REMOTE_WRITE=2,
    IBV_QPT_RC=2,
    IBV_MTU_1024=3,
    IBV_WR_RDMA_WRITE=0,
    IBV_WR_RDMA_WRITE_WITH_IMM=1,
    IBV_WC_SUCCESS=0,
    IBV_WC_RDMA_WRITE=1,
    IBV_WC_RECV_RDMA_WITH_IMM=129,
)


class Fabric:
    def __init__(self) -> None:
        self.qps: dict[int, FakeQP] = {}
        self.mrs: dict[int, FakeMR] = {}
        self.lock = threading.Lock()


FABRIC = Fabric()


class FakeMR:
    def __init__(self, pd, length, access, address=None) -> None:
        assert address, "the transport registers its own memory"
        self.buf, self.length = address, length
        self.lkey = self.rkey = len(FABRIC.mrs) + 1
        FABRIC.mrs[self.rkey] = self


class FakeCQ:
    def __init__(self, ctx, cqe, cq_context, channel, comp_vector) -> None:
        self.entries: deque = deque()

    def poll(self, n: int = 1):
        out = []
        with FABRIC.lock:
            while self.entries and len(out) < n:
                out.append(self.entries.popleft())
        return len(out), out


class FakeQP:
    def __init__(self, pd, init, attr) -> None:
        assert init.qp_type == E.IBV_QPT_RC and attr.qp_access_flags & E.IBV_ACCESS_REMOTE_WRITE
        self.qp_num = 100 + len(FABRIC.qps)
        self.cq = init.scq
        self.recvs = 0
        self.dest: int | None = None
        FABRIC.qps[self.qp_num] = self

    def to_rts(self, attr) -> None:
        assert attr.ah_attr.gr.dgid.gid.startswith("fe80") and attr.sq_psn < 2**24
        self.dest = attr.dest_qp_num

    def post_recv(self, wr, bad) -> None:
        self.recvs += 1

    def close(self) -> None:
        FABRIC.qps.pop(self.qp_num, None)

    def post_send(self, wr, bad) -> None:
        sge = wr.sg[0]
        assert wr.num_sge == 1 and FABRIC.mrs[sge.lkey].buf <= sge.addr
        mr = FABRIC.mrs[wr.rkey]
        assert mr.buf <= wr.raddr and wr.raddr + sge.length <= mr.buf + mr.length, "out of an MR"
        ctypes.memmove(wr.raddr, sge.addr, sge.length)
        peer = FABRIC.qps[self.dest]
        with FABRIC.lock:
            if wr.opcode == E.IBV_WR_RDMA_WRITE_WITH_IMM:
                assert peer.recvs > 0, "RNR: no receive posted"
                peer.recvs -= 1
                peer.cq.entries.append(
                    SimpleNamespace(
                        status=0,
                        opcode=E.IBV_WC_RECV_RDMA_WITH_IMM,
                        qp_num=peer.qp_num,
                        imm_data=wr.imm_data,
                        wr_id=0,
                    )
                )
            self.cq.entries.append(
                SimpleNamespace(
                    status=0,
                    opcode=E.IBV_WC_RDMA_WRITE,
                    qp_num=self.qp_num,
                    wr_id=wr.wr_id,
                    imm_data=0,
                )
            )


class FakeSendWR:
    def __init__(self, wr_id=0, opcode=0, num_sge=0, imm_data=0, sg=None, send_flags=0) -> None:
        self.wr_id, self.opcode, self.num_sge, self.imm_data, self.sg = (
            wr_id,
            opcode,
            num_sge,
            imm_data,
            sg,
        )

    def set_wr_rdma(self, rkey, addr) -> None:
        self.rkey, self.raddr = rkey, addr


class FakeAttr(SimpleNamespace):
    def __init__(self, *args, **kw) -> None:
        super().__init__(**kw)


def fake_pyverbs(devices: list[str]) -> dict[str, types.ModuleType]:
    def module(name: str, **attrs) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        return m

    def get_device_list():
        return [SimpleNamespace(name=d.encode()) for d in devices]

    class Context:
        def __init__(self, name: str) -> None:
            self.name = name

        def query_port(self, port):
            return SimpleNamespace(lid=7)

        def query_gid(self, port, index):
            return SimpleNamespace(gid="fe80:0000:0000:0000:0000:0000:0000:0001")

        def close(self) -> None:
            pass

    return {
        "pyverbs": module("pyverbs"),
        "pyverbs.device": module(
            "pyverbs.device", get_device_list=get_device_list, Context=Context
        ),
        "pyverbs.addr": module(
            "pyverbs.addr",
            GID=lambda s: SimpleNamespace(gid=s),
            AHAttr=FakeAttr,
            GlobalRoute=FakeAttr,
        ),
        "pyverbs.cq": module("pyverbs.cq", CQ=FakeCQ),
        "pyverbs.mr": module("pyverbs.mr", MR=FakeMR),
        "pyverbs.pd": module("pyverbs.pd", PD=lambda ctx: SimpleNamespace(ctx=ctx)),
        "pyverbs.qp": module(
            "pyverbs.qp", QP=FakeQP, QPAttr=FakeAttr, QPCap=FakeAttr, QPInitAttr=FakeAttr
        ),
        "pyverbs.wr": module(
            "pyverbs.wr",
            SGE=lambda a, n, k: SimpleNamespace(addr=a, length=n, lkey=k),
            RecvWR=FakeAttr,
            SendWR=FakeSendWR,
        ),
        "pyverbs.enums": module("pyverbs.enums", **vars(E)),
    }


@pytest.fixture
def pyverbs(monkeypatch):
    def install(devices: list[str]) -> None:
        for name, mod in fake_pyverbs(devices).items():
            monkeypatch.setitem(sys.modules, name, mod)

    return install


# -- the transport on the stand-in -------------------------------------------------------------
def loopback(mode: str) -> None:
    """Ranks 0 and 1 of a 2x1 topology behind two transports, a Python proxy draining rank 0."""
    from mgraph.runtime.proxy import VerbsTransport

    store = dist.HashStore()
    gen = torch.Generator().manual_seed(0)
    mem = {r: {b: torch.randn(ROWS, COLS, generator=gen) for b in range(2)} for r in (0, 1)}
    raised: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    topo = Topology.parse("2x1")
    t = {
        r: VerbsTransport(
            store,
            lambda rank, e, ep: raised[rank].append((e, ep)),
            topo,
            [r],
            mode=mode,
            depth=16,
            timeout=5.0,
        )
        for r in (0, 1)
    }
    try:
        for r in (0, 1):
            t[r].register(r, mem[r], n_events=EVENTS)
            t[r].begin(3)
        dial = threading.Thread(target=t[0].connect, args=(0, 1))
        dial.start()
        t[1].connect(1, 0)
        dial.join()
        fifo = CommandFifo(8)
        with Proxy(fifo, t[0], 4):
            for i in range(6):  # rows: contiguous writes, some coalesced
                tile = Rect(0, 2 * i, 2 * i + 2, 0, COLS)
                fifo.push(
                    Command.write(
                        0,
                        tile,
                        1,
                        tile._replace(buffer=1),
                        bytes=2 * COLS * 4,
                        event=i,
                        done_event=i,
                        epoch=3,
                    )
                )
            col = Rect(1, 0, ROWS, 4, 12)  # a column block: one WRITE per row
            fifo.push(
                Command.write(
                    0, col, 1, col._replace(buffer=0), bytes=ROWS * 8 * 4, event=6, epoch=3
                )
            )
            fifo.push(Command.signal(0, 1, 7, epoch=3))
        deadline = time.monotonic() + 5
        while len(raised[1]) < 8 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert torch.equal(mem[1][1][:12], mem[0][0][:12])
        assert torch.equal(mem[1][0][:, 4:12], mem[0][1][:, 4:12])
        assert sorted(raised[1]) == [(e, 3) for e in range(8)]
        assert raised[0] == [(i, 3) for i in range(6)]  # done events: the source may be reused
        fence = threading.Thread(target=t[1].fence, args=(3,))
        fence.start()
        t[0].fence(3)
        fence.join()
        assert t[0].error is None and t[1].error is None
        with pytest.raises(ProxyError, match=r"outside rank 1 buffer 0"):
            t[0].write(0, mem[0][0][:2], 1, Rect(0, 15, 17, 0, COLS))
    finally:
        for tr in t.values():
            tr.close()


@pytest.mark.parametrize("mode", ["write_flag", "write_imm"])
def test_rc_write_paths_on_a_stand_in(pyverbs, mode: str) -> None:
    pyverbs(["mlx5_0"])
    loopback(mode)


def test_no_device_is_a_named_error_never_an_import_error(pyverbs) -> None:
    from mgraph.runtime.proxy import VerbsTransport

    pyverbs([])
    with pytest.raises(RdmaUnavailableError, match="^no RDMA device: get_device_list"):
        VerbsTransport(dist.HashStore(), lambda *_: None, None, [0])
    pyverbs(["mlx5_0"])
    with pytest.raises(RdmaUnavailableError, match="no RDMA device named 'mlx5_9'"):
        VerbsTransport(dist.HashStore(), lambda *_: None, None, [0], device="mlx5_9")
    with pytest.raises(ProxyError, match="unknown mode"):
        VerbsTransport(dist.HashStore(), lambda *_: None, None, [0], mode="send_recv")


def test_missing_pyverbs_is_the_same_named_error(monkeypatch) -> None:
    from mgraph.runtime.proxy.verbs import load_pyverbs

    monkeypatch.setitem(sys.modules, "pyverbs", None)
    monkeypatch.setitem(sys.modules, "pyverbs.device", None)
    with pytest.raises(RdmaUnavailableError, match="^no RDMA device: pyverbs is not installed"):
        load_pyverbs()
