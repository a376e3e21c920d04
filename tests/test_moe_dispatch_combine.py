from __future__ import annotations

import pytest
import torch

import mgraph as mg
from helpers import TOPOLOGIES, check_graph, rel_err, written_once
from mgraph.graph import ITEMSIZE, Task
from mgraph.kinds import kind_spec
from mgraph.ops.moe_dispatch_combine import kept_picks, rank_bytes, segment_capacity
from mgraph.runtime import run_sequential
from mgraph.settings import Settings

OP = "moe_dispatch_combine"


def build(topology: str, *, T_loc: int = 24, E_loc: int = 2, top_k: int = 2, **kw):
    world = mg.Topology.parse(topology).world_size
    # groups of one expert (the op's default groups several): the structure tests count per expert
    kw = {"H": 16, "F": 32, "expert_rows": 8, "combine_cols": 8, "expert_group": 1, **kw}
    return mg.ops.moe_dispatch_combine(
        T=T_loc * world, E=E_loc * world, top_k=top_k, topology=topology, **kw
    )


@pytest.mark.parametrize("topology", TOPOLOGIES)
@pytest.mark.parametrize("E_loc", [2, 3])
def test_matches_torch(topology, E_loc):
    g = build(topology, E_loc=E_loc, T_loc=16 if E_loc == 3 else 24)
    check_graph(g)
    for name in ("out", "send", "back", "recv", "ret"):
        written_once(g, name)


def dense_moe(x, router_logits, w_gate, w_up, w_down, top_k, drop=None):
    """Mixtral MoE written independently of mgraph (it shares no helper with the tile bodies):
    a dense [T, E] gate matrix from a masked softmax, every expert applied to every token.
    ``drop`` (bool [T, E]): picks whose gate is zeroed afterwards (not renormalised)."""
    logits = router_logits.double()
    kth = logits.sort(dim=-1, descending=True).values[:, top_k - 1 : top_k]
    masked = logits.masked_fill(logits < kth, float("-inf"))
    gates = masked.softmax(dim=-1)  # zero off the top k: softmax over the k kept logits
    if drop is not None:
        gates = gates.masked_fill(drop, 0.0)
    xd = x.double()
    out = torch.zeros_like(xd)
    for e in range(w_gate.shape[0]):
        h = torch.nn.functional.silu(xd @ w_gate[e].double()) * (xd @ w_up[e].double())
        out += gates[:, e : e + 1] * (h @ w_down[e].double())
    return out


@pytest.mark.parametrize("topology", ["1x2", "2x2"])
def test_matches_an_independent_reference(topology):
    """The runtime's output and the op's own reference both equal dense_moe (the op's reference
    shares route_topk/swiglu with the tile bodies, so it alone cannot catch a bug in them)."""
    g = build(topology, E_loc=2, T_loc=16, top_k=2)
    op = mg.ops.get_op(OP)
    inputs = op.random_inputs(g, seed=3)
    logits = inputs["router_logits"].double()
    top = logits.sort(dim=-1, descending=True).values
    assert (top[:, 1] - top[:, 2]).abs().min() > 1e-9, "a tie at the k-th logit: pick a seed"
    want = dense_moe(**inputs, top_k=2)
    got = mg.run(mg.schedule(g), inputs).outputs["out"]
    assert rel_err(got.double(), want) < 1e-4
    assert rel_err(op.run_reference(inputs, g.params)["out"].double(), want) < 1e-4


def test_single_tiles_and_one_gpu():
    # Tiles larger than the dims (one expert tile per segment, one combine tile) and W = 1.
    check_graph(build("1x2", expert_rows=64, combine_cols=256))
    check_graph(build("1x1", E_loc=4, top_k=3))


def test_top_k_equals_experts():
    check_graph(build("2x1", T_loc=16, E_loc=2, top_k=4))


