"""backend="triton": run one rank's schedule with the persistent megakernel.

Memory: every rank allocates one arena of ``layout.arena_bytes`` bytes and one int32 flag array,
with torch symmetric memory when the graph spans several GPUs (``symm_mem.empty`` + ``rendezvous``;
pointers from ``buffer_ptrs``): a peer buffer's address is that peer's arena base plus the
buffer's offset, which every rank computes from the same graph. The flags are our own symmetric
allocation, never torch's signal pad (GPU.md). Events are never reset: launches are epoch-tagged.

Use: SPMD under torchrun (one process per GPU, torch.distributed initialised; ``run`` takes and
returns the rank's LOCAL shards, as DTensor local tensors), or a 1-rank graph on one GPU with
GLOBAL tensors. On the CPU, ``interpret=True`` runs the same kernel in Triton's interpreter with
one all-roles program (TRITON_INTERPRET=1 must be set before triton is imported).

Multi-node graphs (several nodes; GPUs of one host emulate them) add the network (net.py): a
command FIFO in pinned host memory and a native host proxy per rank, which the runtime owns
until ``close()``. The flag array then holds the proxies' net words after the events.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import TYPE_CHECKING

import torch

from mgraph.errors import InputError, MgraphError, WatchdogTimeout
from mgraph.graph import TaskGraph, torch_dtype
from mgraph.kinds import ROLES
from mgraph.ops.abi import POS_FIELDS, Q_LEN, Q_WORKERS, S_K0, S_K1, S_NW, SEG_FIELDS
from mgraph.settings import Settings

from ..memory import check_inputs, check_outputs_written, gather_outputs
from ..trace import TaskRecord, Trace
from .calls import BufferShards, _CallPlan, arena_views, assemble_local, buffer_shard, local_shards
from .dispatch import PUSH_KIND, body_constexprs, body_params, megakernel_for
from .encode import (
    GEMM_KINDS,
    PUSH_ID,
    ROLE_ALL,
    RankTables,
    encode_rank,
    gemm_block,
    kind_id,
    layout,
)
from .graph_checks import buffer_dtype_code, check_graph, supported_kinds, warn_pointer_gemms
from .inflight import InFlight, cuda_slot
from .interp_fixes import fix_interpreter

if TYPE_CHECKING:
    from mgraph.scheduler import Schedule

__all__ = ["TritonRuntime", "supported_kinds", "local_shards", "assemble_local", "run_in_process"]

BK = 64
GEMM_CONFIG = {"flatten": True, "num_stages": 3, "num_warps": 8}
# Sub-block of the reduce/copy bodies: 32 KiB bf16 per load, 128 B per thread in flight. 32x128
# measured latency-bound on H200 (about 2 GB/s per program pulling over NVLink).
RB_M, RB_N = 64, 256


class TritonRuntime:
    """One rank's compiled schedule: tables on the GPU, arena, flags; ``run`` launches it."""

    _plan: _CallPlan | None = None  # the per-call bookkeeping, built at the first load
    _record_host: torch.Tensor | None = None  # pinned host copy of the watchdog record (GPU)

    def __init__(
        self,
        schedule: Schedule,
        *,
        rank: int | None = None,
        device: torch.device | str | None = None,
        settings: Settings | None = None,
        interpret: bool = False,
        trace: bool = False,
        shared: _SharedMemory | None = None,
        gemm_config: dict | None = None,
        cuda_graph: bool = True,
        interpret_roles: bool = False,
    ) -> None:
        """``interpret_roles`` (tests): under the interpreter, run one program per worker as on
        a GPU instead of one program for every role; the interpreter runs programs one after
        another, so only graphs whose tasks wait for nothing can run this way."""
        graph = schedule.graph
        self.graph, self.schedule = graph, schedule
        self.settings = settings or Settings.from_env()
        self.interpret = interpret
        # (the interpreter has no clock: its traces hold only which program ran each task)
        self.trace_enabled = trace and (not interpret or interpret_roles)
        # The GEMM loop's compile-time configuration (benchmarks sweep it; the defaults are the
        # persistent TMA GEMM that GPU.md measured at 0.96-1.04x of cuBLAS).
        self.gemm_config = dict(GEMM_CONFIG, **(gemm_config or {}))
        unknown = set(self.gemm_config) - set(GEMM_CONFIG)
        if unknown:
            raise MgraphError(
                f"gemm_config: unknown keys {sorted(unknown)}",
                hint=f"known keys: {', '.join(GEMM_CONFIG)}",
            )
        world = graph.topology.world_size
        check_graph(graph, BK)
        self.shared = shared
        if world > 1 and shared is None:
            import torch.distributed as dist

            if not dist.is_initialized() or dist.get_world_size() != world:
                raise MgraphError(
                    f"{graph.op}: a {world}-rank graph on backend='triton' runs SPMD: start one "
                    f"process per GPU (torchrun --nproc_per_node={world}) and init "
                    "torch.distributed first",
                )
            rank = dist.get_rank() if rank is None else rank
        # rank None with shared memory: every rank at once in one interpreter program.
        self.rank = 0 if rank is None and shared is None else rank
        self.world = world
        if interpret:
            self.device = torch.device("cpu")
            fix_interpreter()  # bf16 tl.dot by value (interp_fixes.py)
        else:
            self.device = torch.device(device) if device is not None else torch.device(
                "cuda", torch.cuda.current_device()
            )
        self.layout = layout(graph)
        self.single_program = interpret and not interpret_roles
        self.tables: RankTables = encode_rank(
            schedule, self.rank, single_program=self.single_program, net=self.layout.net
        )
        # The adaptive controller (control.py) moves compute and nvlink programs between roles;
        # with one program for every role there is nothing to move, and neither is there on a
        # rank with no NVLink task and no NVLink program (GEMM alone, and the 2-GPU GEMM+AR and
        # GEMM+RS, whose epilogues do all the communication): its rule would keep every
        # program on compute, so the kernel is built without it and pays nothing for it (v15
        # measured the idle controller 1.4-4.6% slower than the static split on those ops).
        has_comm = not self.single_program and bool(
            int(self.tables.qinfo[1][Q_LEN]) or int(self.tables.qinfo[1][Q_WORKERS]))
        self.adaptive = bool(self.settings.adaptive) and has_comm
        self.mine = set(graph.topology.ranks) if self.rank is None else {self.rank}
        warn_pointer_gemms(graph, self.mine)
        self.epoch = 0
        self._scratch_buf: torch.Tensor | None = None
        self._graph = None  # the CUDA graph later launches replay (see launch)
        self._want_graph = bool(cuda_graph) and not interpret
        self.failed: MgraphError | None = None
        self.inflight = InFlight(cuda_slot)  # calls run without a wait (inflight.py)
        self.last_waited = True  # whether the last run waited (else its outputs are copies)
        self.net = None
        self._allocate()
        self._upload()
        # The kernel with one dispatch branch per kind this rank runs (dispatch.py).
        used = {k: kind_id(k) for k in self.tables.kinds if k != PUSH_KIND}
        if PUSH_KIND in self.tables.kinds:
            used[PUSH_KIND] = PUSH_ID
        self._kernel = megakernel_for(used, graph, self.tables.local_tasks,
                                      self.settings.ewise_chains)
        self._need_ab = any(n in ("ad0", "bd0") for k in used for n in body_params(k))
        # Counts one launch adds to a counter or a queue head (the epoch overflow bound).
        t = self.tables
        self._per_launch = max(
            [int(x) for x in t.waits[:, 2].tolist()] + [int(t.qinfo[:, 1].max()) + t.programs, 1]
        )
        self._args: dict | None = None  # the kernel's arguments, built at the first launch
        if self.layout.net is not None:
            from .net import KernelNet

            self.net = KernelNet(self)
            self._want_graph = False  # the proxies follow each launch: launch directly

    # -- set-up -------------------------------------------------------------------------------
    def _allocate(self) -> None:
        graph, lay, dev = self.graph, self.layout, self.device
        if self.shared is not None:
            self.arena = self.shared.arenas[self.rank or 0]
            self.flags = self.shared.flags[self.rank or 0]
            self.arenas = self.shared.arenas
            arena_ptrs = [a.data_ptr() for a in self.shared.arenas]
            flag_ptrs = [f.data_ptr() for f in self.shared.flags]
        elif self.world > 1:
            import torch.distributed as dist
            import torch.distributed._symmetric_memory as symm_mem

            from .ipc_share import IpcBuffers, ranks_share_a_gpu

            group = dist.group.WORLD
            if ranks_share_a_gpu(dev):  # symmetric memory refuses it: CUDA IPC (correctness runs)
                self.arena = torch.zeros(lay.arena_bytes, dtype=torch.uint8, device=dev)
                self.flags = torch.zeros(lay.flag_words, dtype=torch.int32, device=dev)
                arena_h, flags_h = IpcBuffers(self.arena), IpcBuffers(self.flags)
            else:
                self.arena = symm_mem.empty(lay.arena_bytes, dtype=torch.uint8, device=dev)
                arena_h = symm_mem.rendezvous(self.arena, group)
                # Our own flag buffer: torch's signal pad belongs to torch's collectives (GPU.md).
                self.flags = symm_mem.empty(lay.flag_words, dtype=torch.int32, device=dev)
                flags_h = symm_mem.rendezvous(self.flags, group)
            self.arena_handle, self.flags_handle = arena_h, flags_h
            self.flags.zero_()
            torch.cuda.synchronize(dev)
            dist.barrier()
            arena_ptrs, flag_ptrs = list(arena_h.buffer_ptrs), list(flags_h.buffer_ptrs)
        else:
            self.arena = torch.zeros(lay.arena_bytes, dtype=torch.uint8, device=dev)
            self.flags = torch.zeros(lay.flag_words, dtype=torch.int32, device=dev)
            arena_ptrs, flag_ptrs = [self.arena.data_ptr()], [self.flags.data_ptr()]
        self.views: dict[str, torch.Tensor] = {}
        for r in self.mine:
            arena = self.shared.arenas[r] if self.shared is not None else self.arena
            self.views.update(arena_views(graph, lay, r, arena))
        t = self.tables
        self.bufaddr = torch.tensor(
            [arena_ptrs[graph.buffers[b].rank] + lay.offset[b] for b in t.slots] or [0],
            dtype=torch.int64,
        )
        self.bufrows = torch.tensor([graph.buffers[b].rows for b in t.slots] or [0], dtype=torch.int32)
        self.bufcols = torch.tensor([graph.buffers[b].cols for b in t.slots] or [0], dtype=torch.int32)
        self.bufdt = torch.tensor(
            [buffer_dtype_code(graph, graph.buffers[b].dtype) for b in t.slots] or [0], dtype=torch.int32
        )
        self.evaddr = torch.tensor(
            [flag_ptrs[graph.events[e].rank] + 4 * lay.event_index[e] for e in t.event_slots] or [0],
            dtype=torch.int64,
        )
        # Entry barrier: the last flag of every rank counts peers' starts of each launch.
        if self.rank is None:
            peers = []
        else:
            node = graph.topology.node_of(self.rank)
            peers = [p for p in graph.topology.node_ranks(node) if p != self.rank]
        self.npeers = len(peers)
        self.peer_flags = torch.tensor(
            [flag_ptrs[p] + 4 * lay.flag_count for p in peers] or [0], dtype=torch.int64
        )
        self.start_flag = self.flags[lay.flag_count : lay.flag_count + 1]
        # The network's tables: where the proxies' net words live (absolute addresses).
        def word(rank: int, index: int) -> int:
            return flag_ptrs[rank] + 4 * (lay.net_base + index)

        netaddr, netfirst, netn = [], [], []
        for r, ws in t.event_net:
            netfirst.append(len(netaddr))
            netn.append(len(ws))
            netaddr += [word(r, w) for w in ws]
        self.netaddr = torch.tensor(netaddr or [0], dtype=torch.int64)
        self.netfirst = torch.tensor(netfirst or [0], dtype=torch.int32)
        self.netn = torch.tensor(netn or [0], dtype=torch.int32)
        self.exitaddr = torch.tensor([word(r, w) for r, w, _ in t.exits] or [0], dtype=torch.int64)
        self.exitcount = torch.tensor([n for _, _, n in t.exits] or [0], dtype=torch.int32)
        self.startaddr = torch.tensor([word(r, w) for r, w in t.starts] or [0], dtype=torch.int64)
        self.exitev = torch.tensor([e for e, _ in t.exit_events] or [0], dtype=torch.int32)
        self.exittotal = torch.tensor([n for _, n in t.exit_events] or [0], dtype=torch.int32)

    def _upload(self) -> None:
        dev, t = self.device, self.tables
        self.d = {
            name: tensor.to(dev)
            for name, tensor in dict(
                tasks=t.tasks, regions=t.regions, waits=t.waits, signals=t.signals,
                params=t.params,
                queues=t.queues, qinfo=t.qinfo, roles=t.roles, bufaddr=self.bufaddr,
                bufrows=self.bufrows, bufcols=self.bufcols, bufdt=self.bufdt, evaddr=self.evaddr,
                peer_flags=self.peer_flags, netaddr=self.netaddr, netfirst=self.netfirst,
                netn=self.netn,
                exitaddr=self.exitaddr, exitcount=self.exitcount, startaddr=self.startaddr,
                exitev=self.exitev, exittotal=self.exittotal,
                segs=t.segs if t.segs.numel() else torch.zeros(1, SEG_FIELDS, dtype=torch.int32),
                segpos=t.segpos if t.segpos.numel() else torch.zeros(1, POS_FIELDS, dtype=torch.int32),
                segwaits=t.segwaits if t.segwaits.numel() else torch.zeros(1, 4, dtype=torch.int32),
                cmds=t.cmds if t.cmds is not None else torch.zeros(1, 16, dtype=torch.int64),
            ).items()
        }
        self.d["heads"] = torch.zeros(len(ROLES) + 1, dtype=torch.int32, device=dev)
        self.d["err"] = torch.zeros(8, dtype=torch.int64, device=dev)
        self.d["abort"] = torch.zeros(1, dtype=torch.int32, device=dev)
        self.d["go"] = torch.zeros(1, dtype=torch.int32, device=dev)
        self.d["epoch"] = torch.zeros(1, dtype=torch.int32, device=dev)
        self.d["ctl"] = self._control_words().to(dev)
        # per task: start, waits met, end (%globaltimer ns), program
        self.d["trace"] = torch.zeros(max(len(t.local_tasks), 1) * 4, dtype=torch.int64, device=dev)
        gemms = [x for x in self.graph.tasks if x.kind in GEMM_KINDS]
        self.bm, self.bn = gemm_block(gemms) if gemms else (16, 16)

    # -- launches -----------------------------------------------------------------------------
    def load_inputs(
        self, inputs: dict[str, torch.Tensor], resident: Collection[str] = ()
    ) -> None:
        """Copy ``inputs`` into their buffers: GLOBAL tensors on one rank (or every rank in one
        process), the rank's local shards under SPMD. ``resident`` names inputs left out because
        their buffers still hold what an earlier load put there (a Program's unchanged weights):
        nothing is copied for them. Only an input that was loaded before and that no task writes
        can be resident: anything else is an InputError, never a stale value."""
        plan = self._call_plan()
        graph = self.graph
        skip = [n for n in dict.fromkeys(resident) if n not in inputs]
        if skip:
            never = sorted(n for n in skip if n not in plan.loaded)
            if never:
                raise InputError(
                    f"{graph.op}: inputs {never} were passed as resident, but their buffers do "
                    "not hold them (never loaded, or the graph writes those buffers)",
                    hint="pass these inputs",
                )
        if self.world == 1 or self.rank is None:
            if not plan.accepts(inputs, skip):
                # the named error; resident inputs are checked as the placeholders of what
                # was loaded
                check_inputs(graph, {**{n: plan.placeholders[n] for n in skip}, **inputs})
            for name, targets in plan.targets.items():
                if name not in inputs:
                    continue
                plan.loaded.discard(name)  # until every buffer of it holds the new value
                for buf, view in targets:
                    view.copy_(buffer_shard(buf, inputs).reshape(buf.rows, buf.cols))
                if name not in plan.volatile:
                    plan.loaded.add(name)
            return
        for name, bufs in plan.inputs.items():
            if name in skip:
                continue
            if name not in inputs:
                raise InputError(f"{graph.op}: rank {self.rank} got no local input {name!r}")
            given = inputs[name]
            plan.loaded.discard(name)
            for buf in bufs:
                # a BufferShards: the rank holds the input in buffers with different parts
                x = given.get(buf.id) if isinstance(given, BufferShards) else given
                if x is None:
                    raise InputError(f"{graph.op}: rank {self.rank} got no part of input "
                                     f"{name!r} for its buffer {buf.id}")
                if x.numel() != buf.rows * buf.cols or x.dtype != torch_dtype(buf.dtype):
                    raise InputError(
                        f"{graph.op}: rank {self.rank} input {name!r} is {tuple(x.shape)} "
                        f"{x.dtype}; its local shard is {buf.rows * buf.cols} elements of "
                        f"{buf.dtype}",
                        hint="under torchrun each rank passes its own shard (mgraph.runtime."
                        "megakernel.local_shards cuts them from global tensors)",
                    )
                self.views[buf.id].copy_(x.reshape(buf.rows, buf.cols))
            if name not in plan.volatile:
                plan.loaded.add(name)

    def loaded_inputs(self) -> set[str]:
        """The inputs that may be passed as ``resident`` to the next run: loaded before, and
        in buffers no task writes."""
        return set(self._call_plan().loaded)

    def _call_plan(self) -> _CallPlan:
        """The graph's per-call bookkeeping, worked out at the first load and kept."""
        if self._plan is None:
            self._plan = _CallPlan.of(self.graph, self.mine, self.views)
        return self._plan

    def launch(self, poison: bool = False) -> None:
        """One launch of the persistent kernel (no host sync).

        On a GPU, launches after the first replay a CUDA graph of (epoch + 1 on the device, the
        zeroed buffers' memsets, the kernel): a few microseconds of host time instead of the
        Python launcher's hundreds, which the GPU would otherwise sit idle for. Poisoned
        launches and multi-node graphs (whose proxies are driven per launch) launch directly.
        """
        if self.failed is not None:
            raise self.failed
        import triton

        # The scratch where programs build their TMA descriptors: one grow-only buffer per
        # runtime, kept alive while launches may still run (not a fresh block per launch that
        # the caching allocator could hand out again while the kernel reads it).
        triton.set_allocator(self._scratch)
        self.epoch += 1
        self._check_epoch()
        if self._graph is not None and not poison:
            self._graph.replay()
            return
        if poison:
            for buf in self.graph.buffers.values():
                if buf.rank in self.mine and buf.role != "input" and not buf.zeroed:
                    self.views[buf.id].fill_(float("nan"))
        self.d["epoch"].fill_(self.epoch)
        self._zero_and_launch()
        if self._want_graph and not poison and self.epoch >= 2:
            self._capture()

    def _zero_and_launch(self) -> None:
        for buf in self.graph.buffers.values():
            if buf.rank in self.mine and buf.zeroed:
                # epilogues reduce-add into it; peers only after the entry barrier
                self.views[buf.id].zero_()
        if self._args is None:
            self._args = self._kernel_args()
            self._compile_and_meet()
        self.compiled = self._kernel[(self.tables.programs,)](**self._args)

    def _compile_and_meet(self) -> None:
        """One process per rank: compile the kernel, load it and allocate its scratch, then
        wait on the host until every rank has done so, before the first launch. Triton compiles
        at the first call, for seconds, and ranks compile different kernels (their tables and
        ``rank`` are specialised), so one rank may hit a cache another misses; and GPU.md
        records a first launch whose module load waited for a spinning kernel to finish, so the
        load happens here too. Without this, the ranks that launched first spent their entry
        barrier's watchdog on a peer still compiling or loading (issue 15: "the entry barrier
        ... after 5 s" on the first configuration of each process only)."""
        if self.world == 1 or self.shared is not None or self.interpret:
            return  # one process holds every rank (or only one): nobody to wait for
        import torch.distributed as dist

        programs = self.tables.programs
        compiled = self._kernel.warmup(grid=(programs,), **self._args)
        # Private Triton API, hence getattr: load the module now, and size the scratch the
        # launcher would allocate (programs x CTAs x bytes per program, its formula).
        init = getattr(compiled, "_init_handles", None)
        if init is not None:
            init()
        meta = getattr(compiled, "metadata", None)
        per_program = getattr(meta, "global_scratch_size", 0) or 0
        if per_program > 0:
            self._scratch(programs * getattr(meta, "num_ctas", 1) * per_program, 128, None)
        torch.cuda.synchronize(self.device)
        dist.barrier()

    def _kernel_args(self) -> dict:
        """Every kernel argument by its name in kernel.megakernel's signature (nothing
        positional to keep in step between the two files; a misspelt name fails at the first
        launch). All are fixed for the runtime's life: the epoch is read from the device."""
        d, t, net = self.d, self.tables, self.net
        # The interpreter counts polls, not nanoseconds: ~200k polls per watchdog second (the
        # default 5 s gives 1M polls, enough for a proxy round trip under the interpreter).
        limit = (int(self.settings.watchdog_s * 1e9) if not self.interpret
                 else max(1000, int(self.settings.watchdog_s * 2e5)))
        if net is not None:
            fifo = dict(ring=net.fifo.ring, dhead=net.dhead, tail=net.fifo.tail,
                        capacity=net.fifo.capacity)
        else:  # unused: HAS_NET is off
            fifo = dict(ring=d["exitaddr"], dhead=d["exitaddr"], tail=d["exitaddr"], capacity=1)
        nseg = int(t.segs.shape[0])
        cfg = self.gemm_config
        ksizes = {int(r[S_K1]) - int(r[S_K0]) for r in t.segs.tolist()}
        tables = {name: d[name] for name in (
            "tasks", "regions", "waits", "signals", "params", "bufaddr", "bufrows", "bufcols",
            "bufdt",            "evaddr", "queues", "qinfo", "roles", "heads", "segs", "segpos", "segwaits", "err",
            "abort", "go", "peer_flags", "trace", "cmds", "startaddr", "netaddr", "netfirst",
            "netn", "exitaddr", "exitcount", "exitev", "exittotal")}
        tables["param_table"] = tables.pop("params")  # see kernel.megakernel
        return dict(
            **tables, **fifo,
            epoch_ptr=d["epoch"], rank=-1 if self.rank is None else self.rank, limit=limit,
            nseg=nseg, start_flags=self.start_flag, npeers=self.npeers,
            a0_slot=t.a0_slot, b0_slot=t.b0_slot, start_cmds=t.start_cmds,
            nexit=len(t.exits), nexitev=len(t.exit_events),
            DT=_tl_dtype(self.graph.dtype), BM=self.bm, BN=self.bn, BK=BK, RB_M=RB_M, RB_N=RB_N,
            NEED_AB=self._need_ab, **body_constexprs(self.graph, t.local_tasks),
            USE_TIMER=not self.interpret, TRACE=self.trace_enabled,
            BARRIER=self.npeers > 0 or t.start_cmds > 0,
            HAS_NET=net is not None,
            HAS_SEGS=nseg > 0, SEG_NW=int(t.segs[0][S_NW]) if nseg else 1,
            SEG_ADD=t.prefix_adds, SEG_WAITS=bool(t.segwaits.shape[0]),
            seg_p=max(1, int(t.qinfo[ROLE_ALL if self.single_program else 0][Q_WORKERS])),
            SEG_K=ksizes.pop() if len(ksizes) == 1 else 0,
            FLATTEN=bool(cfg["flatten"]),
            ctl=d["ctl"], ADAPTIVE=self.adaptive,
            # the interpreter has no clock (now() is 0): a window of 0 decides after every task
            window_ns=0 if self.interpret else int(self.settings.adaptive_window_us * 1000),
            max_comm=int(self.schedule.hardware.nvlink_max_sms),
            pool=int(t.qinfo[0][Q_WORKERS] + t.qinfo[1][Q_WORKERS]) if not self.single_program else 0,
            num_warps=int(cfg["num_warps"]), num_stages=int(cfg["num_stages"]),
        )

    def _control_words(self) -> torch.Tensor:
        """The controller's int64 words (control.py): the schedule's nvlink programs as the
        target each launch starts from, and the cost model's ns per task of each role."""
        from mgraph.scheduler.costmodel import task_costs

        from .control import C_INITIAL, C_PREVIOUS, C_PRIOR, C_TARGET, CTL_WORDS

        ctl = torch.zeros(CTL_WORDS, dtype=torch.int64)
        ctl[C_PREVIOUS] = -1
        nvlink = int(self.tables.qinfo[1][Q_WORKERS]) if not self.single_program else 0
        ctl[C_TARGET] = ctl[C_INITIAL] = nvlink
        if self.adaptive:
            costs = task_costs(self.graph, self.schedule.hardware)
            for r, role in enumerate(("compute", "nvlink")):
                mine = [costs[t.id] for t in self.graph.tasks
                        if t.role == role and t.rank in self.mine]
                ctl[C_PRIOR + r] = int(1e9 * sum(mine) / len(mine)) if mine else 0
        return ctl

    def _capture(self) -> None:
        """Record (epoch + 1, memsets, kernel) as a CUDA graph; later launches replay it. A
        capture that fails leaves direct launches in place (slower on the host, same result)."""
        import warnings

        self._want_graph = False
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.current_stream(self.device).synchronize()
            with torch.cuda.graph(graph):
                self.d["epoch"].add_(1)
                self._zero_and_launch()
        except Exception as exc:  # noqa: BLE001 - any capture failure: keep direct launches
            warnings.warn(f"mgraph: CUDA graph capture failed ({exc!r}); launching directly",
                          stacklevel=3)
            return
        self._graph = graph

    def _check_epoch(self) -> None:
        """Counters are never reset; refuse the launch whose targets would overflow int32."""
        per_launch = self._per_launch
        if self.epoch * per_launch >= 2**31 - 1:
            self.failed = MgraphError(
                f"{self.graph.op}: launch {self.epoch} would overflow the int32 event counters "
                f"({per_launch} counts per launch)",
                hint="build a new TritonRuntime (fresh counters) to launch again",
            )
            raise self.failed

    def kernel_info(self) -> dict:
        """Registers, spills and shared memory of the last launch's compiled kernel (GPU)."""
        k = getattr(self, "compiled", None)
        if k is None or self.interpret:
            return {}
        return {"n_regs": getattr(k, "n_regs", None), "n_spills": getattr(k, "n_spills", None),
                "shared": getattr(getattr(k, "metadata", None), "shared", None)}

    def _scratch(self, size: int, align: int, stream) -> torch.Tensor:
        if self._scratch_buf is None or self._scratch_buf.numel() < size:
            self._scratch_buf = torch.empty(size, dtype=torch.int8, device=self.device)
        return self._scratch_buf

    def check(self, record: torch.Tensor | None = None) -> None:
        """Raise the proxy's error or the kernel's watchdog record, if any. ``record``: a host
        copy of the record that the caller has waited for (``run``'s); without it the record
        is read from the device (synchronises)."""
        err = (self.d["err"].cpu() if record is None else record).tolist()
        if self.net is not None:
            try:
                self.net.check()
            except MgraphError as exc:  # the root cause: the kernel's waits only timed out
                self.failed = exc
                raise
        if err[0]:
            _, rank, pid, task, slot, value, target, epoch = err
            report = ""
            if self.settings.net_report and self.net is not None:
                from .net_report import net_report

                try:
                    report = "\n" + net_report(self)
                except Exception as exc:  # noqa: BLE001 - a diagnostic never hides the timeout
                    report = f"\n(MGRAPH_NET_REPORT failed: {exc!r})"
            self.failed = WatchdogTimeout(
                f"watchdog (triton): {who(rank)}, program {pid}: {self._what(task, slot)}: "
                f"value {value}, target {target}, epoch {epoch}, after "
                f"{self.settings.watchdog_s:g} s{report}",
                hint=_watchdog_hint(task, slot),
            )
            raise self.failed

    def _what(self, task: int, slot: int) -> str:  # noqa: C901 - one branch per record code
        """What a kernel error record waited for, in words (kernel.py lists the codes)."""
        t, plan = self.tables, self.layout.net
        if task == -1:
            return "the entry barrier (node peers' start flags)"
        if task == -3:
            if slot == -2:
                return "pushing a start SIGNAL: the command FIFO stayed full (value: ticket, " \
                    "target: the proxy's tail)"
            rank, word = t.starts[slot]
            return f"the entry barrier: {plan.describe(rank, word)} (a remote peer's start)"
        if task == -2:
            rank, word, _ = t.exits[slot]
            return f"the end-of-launch wait for net word {plan.describe(rank, word)} on rank {rank}"
        if task == -5:
            ev = self.graph.events[t.event_slots[slot]]
            return (f"a GEMM segment's hoisted wait for event {ev.name!r} (rank {ev.rank}): "
                    "the copies it waits for never landed")
        if task == -4:
            ev = self.graph.events[t.event_slots[slot]]
            return (f"the end-of-launch wait for event {ev.name!r}: stores that node peers owe "
                    "this rank's output")
        name = self.graph.tasks[task].name
        if slot == -2:
            return f"task {name!r} pushing a command: the FIFO stayed full (value: ticket, " \
                "target: the proxy's tail; is the proxy draining?)"
        ev = self.graph.events[t.event_slots[slot]]
        return f"task {name!r} waiting for event {ev.name!r} (rank {ev.rank})"

    def close(self) -> None:
        """Stop the network's proxy (multi-node graphs); the runtime cannot launch after.
        Calls still in flight are waited for first (their buffers must outlive them)."""
        self.inflight.poll(lambda record: None, wait=True)
        if self.net is not None:
            self.net.close()
            if self.failed is None:
                self.failed = MgraphError(f"{self.graph.op}: this runtime was closed")

    def __enter__(self) -> TritonRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(
        self,
        inputs: dict[str, torch.Tensor],
        *,
        poison: bool = True,
        resident: Collection[str] = (),
        wait: bool = True,
    ):
        """Load ``inputs`` (``resident``: see load_inputs), launch once (``poison``: NaN-fill
        the scratch and output buffers first, see launch), wait for the kernel and check its
        watchdog record. The outputs: GLOBAL tensors of their own on one rank or every rank in
        one process; under SPMD the rank's local shards, views of its buffers (valid until the
        next launch). ``wall_s`` runs from the launch to the kernel's end (with a copied
        output's copy and the watchdog record's, which are queued behind the kernel).

        ``wait=False`` (on a GPU, tracing off, floating-point outputs, and either every output
        in one buffer or SPMD, whose outputs are the rank's shards; otherwise the call waits):
        return once the kernel is queued, outputs copied and NaN if it times out; its record is
        checked by a later call or ``synchronize()`` (inflight.py).
        ``wall_s`` is then the host's time to issue the call."""
        from mgraph.runtime.reference import RunResult

        if self.inflight.calls:  # an earlier call's timeout comes first
            self.inflight.poll(self.check)
        self.load_inputs(inputs, resident)
        start = time.perf_counter()
        self.launch(poison=poison)
        if not wait and not self.interpret and not self.trace_enabled:
            mine = self._whole_outputs(masked=True)
            if mine is None and self.world > 1 and self.rank is not None:
                mine = self._local_outputs_masked()
            if mine is not None:
                self.inflight.add(self.inflight.queue(self.d["err"]), self.check)
                self.last_waited = False  # its outputs are copies of the caller's own
                return RunResult(mine, self.trace(), time.perf_counter() - start, self.epoch, {})
        # queued before the host waits: the GPU runs them right after the kernel, not after a
        # round trip to the host (the record's copy: one wait for both, not a second one)
        self.last_waited = True
        whole = self._whole_outputs()
        record = self._queue_record()
        if not self.interpret:
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - start
        self.check(record)  # before reading anything else: a timeout is the root cause
        if whole is not None:
            outputs = whole
        elif self.world == 1 or self.rank is None:
            outputs = gather_outputs(self.graph, self.views)
        else:  # views of the rank's buffers (a dict of the caller's own)
            outputs = dict(self._local_views())
        return RunResult(outputs, self.trace(), wall, self.epoch, {})

    def _local_views(self) -> dict[str, torch.Tensor]:
        """SPMD: each output's local shard as a view of this rank's buffer, worked out once."""
        plan = self._call_plan()
        if plan.local_outputs is None:
            plan.local_outputs = {
                buf.binding.tensor: assemble_local(
                    self.graph, self.rank, buf.binding.tensor, self.views[buf.id]
                )
                for buf in self.graph.buffers.values()
                if buf.rank == self.rank and buf.role == "output"
            }
        return plan.local_outputs

    def _local_outputs_masked(self) -> dict[str, torch.Tensor] | None:
        """SPMD, a call that does not wait: each local shard copied (the next launch rewrites
        the buffers) and NaN wherever the watchdog record is set, in one pass, as
        _whole_outputs(masked=True) does for one rank; None when an output is not floating
        point (no NaN to mark it: that call waits)."""
        views = self._local_views()
        if not all(view.is_floating_point() for view in views.values()):
            return None
        timed_out = self.d["err"][:1] != 0
        return {name: torch.where(timed_out, float("nan"), view) for name, view in views.items()}

    def _whole_outputs(self, masked: bool = False) -> dict[str, torch.Tensor] | None:
        """Each output as a copy of the one buffer that holds all of it, when every output has
        such a buffer (one rank, or every rank in one process with unreplicated outputs);
        otherwise None (gather_outputs assembles them). A copy, not the buffer: the caller's
        outputs must stay as they are when the next launch writes the buffers. ``masked``
        (a call that does not wait): NaN wherever the watchdog record is set, in the same one
        pass as the copy; None when an output is not floating point (no NaN to mark it)."""
        plan = self._call_plan()
        if plan.whole is None or not (self.world == 1 or self.rank is None):
            return None
        if not plan.written_checked:
            check_outputs_written(self.graph)
            plan.written_checked = True
        if not masked:
            return {name: view.clone() for name, view in plan.whole_views.items()}
        if not all(view.is_floating_point() for view in plan.whole_views.values()):
            return None
        timed_out = self.d["err"][:1] != 0  # the record is never cleared: once set, every
        # later call's outputs are NaN too
        return {name: torch.where(timed_out, float("nan"), view)  # one pass, as clone's
                for name, view in plan.whole_views.items()}

    def synchronize(self) -> None:
        """Wait for every call run without a wait and raise the first timeout among them."""
        self.inflight.poll(self.check, wait=True)

    def _queue_record(self) -> torch.Tensor | None:
        """On a GPU: the watchdog record's copy into pinned host memory, queued behind the
        kernel (valid once the host has waited for the stream); None in the interpreter, whose
        record is host memory already."""
        if self.interpret:
            return None
        host = self._record_host
        if host is None:
            host = self._record_host = torch.empty(
                self.d["err"].shape, dtype=self.d["err"].dtype, pin_memory=True
            )
        host.copy_(self.d["err"], non_blocking=True)
        return host

    def trace(self) -> Trace:
        """Per-task records of the last launch (when built with trace=True)."""
        if not self.trace_enabled:
            return Trace(backend="triton")
        raw = self.d["trace"].view(-1, 4).cpu()
        t0 = int(raw[:, 0][raw[:, 0] > 0].min()) if (raw[:, 0] > 0).any() else 0
        roles = self.tables.roles.tolist()
        records = []
        for local, tid in enumerate(self.tables.local_tasks):
            s, ready, e, pid = raw[local].tolist()
            t = self.graph.tasks[tid]
            records.append(TaskRecord(tid, t.name, t.kind, self.rank, t.role, int(pid) -
                                      roles.index(roles[pid]), (s - t0) / 1e9, (e - t0) / 1e9,
                                      (ready - t0) / 1e9))
        return Trace(records, backend="triton")


