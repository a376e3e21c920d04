"""The tile-body ABI: how one rank's schedule is laid out in device tables for the megakernel.

The encoder (mgraph/runtime/megakernel/encode.py) writes these int32 tables and the tile bodies
(in each op's file) read them, so both sides import the field indices from here.

- tasks   [T, TASK_FIELDS]: kind id, first/number of reads, writes, waits, signals, graph task id,
  first/number of FIFO commands (rdma tasks: the rows of the command table the worker pushes),
  first/number of params (int32 words of ``params``: ints as they are, floats as float32 bits,
  in the order the kind declares them: ``define_kind(..., params=(...))``)
- regions [R, REGION_FIELDS]: buffer slot, row0, row1, col0, col1
- waits   [Wn, WAIT_FIELDS]: event slot, count, signals per launch (target = (epoch-1)*total+count),
  and 1 when a signaller runs on another GPU (the wait then needs system scope)
- signals [Sn, SIGNAL_FIELDS]: event slot, and 1 when the event lives on another GPU
- buffer tables per slot: address (int64), rows, cols, dtype code (int32: 0 the graph's dtype,
  1 float32; bodies that take ``bufdt`` read and write through load_f32/store_any); event
  table: address (int64)
"""

from __future__ import annotations

__all__ = [
    "TASK_FIELDS",
    "F_KIND",
    "F_READ0",
    "F_NREAD",
    "F_WRITE0",
    "F_NWRITE",
    "F_WAIT0",
    "F_NWAIT",
    "F_SIG0",
    "F_NSIG",
    "F_GID",
    "F_CMD0",
    "F_NCMD",
    "F_PARAM0",
    "F_NPARAM",
    "R_SLOT",
    "R_ROW0",
    "R_ROW1",
    "R_COL0",
    "R_COL1",
    "W_SLOT",
    "W_COUNT",
    "W_TOTAL",
    "W_SYS",
    "G_SLOT",
    "G_SYS",
    "REGION_FIELDS",
    "WAIT_FIELDS",
    "SIGNAL_FIELDS",
    "QINFO_FIELDS",
    "Q_OFF",
    "Q_LEN",
    "Q_WORKERS",
    "Q_STATIC",
    "SEG_FIELDS",
    "S_START",
    "S_LEN",
    "S_A",
    "S_B",
    "S_K0",
    "S_K1",
    "S_NW",
    "S_W0",
    "S_W1",
    "S_WAIT0",
    "S_NWAIT",
    "POS_FIELDS",
    "P_AM",
    "P_BK",
    "P_BN",
    "P_W0M",
    "P_W0N",
    "P_W1M",
    "P_W1N",
    "P_TASK",
    "HAVE_TRITON",
]

TASK_FIELDS = 14
F_KIND, F_READ0, F_NREAD, F_WRITE0, F_NWRITE, F_WAIT0, F_NWAIT, F_SIG0, F_NSIG, F_GID = range(10)
F_CMD0, F_NCMD = 10, 11
F_PARAM0, F_NPARAM = 12, 13  # the task's row of ``params`` (its kind's declared params, in order)
REGION_FIELDS = 5
R_SLOT, R_ROW0, R_ROW1, R_COL0, R_COL1 = range(5)
WAIT_FIELDS = 4
W_SLOT, W_COUNT, W_TOTAL, W_SYS = range(4)
SIGNAL_FIELDS = 2
G_SLOT, G_SYS = range(2)
# qinfo [roles + 1, QINFO_FIELDS]: where a role's queue starts in ``queues``, its length, its
# workers, and how many of its first tasks are GEMM segment tasks (run statically, see below)
QINFO_FIELDS = 4
Q_OFF, Q_LEN, Q_WORKERS, Q_STATIC = range(4)
# segs [S, SEG_FIELDS]: the compute queue's leading wait-free GEMM tasks, cut into segments of
# tasks that share A, B, K range and write buffers (one TMA descriptor each per segment): the
# segment's first queue position and length, A and B slots, K range, writes per task and the
# slots of writes 0 and 1 (stored through descriptors; later writes use pointer stores)
# and the segment's hoisted waits (rows of ``segwaits``, WAIT_FIELDS wide: every program waits
# for them once, before the segment's loop)
SEG_FIELDS = 11
S_START, S_LEN, S_A, S_B, S_K0, S_K1, S_NW, S_W0, S_W1, S_WAIT0, S_NWAIT = range(11)
# segpos [static tasks, POS_FIELDS]: per static position, everything its tile loop needs in one
# 32-byte row (no dependent loads through the task and region tables inside the GEMM loop): the
# A row, B row and column, write 0's and write 1's row and column, the local task index
POS_FIELDS = 8
P_AM, P_BK, P_BN, P_W0M, P_W0N, P_W1M, P_W1N, P_TASK = range(8)

try:  # triton is a Linux-only dependency; the CPU side of mgraph works without it
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without triton only
    HAVE_TRITON = False

if HAVE_TRITON:

    @triton.jit
    def load_region(regions, index):
        """(slot, row0, row1, col0, col1) of region ``index``."""
        p = regions + index * 5
        return tl.load(p), tl.load(p + 1), tl.load(p + 2), tl.load(p + 3), tl.load(p + 4)

    @triton.jit
    def buffer_base(bufaddr, slot, DT: tl.constexpr):
        """Typed pointer to the first element of buffer ``slot`` (local or a peer's)."""
        return tl.load(bufaddr + slot).to(tl.pointer_type(DT))

    _PARAM0, _NPARAM = tl.constexpr(F_PARAM0), tl.constexpr(F_NPARAM)

    @triton.jit
    def param_i32(params, tp, index):
        """Integer param ``index`` of the task whose row is ``tp``."""
        return tl.load(params + tl.load(tp + _PARAM0) + index)

    @triton.jit
    def param_f32(params, tp, index):
        """Float param ``index`` of the task whose row is ``tp`` (stored as float32 bits)."""
        return tl.load(params + tl.load(tp + _PARAM0) + index).to(tl.float32, bitcast=True)

    @triton.jit
    def load_f32(bufaddr, bufdt, slot, offsets, mask, DT: tl.constexpr):
        """Elements ``offsets`` of buffer ``slot`` as float32, whether the slot holds the graph's
        dtype or float32 (``bufdt``: 0 = DT, 1 = float32); masked-off lanes read 0."""
        if tl.load(bufdt + slot) == 1:
            x = tl.load(buffer_base(bufaddr, slot, tl.float32) + offsets, mask=mask, other=0.0)
        else:
            x = tl.load(buffer_base(bufaddr, slot, DT) + offsets, mask=mask, other=0.0)
            x = x.to(tl.float32)
        return x

    @triton.jit
    def store_any(bufaddr, bufdt, slot, offsets, value, mask, DT: tl.constexpr):
        """Store ``value`` at ``offsets`` of buffer ``slot`` in the slot's own dtype."""
        if tl.load(bufdt + slot) == 1:
            tl.store(buffer_base(bufaddr, slot, tl.float32) + offsets, value.to(tl.float32), mask=mask)
        else:
            tl.store(buffer_base(bufaddr, slot, DT) + offsets, value.to(DT), mask=mask)

    __all__ += ["load_region", "buffer_base", "param_i32", "param_f32", "load_f32", "store_any"]
