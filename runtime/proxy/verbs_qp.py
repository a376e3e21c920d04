"""pyverbs plumbing of the verbs transport: loading pyverbs, finding devices, one NIC port
(context, protection domain, completion queue), and RC queue pairs from creation to RTS.

Written against pyverbs' API as rdma-core's own tests use it (tests/base.py RCResources:
``QP(pd, QPInitAttr, QPAttr)`` returns an RC QP in INIT; ``to_rts(QPAttr)`` with the peer's QP
number, PSN and address vector takes it through RTR to RTS; ``MR(pd, length, access,
address=...)`` registers existing memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from mgraph.errors import RdmaUnavailableError

__all__ = ["load_pyverbs", "rdma_devices", "QueuePair", "Nic", "create_queue_pair"]

_HINT = (
    "run on a machine with an InfiniBand/RoCE/EFA NIC and the OS package python3-pyverbs, "
    "or use the tcp transport"
)


def load_pyverbs() -> SimpleNamespace:
    """The pyverbs classes this transport uses; RdmaUnavailableError when pyverbs is missing."""
    try:
        import pyverbs.device as device
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.cq import CQ
        from pyverbs.mr import MR
        from pyverbs.pd import PD
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
        from pyverbs.wr import SGE, RecvWR, SendWR

        try:
            import pyverbs.enums as enums
        except ImportError:  # rdma-core before v31 names the module libibverbs_enums
            import pyverbs.libibverbs_enums as enums
    except ImportError as exc:
        raise RdmaUnavailableError(
            f"no RDMA device: pyverbs is not installed ({exc})", hint=_HINT
        ) from None
    return SimpleNamespace(
        device=device,
        GID=GID,
        AHAttr=AHAttr,
        GlobalRoute=GlobalRoute,
        CQ=CQ,
        MR=MR,
        PD=PD,
        QP=QP,
        QPAttr=QPAttr,
        QPCap=QPCap,
        QPInitAttr=QPInitAttr,
        SGE=SGE,
        RecvWR=RecvWR,
        SendWR=SendWR,
        e=enums,
    )


def rdma_devices(pv: SimpleNamespace | None = None) -> list[str]:
    """Names of the RDMA devices here; RdmaUnavailableError when there are none."""
    pv = pv or load_pyverbs()
    try:
        devices = pv.device.get_device_list()
    except Exception as exc:  # PyverbsRDMAError: no RDMA support in the kernel at all
        raise RdmaUnavailableError(
            f"no RDMA device: get_device_list() failed ({exc})", hint=_HINT
        ) from None
    if not devices:
        raise RdmaUnavailableError("no RDMA device: get_device_list() found none", hint=_HINT)
    return [d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices]


@dataclass
class QueuePair:
    qp: object
    local: int
    remote: int
    staging: torch.Tensor  # flag values to WRITE, one slot per outstanding WR at most
    staging_mr: object
    flags: torch.Tensor | None = None  # write_flag: the words the peer writes here
    flags_mr: object = None
    seen: torch.Tensor | None = None  # write_flag: counts already raised
    remote_flags: tuple[int, int] = (0, 0)  # (address, rkey) of our array on the peer
    shadow: dict[int, int] = field(default_factory=dict)
    posted: int = 0
    completed: int = 0
    fence: int = 0


class Nic:
    """One port of one RDMA device: context, protection domain, a completion queue."""

    def __init__(self, pv: SimpleNamespace, device: str, port: int, gid_index: int,
                 cq_depth: int) -> None:  # fmt: skip
        e = pv.e
        self.pv, self.port, self.gid_index = pv, port, gid_index
        self.ctx = pv.device.Context(name=device)
        self.pd = pv.PD(self.ctx)
        self.cq = pv.CQ(self.ctx, cq_depth, None, None, 0)
        self.lid = self.ctx.query_port(port).lid
        self.gid = self.ctx.query_gid(port, gid_index).gid
        self.access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE

    def register(self, tensor: torch.Tensor) -> object:
        """An MR over ``tensor``'s memory (local and remote write)."""
        nbytes = max(tensor.numel() * tensor.element_size(), 1)
        return self.pv.MR(self.pd, nbytes, self.access, address=tensor.data_ptr())

    def address(self, conn: QueuePair, psn: int) -> dict:
        """What the peer needs to connect to ``conn`` (published through the store)."""
        flags = None if conn.flags is None else [conn.flags.data_ptr(), conn.flags_mr.rkey]
        return {"qp_num": conn.qp.qp_num, "lid": self.lid, "gid": self.gid, "psn": psn,
                "flags": flags}  # fmt: skip

    def to_rts(self, conn: QueuePair, theirs: dict, psn: int) -> None:
        """INIT -> RTR -> RTS towards the peer described by ``theirs`` (its ``address``)."""
        pv, e = self.pv, self.pv.e
        attr = pv.QPAttr(port_num=self.port)
        attr.path_mtu = e.IBV_MTU_1024
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
        attr.min_rnr_timer, attr.timeout, attr.retry_cnt, attr.rnr_retry = 12, 14, 7, 7
        route = pv.GlobalRoute(dgid=pv.GID(theirs["gid"]), sgid_index=self.gid_index)
        attr.ah_attr = pv.AHAttr(port_num=self.port, is_global=1, gr=route, dlid=theirs["lid"])
        attr.dest_qp_num = theirs["qp_num"]
        attr.rq_psn, attr.sq_psn = theirs["psn"], psn
        conn.qp.to_rts(attr)

    def close(self) -> None:
        self.ctx.close()  # closes the PD, CQ, QPs and MRs it owns


def create_queue_pair(nic: Nic, local: int, remote: int, depth: int,
                      flag_words: int) -> QueuePair:  # fmt: skip
    """An RC QP in INIT (remote write allowed) with its staging words for flag values and,
    when ``flag_words`` > 0, the flag array the peer writes into."""
    pv, e = nic.pv, nic.pv.e
    cap = pv.QPCap(max_send_wr=depth, max_recv_wr=depth, max_send_sge=1, max_recv_sge=1)
    init = pv.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=nic.cq, rcq=nic.cq, cap=cap, sq_sig_all=1)
    attr = pv.QPAttr(port_num=nic.port)
    attr.qp_access_flags = nic.access
    qp = pv.QP(nic.pd, init, attr)
    staging = torch.zeros(depth, dtype=torch.int64)
    conn = QueuePair(qp, local, remote, staging, nic.register(staging))
    if flag_words > 0:
        conn.flags = torch.zeros(flag_words, dtype=torch.int64)
        conn.seen = torch.zeros_like(conn.flags)
        conn.flags_mr = nic.register(conn.flags)
    return conn