def _run_skewed(graph, columns: list[int]) -> None:
    op = mg.ops.get_op(OP)
    inputs = op.random_inputs(graph, seed=3)
    inputs["router_logits"][:, columns] += 50.0  # every token prefers these experts
    got = run_sequential(graph, inputs)["out"]
    want = op.run_reference(inputs, graph.params)["out"]
    assert rel_err(got, want) < 1e-4


@pytest.mark.parametrize("topology", ["2x4", "4x2"])
def test_skewed_router_no_token_dropped(topology):
    # capacity_factor = E / top_k: segments of T_loc rows, which no routing can overflow
    g = build(topology, T_loc=16, capacity_factor=8.0)
    assert g.buffers["send@0"].rows == 16 * g.params["E"]
    E = g.params["E"]
    _run_skewed(g, [0])  # one expert gets every token of every rank: its capacity is full
    _run_skewed(g, [E - 2, E - 1])  # every token goes to the last rank only


def test_skewed_router_drops_by_the_policy():
    """Default capacity_factor 4 at T_loc=16, E=16, top_k=2: segments of 8 rows. Every token
    prefers expert 5, so each rank's tokens 8..15 lose that pick (the first 8, ascending, keep
    it); the runtime equals dense_moe with exactly those gates zeroed, not renormalised."""
    topology, T_loc = "2x4", 16
    g = build(topology, T_loc=T_loc)
    assert g.buffers["send@0"].rows == 8 * 16
    op = mg.ops.get_op(OP)
    inputs = op.random_inputs(g, seed=4)
    inputs["router_logits"][:, 5] += 50.0
    top = inputs["router_logits"].double().sort(dim=-1, descending=True).values
    assert (top[:, 1] - top[:, 2]).abs().min() > 1e-9, "a tie at the k-th logit: pick a seed"
    _, experts = inputs["router_logits"].topk(2, dim=-1)
    drop = torch.zeros(8 * T_loc, 16, dtype=torch.bool)
    for source in range(8):  # per (source rank, expert): picks past the 8th are dropped
        seen = [0] * 16
        for t in range(source * T_loc, (source + 1) * T_loc):
            for e in experts[t].tolist():
                seen[e] += 1
                drop[t, e] = seen[e] > 8
    assert drop[:, 5].sum() == 8 * 8
    want = dense_moe(**inputs, top_k=2, drop=drop)
    got_all = run_sequential(g, inputs)
    got = got_all["out"]
    assert rel_err(got.double(), want) < 1e-4
    assert rel_err(op.run_reference(inputs, g.params)["out"].double(), want) < 1e-4
    assert rel_err(dense_moe(**inputs, top_k=2), want) > 1e-2  # the drops do change the output
    _, _, kept = kept_picks(inputs["router_logits"], 2, T_loc, 8)
    assert (~kept).sum() == drop.sum()
    # ... and the op says so: per (source rank, expert) the picks it dropped, exact
    per_source = drop.view(8, T_loc, 16).sum(1).float()
    assert torch.equal(got_all["dropped"], per_source)
    assert torch.equal(op.run_reference(inputs, g.params)["dropped"], per_source)
    assert got_all["dropped"].sum() == 8 * 8 and got_all["dropped"][:, 5].tolist() == [8.0] * 8


