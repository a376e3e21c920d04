"""Gated linear units as one op: ``silu(x @ Wg) * (x @ Wu)`` traced from two linears and a
pointwise chain becomes one ``matmul_glu`` node (mgraph/ops/matmul_glu.py), with
``mg.compile(..., glu=True)``, reading the two weights packed block by block (a new parameter
built from both: ParamSource ``glu_pack_t``). Off by default: on one H200 both of the op's forms
made the Llama layer slower (benchmarks/NOTES.md v14-v15: megakernel 4.20 ms against 3.51
without it, then 4.383 against 3.688 packed, 3.788 against 3.537 with gemm's K loop shared;
mgraph/ops/matmul_glu.py says why). Each rank's
output columns must be whole 128-column blocks, else the pattern is left as it was.

The pattern is the Llama MLP's ``act_fn(gate_proj(x)) * up_proj(x)`` after fuse_pointwise: an
``elementwise`` node whose chain is exactly ``silu(x) * y`` (either operand order) over two
``matmul`` outputs of the same input and the same layout, each read by nothing else. Fused, the
gate and up activations are never written: one task computes both products of its tile and the
epilogue applies the unit. Anything else (another activation, a scale in the chain, an
activation read elsewhere, weights that are not plain module weights, the sequence-parallel
``allgather_gemm`` form of the linears) is left as it was.
"""

from __future__ import annotations

from .opgraph import OpGraph, OpNode, ParamSource, Value

__all__ = ["fuse_glu"]


def _silu_mul_operands(node: OpNode) -> tuple[Value, Value] | None:
    """(gate, up) when ``node`` computes exactly silu(x) * y of two same-shape tensors."""
    p = node.params
    if node.op != "elementwise" or set(node.inputs) != {"x", "y"} or p.get("operands") != ["full"]:
        return None
    if any(k.endswith("_form") for k in p):  # a gather or broadcast read: not a plain product
        return None
    chain = [tuple(step[:3]) for step in p.get("chain") or ()]
    # slots: 0 = x, 1 = y, then one per step (chain steps are [fn, a, b, scalar]): the SiLU of
    # one input (slot 2) times the other, in either order
    if len(chain) != 2 or chain[0][0] != "silu" or chain[0][1] not in (0, 1) or chain[0][2] != -1:
        return None
    gate = chain[0][1]
    if chain[1][0] != "mul" or sorted(chain[1][1:]) != sorted((2, 1 - gate)):
        return None
    if any(step[3] != 0.0 for step in p["chain"]):
        return None
    names = ("x", "y")
    return node.inputs[names[gate]], node.inputs[names[1 - gate]]


def _glu_tile(params: dict) -> dict:
    """The fused op's tile: half as many output columns as the linears' tile (a gemm_glu
    column costs two GEMM columns), so a task does the work of one of theirs; whole packed
    blocks (GLU_BLOCK columns) a task."""
    from ..ops.matmul_glu import GLU_BLOCK

    tile = params.get("tile")
    if tile is None:
        return {}
    return {"tile": [int(tile[0]), max(int(tile[1]) // 2 // GLU_BLOCK, 1) * GLU_BLOCK]}


def _packed(gate: Value, up: Value) -> Value | None:
    """The packed weight of the two linears' weights (matmul_glu's ``w``), or None when they
    are not plain module weights of one form."""
    gs, us = gate.source, up.source
    if gs is None or us is None or len(gs.fqns) != 1 or len(us.fqns) != 1:
        return None
    if gs.transform != us.transform or gs.transform not in ("none", "t"):
        return None
    k, n = gate.shape
    return Value(
        name=f"{gate.name}.glu_{up.name}",
        shape=(k, 2 * n),
        dtype=gate.dtype,
        layout=None,
        kind="param",
        source=ParamSource(gs.fqns + us.fqns, "glu_pack_t" if gs.transform == "t" else "glu_pack"),
    )


def fuse_glu(og: OpGraph) -> OpGraph:
    """``og`` with every gated unit of the module docstring's form as one matmul_glu node."""
    producer = {v.name: n for n in og.nodes for v in n.outputs.values()}
    uses: dict[str, int] = {}
    for n in og.nodes:
        for v in n.inputs.values():
            uses[v.root().name] = uses.get(v.root().name, 0) + 1
    for v in og.outputs:
        uses[v.root().name] = uses.get(v.root().name, 0) + 1
    from ..ops.matmul_glu import GLU_BLOCK

    fused: dict[str, OpNode] = {}  # elementwise node name -> its replacement
    dropped: set[str] = set()
    new_params: list[Value] = []
    for n in og.nodes:
        operands = _silu_mul_operands(n)
        if operands is None:
            continue
        gate, up = operands
        if gate.alias_of is not None or up.alias_of is not None:
            continue
        g, u = producer.get(gate.name), producer.get(up.name)
        if g is None or u is None or g.op != "matmul" or u.op != "matmul" or g is u:
            continue
        if g.inputs["a"] is not u.inputs["a"] or g.params != u.params:
            continue
        if uses.get(gate.name) != 1 or uses.get(up.name) != 1:
            continue
        out = n.outputs["out"]
        if tuple(out.shape) != tuple(gate.shape) or out.layout != gate.layout:
            continue
        wg, wu = g.inputs["b"], u.inputs["b"]
        local = wg.shape[1] // (og.topology.world_size if g.params.get("shard") == "cols" else 1)
        packed = _packed(wg, wu)
        if packed is None or local % GLU_BLOCK:
            continue
        params = {k: v for k, v in g.params.items() if k != "tile"}
        params.update(_glu_tile(g.params))
        new_params.append(packed)
        node = OpNode(
            name=n.name,
            op="matmul_glu",
            params=params,
            inputs={"a": g.inputs["a"], "w": packed},
            outputs={"out": out},
            path=n.path,
            origin=f"silu({g.path or g.name}) * {u.path or u.name}",
        )
        out.producer = node.name
        fused[n.name] = node
        dropped |= {g.name, u.name}
    if not fused:
        return og
    nodes = [fused.get(n.name, n) for n in og.nodes if n.name not in dropped]
    read = {v.root().name for n in nodes for v in n.inputs.values()}
    params = [v for v in og.params if v.name in read] + new_params  # the linears' own: if read
    return OpGraph(
        name=og.name,
        topology=og.topology,
        dtype=og.dtype,
        nodes=nodes,
        inputs=og.inputs,
        params=params,
        outputs=og.outputs,
        single_output=og.single_output,
        note=og.note,
        constants=og.constants,
    )
