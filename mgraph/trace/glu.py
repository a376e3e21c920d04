"""Gated linear units as one op: ``silu(x @ Wg) * (x @ Wu)`` traced from two linears and a
pointwise chain becomes one ``matmul_glu`` node (mgraph/ops/matmul_glu.py), with
``mg.compile(..., glu=True)``. Off by default: on one H200 the fused op made the Llama layer
slower (benchmarks/NOTES.md v14: megakernel 4.20 ms against 3.51 without it).

The pattern is the Llama MLP's ``act_fn(gate_proj(x)) * up_proj(x)`` after fuse_pointwise: an
``elementwise`` node whose chain is exactly ``silu(x) * y`` (either operand order) over two
``matmul`` outputs of the same input and the same layout, each read by nothing else. Fused, the
gate and up activations are never written: one task computes both products of its tile and the
epilogue applies the unit. Anything else (another activation, a scale in the chain, an
activation read elsewhere, the sequence-parallel ``allgather_gemm`` form of the linears) is left
as it was.
"""

from __future__ import annotations

from .opgraph import OpGraph, OpNode, Value

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
    column costs two GEMM columns), so a task does the work of one of theirs."""
    tile = params.get("tile")
    if tile is None:
        return {}
    return {"tile": [int(tile[0]), max(int(tile[1]) // 2, 64)]}


def fuse_glu(og: OpGraph) -> OpGraph:
    """``og`` with every gated unit of the module docstring's form as one matmul_glu node."""
    producer = {v.name: n for n in og.nodes for v in n.outputs.values()}
    uses: dict[str, int] = {}
    for n in og.nodes:
        for v in n.inputs.values():
            uses[v.root().name] = uses.get(v.root().name, 0) + 1
    for v in og.outputs:
        uses[v.root().name] = uses.get(v.root().name, 0) + 1
    fused: dict[str, OpNode] = {}  # elementwise node name -> its replacement
    dropped: set[str] = set()
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
        params = {k: v for k, v in g.params.items() if k != "tile"}
        params.update(_glu_tile(g.params))
        node = OpNode(
            name=n.name,
            op="matmul_glu",
            params=params,
            inputs={"a": g.inputs["a"], "b": g.inputs["b"], "b2": u.inputs["b"]},
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
    return OpGraph(
        name=og.name,
        topology=og.topology,
        dtype=og.dtype,
        nodes=nodes,
        inputs=og.inputs,
        params=og.params,
        outputs=og.outputs,
        single_output=og.single_output,
        note=og.note,
        constants=og.constants,
    )