@pytest.mark.parametrize("capacity", [12, 5])
def test_route_tile_packs_segments(capacity):
    """Capacity T_loc = 12: nothing dropped, expert 4 exactly full. Capacity 5: each segment
    keeps its first 5 tokens (ascending), the others' picks are dropped from the picks map."""
    T_loc, E, E_loc, k, H = 12, 6, 3, 2, 5
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T_loc, H, generator=gen)
    logits = torch.randn(T_loc, E, generator=gen)
    logits[:, 4] += 50.0  # expert 4's segment fills up to its capacity
    send = torch.full((E * capacity, H), float("nan"))
    meta = torch.full((E * capacity, 3), float("nan"))
    counts = torch.full((E // E_loc, E_loc), float("nan"))
    pick_rows, pick_weights = torch.full((2, T_loc, E), float("nan"))
    dropped = torch.full((1, E), float("nan"))
    params = {"top_k": k, "experts_per_rank": E_loc, "expert0": 0, "capacity": capacity}
    task = Task(0, "route", 0, "compute", "moe_route", [], [], params=params)
    writes = [send, meta, counts, pick_rows, pick_weights, dropped]
    kind_spec("moe_route").run_cpu(task, [x, logits], writes)
    weights, experts = torch.softmax(logits.topk(k).values, -1), logits.topk(k).indices
    seen = torch.zeros(T_loc, dtype=torch.long)
    for e in range(E):
        seg = send[e * capacity : (e + 1) * capacity]
        seg_meta = meta[e * capacity : (e + 1) * capacity]
        tokens = (experts == e).any(-1).nonzero().flatten()[:capacity]  # the kept picks
        n = len(tokens)
        assert seg_meta[:n, 0].long().tolist() == tokens.tolist()  # packed, ascending
        assert torch.equal(seg[:n], x[tokens])
        assert (seg_meta[:n, 2] == e % E_loc).all()
        for row in range(n):
            t = tokens[row]
            assert seg_meta[row, 1] == weights[t][experts[t] == e].item()
            # the picks map: where token t's output from e lands in back, and its weight
            assert pick_rows[t, e] == e * capacity + row and pick_weights[t, e] == seg_meta[row, 1]
        others = torch.ones(T_loc, dtype=torch.bool)
        others[tokens] = False  # not picked, or dropped
        assert (pick_rows[others, e] == -1).all() and (pick_weights[others, e] == 0).all()
        assert counts.view(-1)[e] == n
        # Capacity bounds the buffer, not the work: rows past the count are never written.
        assert seg[n:].isnan().all() and seg_meta[n:].isnan().all()
        seen[tokens] += 1
    assert counts.view(-1)[4] == capacity  # exactly full
    hits = torch.zeros(T_loc, E).scatter_(1, experts, 1.0).sum(0)  # picks per expert
    # every pick is either packed (counted) or reported dropped
    assert (dropped.view(-1) + counts.view(-1)).tolist() == hits.tolist()
    if capacity == T_loc:
        assert (seen == k).all() and counts.sum() == T_loc * k
        assert (dropped == 0).all()
    else:  # every token picked expert 4; only the first `capacity` kept it
        assert (seen[:capacity] == k).all() and (seen[capacity:] < k).any()
        assert counts.view(-1).tolist() == hits.clamp(max=capacity).tolist()
        assert dropped[0, 4] == T_loc - capacity


@pytest.mark.parametrize("topology", ["2x4", "4x2"])
def test_traffic_rail_peers_and_nvlink_inside_nodes(topology):
    g = build(topology, T_loc=16)
    topo = g.topology
    E_loc, H = 2, 16
    seg = segment_capacity(16, 16, 2, 4.0, 8)  # rows per (source, expert): 8 of T_loc = 16
    assert seg == 8
    block = E_loc * seg
    assert g.buffers["w_gate@1"].shape == (E_loc * H, 32)  # one piece of E_loc experts
    assert g.buffers["w_down@1"].shape == (E_loc * 32, H)
    writers: dict[tuple, Task] = {}
    for t in g.tasks:
        for w in t.writes:
            writers[(w.buffer, w.row0)] = t
    rdma = [t for t in g.tasks if t.role == "rdma"]
    for t in rdma:  # cross-node traffic: rail peer -> rail peer only
        dst = g.buffers[t.writes[0].buffer].rank
        assert topo.node_of(t.rank) != topo.node_of(dst)
        assert topo.local_of(t.rank) == topo.local_of(dst)
    for d in topo.ranks:
        for s in topo.ranks:
            if s == d:
                continue
            slot = (s if s < d else s - 1) * block
            for buffer in ("recv", "recv_meta"):
                last = writers[(f"{buffer}@{d}", slot)]
                assert g.buffers[last.reads[0].buffer].name.startswith(("send", "relay"))
                hop = topo.rail_peer(s, topo.node_of(d))
                if topo.node_of(s) == topo.node_of(d):  # node peers receive over NVLink
                    assert (last.role, last.rank) == ("nvlink", s)
                elif hop == d:
                    assert (last.role, last.rank) == ("rdma", s)
                else:  # RDMA to the rail peer on d's node, which forwards over NVLink
                    assert (last.role, last.rank) == ("nvlink", hop)
                    first = writers[(last.reads[0].buffer, last.reads[0].row0)]
                    assert (first.role, first.rank) == ("rdma", s)
            back = writers[(f"back@{s}", d * block)]  # the return path mirrors it
            hop = topo.rail_peer(d, topo.node_of(s))
            want = "rdma" if topo.node_of(s) != topo.node_of(d) and hop == s else "nvlink"
            assert back.role == want
    remote_pairs = sum(topo.node_of(s) != topo.node_of(d) for s in topo.ranks for d in topo.ranks)
    # counts, then per group of experts (one expert each here) rows and metadata out and expert
    # outputs back; the proxy moves whole regions
    assert len(rdma) == (1 + 3 * E_loc) * remote_pairs
    st = g.stats()
    assert st.bytes_by_link["rdma"] == remote_pairs * (block * (2 * H * 4 + 3 * 4) + E_loc * 4)
    for name in ("relay", "relay_meta", "relay_ret", "relay_counts", "counts", "recv_counts"):
        written_once(g, name)


def test_cost_hints_use_expected_rows():
    T_loc, E_loc, k, H, F = 32, 2, 2, 16, 32
    g = build("2x4", T_loc=T_loc, E_loc=E_loc, top_k=k, H=H, F=F)
    W = 8
    T = T_loc * W
    experts = [t for t in g.tasks if t.kind == "moe_expert"]
    seg = segment_capacity(T_loc, E_loc * W, k, 4.0, 8)
    assert seg == 16  # four times the mean load of 4 rows per (source, expert)
    assert len(experts) == W * E_loc * W * (seg // 8)  # (rank, expert, source, row tile)
    assert sum(t.flops for t in experts) == pytest.approx(6.0 * T * k * H * F)
    capacity = 6.0 * T * (E_loc * W) * H * F  # what the worst-case capacity would charge
    assert sum(t.flops for t in experts) < capacity / 4
    spec = kind_spec("moe_expert")
    for t in experts:  # the kind's flops facet agrees with the hint the lowering passed
        shapes = [(r.row1 - r.row0, r.col1 - r.col0) for r in t.reads]
        assert spec.flops_fn(shapes, [], t.params) == t.flops
    combine = [t for t in g.tasks if t.kind == "moe_combine"]
    assert sum(t.flops for t in combine) == pytest.approx(2.0 * T * k * H)
    assert st_kinds(g) == {
        ("compute", "moe_route"): W * W * E_loc,  # per rank, one per group (of one expert)
        ("compute", "moe_expert"): len(experts),
        ("compute", "moe_combine"): W * 2,
        # rows, metadata and return of each group of the 24 same-node pairs and the 24 relayed
        ("nvlink", "moe_move"): 3 * (24 + 24) * E_loc,
    }
    g2 = build("2x4", T_loc=T_loc, E_loc=E_loc, top_k=k, H=H, F=F, expert_group=2)
    assert st_kinds(g2)[("compute", "moe_route")] == W * W  # per rank, one per destination
    # same node: rows and return one move per expert (the pieces of _pieces), metadata per
    # group; relayed: the group's rows, metadata and return forwarded once each
    assert st_kinds(g2)[("nvlink", "moe_move")] == (2 * E_loc + 1) * 24 + 3 * 24


def st_kinds(g) -> dict:
    return {k: n for k, n in g.stats().by_role_kind().items() if k[1].startswith("moe")}


def test_kinds_have_bodies_and_costs():
    for name in ("moe_route", "moe_expert", "moe_combine"):
        spec = kind_spec(name)
        assert spec.cpu_body is not None and spec.flops_fn is not None


def test_bf16():
    g = build("2x1", dtype=torch.bfloat16, T_loc=16)
    assert g.buffers["send@0"].dtype == "bfloat16" and g.buffers["send_meta@0"].dtype == "float32"
    # the drop counts stay float32 (exact below 2**24) whatever the graph's dtype
    assert g.outputs["dropped"].dtype == "float32" and g.outputs["dropped"].shape == (2, 4)
    check_graph(g, tol=2e-2)


@pytest.mark.parametrize(
    "kw",
    [
        dict(T=30, E=8, top_k=2),  # T % W
        dict(T=32, E=6, top_k=2),  # E % W
        dict(T=32, E=8, top_k=9),  # top_k > E
        dict(T=32, E=8, top_k=0),
        dict(T=32, E=8, top_k=-1),
        dict(T=64, E=8, top_k=2, expert_rows=12),  # T/W = 16 not a multiple of the tile
        dict(T=32, E=8, top_k=2, combine_cols=0),
        dict(T=32, E=8, top_k=2, combine_rows=3),  # T/W = 8 not a multiple of the tile
        dict(T=32, E=16, top_k=2, expert_group=3),  # E/W = 4 not a multiple of the group
        dict(T=32, E=8, top_k=2, expert_group=0),
    ],
)
def test_bad_input(kw):
    with pytest.raises(mg.ShapeError) as info:
        mg.ops.moe_dispatch_combine(H=16, F=32, topology="1x4", **kw)
    assert OP in str(info.value)


ISSUE_SHAPE = dict(T=2 * 4096, H=7168, E=256, top_k=8, F=2048, expert_group=8, expert_rows=64,
                   combine_rows=64, combine_cols=256)  # fmt: skip


def test_issue_shape_fits_in_gpu_memory():
    """The issue's shape (4096 tokens per GPU, H=7168, 256 experts, top-8, F=2048, bf16, 2 ranks)
    builds and validates (about 1 s) and its buffers take what the capacity bound says: segments
    of 4 x 128 rows (four times an expert's mean load from one rank), 16.4 GiB per rank of which
    10.5 GiB are the rank's expert weights. Segments of T_loc rows (capacity_factor E / top_k =
    32: what the lowering did before) would take 56.6 GiB per rank and hit the size guard."""
    limits = Settings(max_bytes=64 << 30)
    g = mg.ops.moe_dispatch_combine(topology="1x2", dtype=torch.bfloat16, settings=limits,
                                    **ISSUE_SHAPE)  # fmt: skip
    g.validate()
    T_loc, k, E, H, F, W = 4096, 8, 256, 7168, 2048, 2
    assert segment_capacity(T_loc, E, k, 4.0, 64) == 512 == 4 * T_loc * k // E
    # every segment of every (source, expert): 4x what a source can route in all (T_loc * k)
    assert g.buffers["send@0"].shape == (4 * T_loc * k, H)
    per_rank = [0] * W
    for buf in g.buffers.values():
        per_rank[buf.rank] += buf.rows * buf.cols * ITEMSIZE[buf.dtype]
    bound = rank_bytes(1, W, **{n: ISSUE_SHAPE[n] for n in ("T", "H", "E", "top_k", "F")},
                       itemsize=2, expert_rows=64)  # fmt: skip
    assert per_rank == [bound, bound]
    weights = 3 * (E // W) * H * F * 2
    routed = (2 * W + 2 * (W - 1)) * (E // W) * 512 * H * 2  # send, back, recv, ret: 5.25 GiB
    hidden = W * (E // W) * 512 * F * 2  # 0.5 GiB
    # the rest (x, out, logits, metadata, picks map, counts) is below 0.2 GiB
    assert routed + weights + hidden < bound < routed + weights + hidden + 0.2 * 2**30
    assert bound < 16.5 * 2**30
    no_drop = rank_bytes(1, W, 8192, H, E, k, F, itemsize=2, capacity_factor=E / k)
    assert 56 * 2**30 < no_drop < 57 * 2**30
    with pytest.raises(mg.SizeLimitError):
        mg.ops.moe_dispatch_combine(topology="1x2", dtype=torch.bfloat16, settings=limits,
                                    capacity_factor=E / k, **ISSUE_SHAPE)  # fmt: skip


@pytest.mark.parametrize("factor", [0.0, -1.0])
def test_capacity_factor_must_be_positive(factor):
    with pytest.raises(mg.OptionError, match="capacity_factor"):
        build("1x2", capacity_factor=factor)


def test_traced_block_returns_only_the_module_output():
    """Inside a traced Program the op node has one output (the module's): the route tiles still
    count their drops, into a scratch buffer per rank, and the Program returns the module's
    output alone. Segments bounded on purpose (capacity_factor 1: 4 rows of 16 tokens per rank)
    and a router that sends every token to expert 2, so the traced graph does drop, as its
    standalone twin reports."""
    torch.manual_seed(0)
    T, H, E, k, F_ = 32, 16, 8, 2, 32

    class Expert(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj = torch.nn.Linear(H, F_, bias=False)
            self.up_proj = torch.nn.Linear(H, F_, bias=False)
            self.down_proj = torch.nn.Linear(F_, H, bias=False)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.top_k = k
            self.experts = torch.nn.ModuleList(Expert() for _ in range(E))

        def forward(self, x, logits):  # traced as a leaf under ExpertParallel
            raise AssertionError("not called: the plan lowers the block as a unit")

    x, logits = torch.randn(T, H), torch.randn(T, E)
    logits[:, 2] += 50.0
    options = {"capacity_factor": 1.0, "expert_rows": 4}
    plan = {"": mg.ExpertParallel(options=options)}
    prog = mg.compile(Block(), (x, logits), plan=plan, topology="1x2")
    assert list(prog.graph.outputs) == prog.opgraph.output_names == ["out"]
    scratch = [b for b in prog.graph.buffers.values() if b.name.endswith("/dropped")]
    assert len(scratch) == 2 and all(b.role == "scratch" and b.dtype == "float32" for b in scratch)
    got = prog(x, logits)
    assert isinstance(got, torch.Tensor) and got.shape == (T, H)
    alone = mg.ops.moe_dispatch_combine(T=T, H=H, E=E, top_k=k, F=F_, topology="1x2", **options)
    inputs = mg.ops.get_op(OP).random_inputs(alone, seed=0)
    inputs["router_logits"] = logits
    assert mg.run(mg.schedule(alone), inputs).outputs["dropped"][:, 2].tolist() == [12.0, 12.0]


# -- the default tiles (options left None) ---------------------------------------------------------
def test_default_tiles_at_issue_17s_size_are_the_measured_configuration():
    """At T=4096 tokens a GPU, H=7168, 256 experts, top-8, F=2048 (one GPU), the defaults build
    the graph NOTES v13 measured at 9.3 ms (512 expert rows, groups of 8, the 128/512 column
    split; 14.6 ms with 64-row tiles, groups of 1, no split): the same tasks, in order."""
    from test_compile_speed_digest import graph_digest

    kw = dict(topology="1x1", dtype=torch.bfloat16, T=4096, H=7168, E=256, top_k=8, F=2048)
    g = mg.ops.moe_dispatch_combine(**kw)
    assert {k: g.params[k] for k in ("expert_rows", "expert_group", "expert_cols_f",
                                     "expert_cols_h")} == {
        "expert_rows": 512, "expert_group": 8, "expert_cols_f": 128, "expert_cols_h": 512}
    measured = mg.ops.moe_dispatch_combine(**kw, expert_rows=512, expert_group=8,
                                           expert_cols_f=128, expert_cols_h=512)
    assert graph_digest(g) == graph_digest(measured)
    old = mg.ops.moe_dispatch_combine(**kw, expert_rows=64, expert_group=1, expert_split=False)
    assert (len(g.tasks), len(old.tasks)) == (9504, 4096)  # bench_moe's rows: tasks=9504, 4096


@pytest.mark.parametrize("T_loc", [1, 8, 40, 64, 128, 192, 256, 320, 384, 1024, 4096, 6144])
@pytest.mark.parametrize("E,top_k,cf", [(8, 2, 4.0), (64, 2, 1.0), (256, 8, 4.0), (16, 1, 8.0)])
def test_default_rows_keep_the_capacity_of_64_row_tiles(T_loc, E, top_k, cf):
    """The drop policy follows the segment capacity, which rounds up to whole row tiles: the
    default rows divide the capacity 64-row tiles give (and T/W), so it is unchanged. (A T/W
    above 64 that 64 does not divide is refused, as it was with 64-row tiles.)"""
    from mgraph.ops.moe_dispatch_combine import AUTO_ROWS, auto_tiles

    tiles = auto_tiles(T_loc, 4096, E, E, top_k, 2048, cf)
    rows = tiles["expert_rows"]
    base = segment_capacity(T_loc, E, top_k, cf, min(64, T_loc))
    assert segment_capacity(T_loc, E, top_k, cf, min(rows, T_loc)) == base
    assert rows in (*AUTO_ROWS, min(64, T_loc)) and (T_loc <= rows or T_loc % rows == 0)
    # the split only where a tile has 128 rows or more
    assert (tiles["expert_cols_f"] is not None) == (min(rows, T_loc) >= 128)


def test_default_group_and_split_rules():
    from mgraph.ops.moe_dispatch_combine import auto_tiles

    assert auto_tiles(512, 4096, 6, 12, 2, 2048, 4.0)["expert_group"] == 6
    assert auto_tiles(512, 4096, 12, 24, 2, 2048, 4.0)["expert_group"] == 6
    assert auto_tiles(512, 4096, 7, 14, 2, 2048, 4.0)["expert_group"] == 7
    assert auto_tiles(512, 4096, 16, 16, 2, 2048, 4.0)["expert_group"] == 8
    # F or H that do not divide into two slices or more: no split
    assert auto_tiles(4096, 7168, 256, 256, 8, 192, 4.0)["expert_cols_f"] is None
    assert auto_tiles(4096, 700, 256, 256, 8, 2048, 4.0)["expert_cols_h"] is None
    # expert_split=True asks for it with small tiles too
    assert auto_tiles(64, 4096, 8, 8, 2, 2048, 4.0, expert_split=True)["expert_cols_f"] == 128


def test_split_options_are_checked():
    kw = dict(topology="1x1", T=64, H=64, E=8, top_k=2, F=64)
    with pytest.raises(mg.OptionError, match="expert_split=True"):
        mg.ops.moe_dispatch_combine(**kw, expert_split=True)
    with pytest.raises(mg.OptionError, match="expert_split=False"):
        mg.ops.moe_dispatch_combine(**kw, expert_split=False, expert_cols_f=32, expert_cols_h=32)
    g = mg.ops.moe_dispatch_combine(**kw, expert_rows=32, expert_group=2)  # explicit ones kept
    assert (g.params["expert_rows"], g.params["expert_group"]) == (32, 2)


@pytest.mark.parametrize("topology,E,H,F", [("1x2", 8, 16, 32), ("2x2", 16, 16, 32),
                                            ("1x2", 4, 1024, 256), ("1x2", 32, 16, 32)])
def test_default_tiles_match_torch(topology, E, H, F):
    """The default groups (E/W experts each here, or 8 of 16: two groups a rank, each tile
    waiting for both sources' rows of its group, rows and returns moved one expert a task)
    and, at H=1024 and F=256 with 128-row tiles, the default column split give torch's answer,
    and the same output as groups of one expert without the split."""
    from mgraph.ops.moe_dispatch_combine import AUTO_COLS

    W = mg.Topology.parse(topology).world_size
    kw = dict(topology=topology, T=128 * W, E=E, H=H, F=F, top_k=2)
    g = mg.ops.moe_dispatch_combine(**kw)
    assert g.params["expert_group"] == min(E // W, 8) > 1
    assert (g.params["expert_cols_f"], g.params["expert_cols_h"]) == (
        AUTO_COLS if H == 1024 else (None, None))
    check_graph(g)
    plain = mg.ops.moe_dispatch_combine(**kw, expert_group=1, expert_split=False,
                                        expert_rows=g.params["expert_rows"])
    inputs = mg.ops.get_op(g.op).random_inputs(g, seed=3)
    got, want = run_sequential(g, inputs), run_sequential(plain, inputs)
    assert torch.allclose(got["out"], want["out"], rtol=1e-5, atol=1e-6)
    assert torch.equal(got["dropped"], want["dropped"])
    # the reference runtime on the default schedule's queues (worker threads and counters;
    # float32 sums in its threads may round otherwise than in run_sequential)
    ran = mg.run(mg.schedule(g), inputs).outputs
    assert torch.allclose(ran["out"], got["out"], rtol=1e-5, atol=1e-6)
    assert torch.equal(ran["dropped"], got["dropped"])


# -- the expert queue: each weight slice once for all sources ------------------------------------
def weight_slice_spread(g, sched) -> dict:
    """Per rank: the largest number of other tasks between the first and the last task of one
    (local expert, row tile, part, weight columns) in the rank's compute queue (0: the tasks of
    all sources on that slice of the expert's weights follow each other), and how many sources
    each such slice has."""
    out = {}
    for rs in sched.ranks:
        at: dict[tuple, list[int]] = {}
        for i, tid in enumerate(rs.queues["compute"]):
            t = g.tasks[tid]
            if t.kind == "moe_expert":
                w = t.reads[3]  # w_gate (parts 0, 1) or w_down (part 2): its columns
                key = (t.params["local_expert"], t.params["row0"], t.params["part"], w.col0)
                at.setdefault(key, []).append(i)
        gaps = max(max(p) - min(p) + 1 - len(p) for p in at.values())
        out[rs.rank] = (gaps, {len(p) for p in at.values()})
    return out


@pytest.mark.parametrize(
    "topology,T_loc,H,E,top_k,F,kw",
    [
        ("1x2", 128, 1024, 8, 2, 256, {}),  # the default groups (4 experts) and column split
        ("1x2", 64, 16, 8, 2, 32, {"expert_rows": 16, "expert_group": 1}),  # 2 row tiles
        ("2x2", 32, 16, 16, 2, 32, {"expert_split": False}),  # RDMA and relayed sources
        ("1x4", 32, 256, 8, 2, 256, {"expert_cols_f": 128, "expert_cols_h": 128}),
        # issue 17's size on 2 GPUs, where critical_path takes the order it places on the
        # workers (own rows first, before this test: remote rows arrive later)
        ("1x2", 4096, 7168, 256, 8, 2048, {}),
    ],
)
def test_each_weight_slice_is_queued_once_for_all_sources(topology, T_loc, H, E, top_k, F, kw):
    """A rank's tiles of one expert's weights (or one slice of them, with the column split) for
    all W sources follow each other in its compute queue, under every builtin policy: programs
    taking them at about the same time read the slice from HBM once, not once per source (the
    remote sources' tiles, whose results have further to go, used to be queued for every
    expert before any of the rank's own rows: spread over thousands of tasks at issue 17's
    size)."""
    W = mg.Topology.parse(topology).world_size
    g = mg.ops.moe_dispatch_combine(topology=topology, dtype=torch.bfloat16, T=T_loc * W, H=H,
                                    E=E, top_k=top_k, F=F, **kw)  # fmt: skip
    for policy in ("critical_path", "longest_path", "topological"):
        spread = weight_slice_spread(g, mg.schedule(g, policy=policy))
        assert spread == {r: (0, {W}) for r in range(W)}, (policy, spread)
