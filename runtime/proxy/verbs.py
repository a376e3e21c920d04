"""The verbs transport: RDMA through pyverbs (the OS package python3-pyverbs, from rdma-core).

Loaded lazily: importing this module never imports pyverbs. Building a ``VerbsTransport`` does,
and on a machine without RDMA devices (where ``get_device_list()`` raises or finds none) or
without pyverbs it raises RdmaUnavailableError, whose message starts "no RDMA device"; never an
ImportError.

One RC queue pair per rank pair (the rail peers a graph connects), set up through the
torch.distributed store: each side publishes its QP number, LID, GID and PSN, its buffers'
addresses and rkeys, and (write_flag mode) the flag array the peer writes into. Two ways to
raise the destination's event after the data, chosen by ``mode``:

- ``"write_flag"`` (InfiniBand RC): RDMA WRITE of the data, then on the same QP an RDMA WRITE of
  the event's flag word. An RC QP executes WRITEs in order, so the flag lands after the data.
  A flag word holds a running count (epoch-tagged: never reset, targets are epoch * count); each
  peer writes its own flag array on the receiver, so every word has one writer, which keeps the
  count in a host-side shadow. The receiver's progress thread turns count increases into
  ``raise_event`` calls; on the GPU path the consumer reads the flag itself.
- ``"write_imm"`` (EFA-style): RDMA WRITE_WITH_IMM whose 32-bit immediate carries
  ``event << 8 | epoch & 0xFF``; the receiver's proxy polls its completion queue for the receive
  completion and raises the event. More events per write go as zero-length WRITE_WITH_IMMs.

A fence (end of a launch) is one more flag word per connection (write_flag) or a reserved
immediate (write_imm), written after the launch's data on every QP.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence

import torch

from mgraph.errors import ProxyError, RdmaUnavailableError
from mgraph.graph import torch_dtype
from mgraph.topology import Topology

from .command import Rect
from .transport import RaiseEvent, Transport
from .verbs_qp import Nic, QueuePair, create_queue_pair, load_pyverbs, rdma_devices
from .wire import store_get

__all__ = ["VerbsTransport", "MODES", "load_pyverbs", "rdma_devices"]  # the last two re-exported

MODES = ("write_flag", "write_imm")
_FENCE_IMM = 0xFFFFFF  # an event id no graph reaches (ids are < 2**24 in write_imm mode)


class VerbsTransport(Transport):
    """Ranks of this process reach the others' registered memory with RDMA; see the module
    docstring. The arguments mirror ``TcpTransport``'s; ``device`` (default: the first),
    ``port`` and ``gid_index`` pick the NIC port, ``depth`` the queue sizes."""

    name = "verbs"

    def __init__(
        self,
        store: object,
        raise_event: RaiseEvent,
        topology: Topology | None,
        ranks: Sequence[int],
        *,
        mode: str = "write_flag",
        device: str | None = None,
        port: int = 1,
        gid_index: int = 0,
        depth: int = 256,
        timeout: float = 30.0,
        prefix: str = "mgraph/verbs",
        on_error: Callable[[ProxyError], None] | None = None,
    ) -> None:
        if mode not in MODES:
            raise ProxyError(f"verbs: unknown mode {mode!r}", hint=f"use one of {MODES}")
        super().__init__(topology)
        self.pv = pv = load_pyverbs()
        names = rdma_devices(pv)
        if device is not None and device not in names:
            raise RdmaUnavailableError(f"no RDMA device named {device!r}; found {names}")
        self.device = device or names[0]
        self.mode, self.port, self.gid_index, self.depth = mode, port, gid_index, depth
        self.store, self.raise_event, self.on_error = store, raise_event, on_error
        self.local = sorted(set(ranks))
        self.timeout, self.prefix = timeout, prefix
        self.error: ProxyError | None = None
        self.nic = Nic(pv, self.device, port, gid_index, 4 * depth)
        self.mrs: dict[int, dict[int, object]] = {}
        self.events: dict[int, int] = {}
        self.remote: dict[int, dict[int, tuple[int, int, int, int, torch.dtype, int]]] = {}
        self.qps: dict[tuple[int, int], QueuePair] = {}
        self.by_qp_num: dict[int, QueuePair] = {}
        self._scratch = torch.zeros(8, dtype=torch.int64)  # the SGE of zero-length writes
        self._scratch_mr = self.nic.register(self._scratch)
        self._lock = threading.Condition()
        self._done: dict[int, list[int]] = {}
        self._works: dict[int, tuple[int, int]] = {}  # wr_id -> (src rank, work id)
        self._next_wr = 1
        self._progress = threading.Thread(target=self._run, name="mgraph-verbs", daemon=True)
        self._progress.start()

    # -- setup ------------------------------------------------------------------------------
    def register(self, rank: int, buffers: dict[int, torch.Tensor], n_events: int = -1) -> None:
        if rank not in self.local:
            raise ProxyError(f"verbs: rank {rank} is not one of this process's ranks {self.local}")
        super().register(rank, buffers)
        self.events[rank] = n_events
        self.mrs[rank] = {}
        layout = []
        for i, t in buffers.items():
            if not t.is_contiguous():
                raise ProxyError(f"verbs: rank {rank} buffer {i} is not contiguous")
            mr = self.nic.register(t)
            self.mrs[rank][i] = mr
            layout.append(
                [
                    i,
                    t.data_ptr(),
                    mr.rkey,
                    t.shape[0],
                    t.shape[1],
                    str(t.dtype).removeprefix("torch."),
                    t.stride(0) * t.element_size(),
                ]
            )
        self.store.set(
            f"{self.prefix}/layout/{rank}", json.dumps({"buffers": layout, "events": n_events})
        )

    def connect(self, rank: int, peer: int) -> None:
        self._check_open("connect")
        if rank not in self.local:
            raise ProxyError(f"verbs: connect({rank}, {peer}): rank {rank} is not local")
        if peer in self.local:
            self.local_pairs.add(frozenset((rank, peer)))
            return
        if (rank, peer) in self.qps:
            return
        layout = json.loads(
            store_get(
                self.store, f"{self.prefix}/layout/{peer}", self.timeout, f"rank {peer}'s layout"
            )
        )
        self.remote[peer] = {
            i: (addr, rkey, rows, cols, torch_dtype(dt), row_bytes)
            for i, addr, rkey, rows, cols, dt, row_bytes in layout["buffers"]
        }
        n_events = self.events.get(rank, -1)
        if self.mode == "write_flag" and n_events < 0:
            raise ProxyError(
                f"verbs: write_flag mode needs rank {rank}'s event count",
                hint="register(rank, buffers, n_events=...) before connect()",
            )
        flag_words = n_events + 1 if self.mode == "write_flag" else 0  # + the fence word
        conn = create_queue_pair(self.nic, rank, peer, self.depth, flag_words)
        psn = random.getrandbits(24)
        self.store.set(f"{self.prefix}/qp/{rank}/{peer}", json.dumps(self.nic.address(conn, psn)))
        key = f"{self.prefix}/qp/{peer}/{rank}"
        theirs = json.loads(store_get(self.store, key, self.timeout, f"rank {peer}'s queue pair"))
        if theirs["flags"] is not None:
            conn.remote_flags = tuple(theirs["flags"])
        if self.mode == "write_imm":  # every WRITE_WITH_IMM consumes one receive
            for _ in range(self.depth):
                self._post_recv(conn)
        self.nic.to_rts(conn, theirs, psn)
        with self._lock:
            self.qps[(rank, peer)] = conn
            self.by_qp_num[conn.qp.qp_num] = conn

    def _post_recv(self, conn: QueuePair) -> None:
        sge = self.pv.SGE(self._scratch.data_ptr(), 64, self._scratch_mr.lkey)
        conn.qp.post_recv(self.pv.RecvWR(wr_id=0, num_sge=1, sg=[sge]), None)

    # -- memory checks ----------------------------------------------------------------------
    def check_region(self, rank: int, rect: Rect) -> torch.dtype:
        if rank in self.memory or rank not in self.remote:
            return super().check_region(rank, rect)
        shapes = {i: (b[2], b[3], b[4]) for i, b in self.remote[rank].items()}
        return self.check_remote_region(rank, rect, shapes)

    # -- the data path ----------------------------------------------------------------------
    def _conn(self, src: int, dst: int, what: str) -> QueuePair:
        self._check_open(what)
        if self.error is not None:
            raise self.error
        conn = self.qps.get((src, dst))
        if conn is None:
            raise ProxyError(
                f"verbs: {what} from rank {src} to rank {dst}, which are not connected",
                hint=f"call connect({src}, {dst}) on both sides",
            )
        return conn

    def _lkey(self, rank: int, tensor: torch.Tensor) -> int:
        ptr = tensor.data_ptr()
        for mr in self.mrs.get(rank, {}).values():
            if mr.buf <= ptr < mr.buf + mr.length:
                return mr.lkey
        raise ProxyError(f"verbs: the source of a write is not in rank {rank}'s registered memory")

    def _post(
        self,
        conn: QueuePair,
        opcode: int,
        addr: int,
        length: int,
        lkey: int,
        raddr: int,
        rkey: int,
        imm: int = 0,
        work: tuple[int, int] | None = None,
    ) -> None:
        deadline = time.monotonic() + self.timeout
        while conn.posted - conn.completed >= self.depth - 1:  # the send queue is full
            if self.error is not None:
                raise self.error
            if time.monotonic() > deadline:
                raise ProxyError(
                    f"verbs: no completion from rank {conn.remote} for {self.timeout:g} s"
                )
            time.sleep(1e-5)
        pv = self.pv
        with self._lock:
            wr_id = self._next_wr
            self._next_wr += 1
            if work is not None:
                self._works[wr_id] = work
        wr = pv.SendWR(
            wr_id=wr_id,
            opcode=opcode,
            num_sge=1,
            sg=[pv.SGE(addr, length, lkey)],
            imm_data=socket.htonl(imm) if imm else 0,
        )
        wr.set_wr_rdma(rkey, raddr)
        conn.posted += 1
        conn.qp.post_send(wr, None)

    def _raise_remote(
        self, conn: QueuePair, events: Sequence[int], epoch: int, work: tuple[int, int]
    ) -> None:
        e = self.pv.e
        for i, event in enumerate(events):
            last = work if i == len(events) - 1 else None
            if self.mode == "write_flag":
                value = conn.shadow.get(event, 0) + 1
                conn.shadow[event] = value
                slot = conn.posted % conn.staging.numel()
                conn.staging[slot] = value
                self._post(
                    conn,
                    e.IBV_WR_RDMA_WRITE,
                    conn.staging.data_ptr() + 8 * slot,
                    8,
                    conn.staging_mr.lkey,
                    conn.remote_flags[0] + 8 * event,
                    conn.remote_flags[1],
                    work=last,
                )
            else:
                addr, rkey = next(iter(self.remote[conn.remote].values()))[:2]
                self._post(
                    conn,
                    e.IBV_WR_RDMA_WRITE_WITH_IMM,
                    self._scratch.data_ptr(),
                    0,
                    self._scratch_mr.lkey,
                    addr,
                    rkey,
                    imm=event << 8 | epoch & 0xFF,
                    work=last,
                )

    def write(
        self,
        src_rank: int,
        src: torch.Tensor,
        dst_rank: int,
        dst: Rect,
        events: Sequence[int] = (),
        epoch: int = 0,
    ) -> int:
        work = self._work_id(src_rank)
        if self.is_local(src_rank, dst_rank):
            self.deliver_locally(dst_rank, dst, src, events, epoch, "write")
            self._finish(work)
        else:
            conn = self._conn(src_rank, dst_rank, "write")
            self.check_region(dst_rank, dst)
            addr0, rkey, _, cols, dtype, row_bytes = self.remote[dst_rank][dst.buffer]
            item, lkey = src.element_size(), self._lkey(src_rank, src)
            width = src.shape[1] * item
            rows = [
                (
                    src.data_ptr(),
                    addr0 + dst.row0 * row_bytes + dst.col0 * item,
                    width * src.shape[0],
                )
            ]
            if not (src.is_contiguous() and dst.col0 == 0 and dst.col1 == cols):
                rows = [
                    (
                        src.data_ptr() + r * src.stride(0) * item,
                        addr0 + (dst.row0 + r) * row_bytes + dst.col0 * item,
                        width,
                    )
                    for r in range(src.shape[0])
                ]
            e = self.pv.e
            for i, (laddr, raddr, length) in enumerate(rows):
                last = i == len(rows) - 1
                if last and events and self.mode == "write_imm":  # the first event rides along
                    self._post(
                        conn,
                        e.IBV_WR_RDMA_WRITE_WITH_IMM,
                        laddr,
                        length,
                        lkey,
                        raddr,
                        rkey,
                        imm=events[0] << 8 | epoch & 0xFF,
                        work=None if len(events) > 1 else work,
                    )
                else:
                    self._post(
                        conn,
                        e.IBV_WR_RDMA_WRITE,
                        laddr,
                        length,
                        lkey,
                        raddr,
                        rkey,
                        work=work if last and not events else None,
                    )
            rest = list(events[1:]) if self.mode == "write_imm" else list(events)
            if rest:
                self._raise_remote(conn, rest, epoch, work)
        self._count(src_rank, dst_rank, src.numel() * src.element_size())
        return work[1]

    def signal(self, src_rank: int, dst_rank: int, event: int, epoch: int = 0) -> int:
        work = self._work_id(src_rank)
        if self.is_local(src_rank, dst_rank):
            self.deliver_locally(dst_rank, None, None, [event], epoch, "signal")
            self._finish(work)
        else:
            self._raise_remote(self._conn(src_rank, dst_rank, "signal"), [event], epoch, work)
        with self._stats_lock:
            self.signals += 1
        return work[1]

    def _work_id(self, src_rank: int) -> tuple[int, int]:
        with self._lock:
            work = self._next_wr
            self._next_wr += 1
        return (src_rank, work)

    def _finish(self, work: tuple[int, int]) -> None:
        with self._lock:
            self._done.setdefault(work[0], []).append(work[1])

    def poll(self, rank: int | None = None) -> list[int]:
        with self._lock:
            if rank is None:
                done = [w for works in self._done.values() for w in works]
                self._done.clear()
            else:
                done = self._done.pop(rank, [])
        return done

    # -- progress: completions and arrivals -------------------------------------------------
    def _run(self) -> None:
        idle = 0
        try:
            while not self.closed:
                busy = self._poll_cq()
                if self.mode == "write_flag":
                    busy += self._scan_flags()
                idle = 0 if busy else idle + 1
                if idle > 100:
                    time.sleep(min(1e-3, 1e-6 * idle))
        except ProxyError as err:
            self._fail(err)
        except Exception as exc:
            self._fail(ProxyError(f"verbs: progress thread failed: {type(exc).__name__}: {exc}"))

    def _poll_cq(self) -> int:
        e = self.pv.e
        _, wcs = self.nic.cq.poll(64)
        for wc in wcs:
            if wc.status != e.IBV_WC_SUCCESS:
                raise ProxyError(
                    f"verbs: work request {wc.wr_id} failed with status {wc.status}",
                    hint="the peer is gone, or a region or rkey is wrong",
                )
            if wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM:
                conn = self.by_qp_num[wc.qp_num]
                self._post_recv(conn)
                imm = socket.ntohl(wc.imm_data)
                event, low = imm >> 8, imm & 0xFF
                epoch = self.epoch - ((self.epoch - low) & 0xFF)  # the latest epoch with that byte
                if event == _FENCE_IMM:
                    with self._lock:
                        conn.fence = max(conn.fence, epoch)
                        self._lock.notify_all()
                else:
                    self.raise_event(conn.local, event, epoch)
            else:
                conn = self.by_qp_num.get(wc.qp_num)
                if conn is not None:
                    conn.completed += 1
                with self._lock:
                    work = self._works.pop(wc.wr_id, None)
                if work is not None:
                    self._finish(work)
        return len(wcs)

    def _scan_flags(self) -> int:
        raised = 0
        for conn in list(self.qps.values()):
            assert conn.flags is not None and conn.seen is not None
            now = conn.flags.clone()  # one snapshot: words the NIC writes meanwhile wait a round
            counts = now[:-1] - conn.seen[:-1]
            for event in counts.nonzero().flatten().tolist():
                for _ in range(int(counts[event])):
                    self.raise_event(conn.local, event, self.epoch)
                raised += 1
            conn.seen.copy_(now)
            fence = int(now[-1])
            if fence > conn.fence:
                with self._lock:
                    conn.fence = fence
                    self._lock.notify_all()
        return raised

    def _fail(self, err: ProxyError) -> None:
        with self._lock:
            first = self.error is None
            if first:
                self.error = err
            self._lock.notify_all()
        if first and self.on_error is not None:
            self.on_error(err)

    # -- launches ---------------------------------------------------------------------------
    def fence(self, epoch: int, timeout: float | None = None) -> None:
        """Mark the end of launch ``epoch`` on every QP (after its data, by RC order), then wait
        for every peer's mark."""
        e = self.pv.e
        for conn in self.qps.values():
            if self.mode == "write_flag":
                slot = conn.posted % conn.staging.numel()
                conn.staging[slot] = epoch
                self._post(
                    conn,
                    e.IBV_WR_RDMA_WRITE,
                    conn.staging.data_ptr() + 8 * slot,
                    8,
                    conn.staging_mr.lkey,
                    conn.remote_flags[0] + 8 * (conn.flags.numel() - 1),
                    conn.remote_flags[1],
                )
            else:
                addr, rkey = next(iter(self.remote[conn.remote].values()))[:2]
                self._post(
                    conn,
                    e.IBV_WR_RDMA_WRITE_WITH_IMM,
                    self._scratch.data_ptr(),
                    0,
                    self._scratch_mr.lkey,
                    addr,
                    rkey,
                    imm=_FENCE_IMM << 8 | epoch & 0xFF,
                )
        limit = self.timeout if timeout is None else timeout
        with self._lock:
            ok = self._lock.wait_for(
                lambda: self.error is not None or all(c.fence >= epoch for c in self.qps.values()),
                limit,
            )
        if self.error is not None:
            raise self.error
        if not ok:
            late = sorted(c.remote for c in self.qps.values() if c.fence < epoch)
            raise ProxyError(
                f"verbs: ranks {late} did not finish launch {epoch} within {limit:g} s"
            )

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._progress.join(1.0)
        for conn in self.qps.values():
            conn.qp.close()
        self.nic.close()
