"""Small helpers the pattern-rewriting passes share: scalar constants and single-use edges."""

from __future__ import annotations

from collections.abc import Iterable

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.operator import Operator
from tessera.graph.tensor import Tensor


def scalar(t: Tensor) -> float | None:
    """The value of a one-element constant (any rank), else None."""
    if not (t.is_constant and t.producer is None and t.data.size == 1) or t.dtype.is_bool:
        return None
    return float(t.data.reshape(-1)[0])


def close_to(value: float | None, ideal: float, like: Tensor) -> bool:
    """Whether value is `ideal` as stored in like's float dtype (a few units in the last place)."""
    if value is None or not like.dtype.is_float or not like.dtype.mantissa_bits:
        return False
    return abs(value - ideal) <= 4 * 2.0**-like.dtype.mantissa_bits * abs(ideal)


class Uses:
    """Who reads each tensor, to tell whether an intermediate can disappear in a rewrite."""

    def __init__(self, graph: FlowGraph):
        self.users = graph.consumers()
        self.outputs = set(graph.outputs)

    def only_user(self, t: Tensor) -> Operator | None:
        """The one operator reading t, if t has exactly one use (once) and is no graph output."""
        users = self.users.get(t, [])
        if len(users) != 1 or t in self.outputs or users[0].inputs.count(t) != 1:
            return None
        return users[0]


def other_input(op: Operator, t: Tensor) -> Tensor | None:
    """The second operand of a binary op, given one of them (None if op reads t twice)."""
    if len(op.inputs) != 2 or op.inputs.count(t) != 1:
        return None
    return op.inputs[1] if op.inputs[0] is t else op.inputs[0]


def scalar_operand(op: Operator | None, kind: str) -> tuple[Tensor, float] | None:
    """For `kind(x, c)` / `kind(c, x)` (c a scalar constant; only `c` second for div and sub):
    (x, c), else None."""
    if op is None or op.kind != kind or len(op.inputs) != 2:
        return None
    a, b = op.inputs
    if scalar(b) is not None:
        return a, scalar(b)
    if kind in ("mul", "add") and scalar(a) is not None:
        return b, scalar(a)
    return None


def rewrite(graph: FlowGraph, drop: Iterable[Operator], new: Iterable[Operator]) -> None:
    """Replace the operators in drop by those in new (re-sorted topologically)."""
    gone = set(drop)
    graph.set_operators([op for op in graph.operators if op not in gone] + list(new))
