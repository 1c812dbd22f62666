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
from collections.abc import Callable

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.operator import Operator
from tessera.graph.passes.pattern import Bound, Match, Op, Pattern, Rule, Scalar, any_of, rewrite_with

X = Bound("x")


def _half_x_times(t: Pattern) -> Pattern:
    """0.5 * x * t in the associations exporters write (each product in either order)."""
    return any_of(X * t * 0.5, X * t / 2.0, X * 0.5 * t, t * 0.5 * X)


ERF = _half_x_times(1.0 + Op("erf", any_of(X / math.sqrt(2.0), X * math.sqrt(0.5))))
TANH = _half_x_times(1.0 + Op("tanh", math.sqrt(2 / math.pi) * (X + 0.044715 * Op("pow", X, Scalar(3.0, exact=True)))))


def _gelu(approximate: str) -> Callable[[Match], Operator | None]:
    def build(m: Match) -> Operator | None:
        x, y = m["x"], m.root.outputs[0]
        if not x.dtype.is_float or y.dtype != x.dtype or y.shape != x.shape:
            return None
        return Operator("gelu", [x], [y], {"approximate": approximate}, m.root.name)

    return build


RULES = (Rule(ERF, _gelu("none")), Rule(TANH, _gelu("tanh")))


def fuse_gelu(graph: FlowGraph) -> int:
    """Rewrite in place; returns the number of GELU chains turned into gelu operators."""
    return rewrite_with(graph, RULES)
