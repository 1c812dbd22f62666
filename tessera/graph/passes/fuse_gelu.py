"""Rewrite GELU written out as elementwise ops into one `gelu` operator.

Exporters (torch.onnx for nn.GELU, GPT-2's NewGELUActivation in any front end) write
    erf form:  0.5 * x * (1 + erf(x / sqrt(2)))                        -> gelu(x)
    tanh form: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))  -> gelu(x, approximate="tanh")
as five to nine ops, where x feeds the chain twice.  A GEMM's epilogue takes only a chain that
reads its accumulator once, so the written-out form costs a kernel of its own after each
linear, while `gelu` folds into the linear's store.  Constants must equal the formula's (to
a few units in the last place of x's dtype); every intermediate must have no other use.
"""

from __future__ import annotations

import math

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.operator import Operator
from tessera.graph.passes._match import Uses, close_to, other_input, rewrite, scalar, scalar_operand
from tessera.graph.tensor import Tensor


def _half_x_times(x: Tensor, t: Tensor, uses: Uses) -> tuple[Tensor, list[Operator]] | None:
    """Match 0.5 * x * t in any association (t used once); returns (result, the ops)."""
    m = uses.only_user(t)
    if m is None or m.kind != "mul":
        return None
    o = other_input(m, t)
    if o is x:  # (x * t) * 0.5  or  (x * t) / 2
        n = uses.only_user(m.outputs[0])
        for kind, ideal in (("mul", 0.5), ("div", 2.0)):
            found = scalar_operand(n, kind)
            if found is not None and found[0] is m.outputs[0] and close_to(found[1], ideal, x):
                return n.outputs[0], [m, n]
        return None
    half = scalar_operand(o.producer, "mul") if o is not None else None
    if half is not None and half[0] is x and close_to(half[1], 0.5, x) and uses.only_user(o) is m:
        return m.outputs[0], [o.producer, m]  # (x * 0.5) * t
    if o is not None and close_to(scalar(o), 0.5, x):  # (t * 0.5) * x
        n = uses.only_user(m.outputs[0])
        if n is not None and n.kind == "mul" and other_input(n, m.outputs[0]) is x:
            return n.outputs[0], [m, n]
    return None


def _erf_form(erf: Operator, uses: Uses) -> tuple[Tensor, Tensor, list[Operator]] | None:
    u = erf.inputs[0]
    scaled = scalar_operand(u.producer, "div")
    if scaled is not None and close_to(scaled[1], math.sqrt(2.0), scaled[0]):
        x = scaled[0]
    else:
        scaled = scalar_operand(u.producer, "mul")
        if scaled is None or not close_to(scaled[1], math.sqrt(0.5), scaled[0]):
            return None
        x = scaled[0]
    one = scalar_operand(uses.only_user(erf.outputs[0]), "add")
    if uses.only_user(u) is not erf or one is None or not close_to(one[1], 1.0, x):
        return None
    plus = uses.only_user(erf.outputs[0])
    tail = _half_x_times(x, plus.outputs[0], uses)
    return None if tail is None else (x, tail[0], [u.producer, erf, plus, *tail[1]])


def _tanh_form(tanh: Operator, uses: Uses) -> tuple[Tensor, Tensor, list[Operator]] | None:
    u = tanh.inputs[0]
    scaled = scalar_operand(u.producer, "mul")
    if scaled is None or uses.only_user(u) is not tanh or not close_to(scaled[1], math.sqrt(2 / math.pi), u):
        return None
    inner = scaled[0].producer  # x + 0.044715 * x^3
    if inner is None or inner.kind != "add" or uses.only_user(scaled[0]) is not u.producer:
        return None
    for cube_term in inner.inputs:
        coef = scalar_operand(cube_term.producer, "mul")
        if coef is None or not close_to(coef[1], 0.044715, cube_term) or uses.only_user(cube_term) is not inner:
            continue
        cube = coef[0].producer
        x = other_input(inner, cube_term)
        if (cube is None or cube.kind != "pow" or x is None or cube.inputs[0] is not x or scalar(cube.inputs[1]) != 3.0
                or uses.only_user(coef[0]) is not cube_term.producer):  # fmt: skip
            continue
        one = scalar_operand(uses.only_user(tanh.outputs[0]), "add")
        if one is None or not close_to(one[1], 1.0, x):
            return None
        plus = uses.only_user(tanh.outputs[0])
        tail = _half_x_times(x, plus.outputs[0], uses)
        if tail is not None:
            return x, tail[0], [cube, cube_term.producer, inner, u.producer, tanh, plus, *tail[1]]
    return None


def fuse_gelu(graph: FlowGraph) -> int:
    """Rewrite in place; returns the number of GELU chains turned into gelu operators."""
    uses = Uses(graph)
    drop: list[Operator] = []
    new: list[Operator] = []
    taken: set[Operator] = set()
    for op in graph.operators:
        if op.kind == "erf":
            found, approximate = _erf_form(op, uses), "none"
        elif op.kind == "tanh":
            found, approximate = _tanh_form(op, uses), "tanh"
        else:
            continue
        if found is None:
            continue
        x, y, chain = found
        if taken.intersection(chain) or y.dtype != x.dtype or y.shape != x.shape or not x.dtype.is_float:
            continue
        gelu = Operator("gelu", [x], [y], {"approximate": approximate}, chain[-1].name)
        taken.update(chain)
        drop += chain
        new.append(gelu)
    if new:
        rewrite(graph, drop, new)
    return len(new)