class _SharedMemory:
    """Every rank's arena and flags in one process (the interpreter's multi-rank mode)."""

    def __init__(self, graph: TaskGraph, device: torch.device) -> None:
        lay = layout(graph)
        ranks = graph.topology.ranks
        self.arenas = [torch.zeros(lay.arena_bytes, dtype=torch.uint8, device=device) for _ in ranks]
        self.flags = [torch.zeros(lay.flag_words, dtype=torch.int32, device=device) for _ in ranks]


def run_in_process(
    schedule: Schedule, inputs: dict[str, torch.Tensor], *, launches: int = 1,
    settings: Settings | None = None,
) -> dict[str, torch.Tensor]:
    """Every rank of ``schedule`` in this process under the Triton interpreter: one program runs
    all ranks' tasks in the schedule's global order over every rank's arena, with the same
    tables, events, epochs and tile bodies the GPU uses. GLOBAL inputs and outputs."""
    shared = _SharedMemory(schedule.graph, torch.device("cpu"))
    rt = TritonRuntime(schedule, rank=None, interpret=True, shared=shared, settings=settings)
    result = None
    try:
        for _ in range(launches):
            result = rt.run(inputs)
    finally:
        rt.close()
    assert result is not None
    return result.outputs


def _watchdog_hint(task: int, slot: int) -> str:
    """What to check after a watchdog record (codes as in TritonRuntime._what)."""
    if task in (-1, -3) and slot != -2:  # the entry barrier: a peer's start never came
        return ("a peer did not start this launch within the watchdog: it failed or stopped "
                "before launching (see its own error), or it was held up on its host (every "
                "rank must launch every time); MGRAPH_WATCHDOG_S raises the bound; rebuild the "
                "runtime to retry")
    return ("a signal is missing, or a peer never launched or stopped on an error of its own "
            "(a peer's error is the cause: read every rank's); rebuild the runtime to retry")


def who(rank: int) -> str:
    return "every rank (one interpreter program)" if rank == -1 else f"rank {rank}"


def _tl_dtype(name: str):
    import triton.language as tl

    return {"bfloat16": tl.bfloat16, "float16": tl.float16, "float32": tl.float32}[name]

