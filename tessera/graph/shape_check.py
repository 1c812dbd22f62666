"""Checking a graph's shape assumptions against the shapes of one run.

A graph is built on symbolic sizes, and shape inference makes assumptions about them that only
the run-time values can confirm: that two sizes meeting in a broadcast, a matmul contraction or
a concat are equal, that a symbolic size is not 1 where squeeze would drop it, that a reshape's
sizes multiply up.  Compiled kernels rely on these assumptions (a size assumed equal to 5 is
indexed as 5), so breaking one would read out of bounds or give a result of the wrong shape.

`propagate_shapes` re-runs every operator's own shape inference (the single source of truth)
on the concrete shapes of a run, in graph order, and compares each result with the graph's
shape evaluated on the bindings.  Symbolic sizes enter as `BoundDim`s, which broadcasting never
stretches, so a symbolic size that is 1 at run time and meets a different size is refused like
every other broken assumption: with a ShapeError naming the operator, the sizes and the fix.
It also binds the graph's opaque sizes (`_n3`, a size that depends on data) to
their run-time values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tessera.graph.flow_graph import FlowGraph
from tessera.graph.operator import Operator
from tessera.graph.symbolic import BoundDim, ShapeError, Sym, contains_sym, evaluate, format_shape
from tessera.graph.tensor import Tensor
from tessera.ir.dtypes import DataType


class _Concrete:
    """What an op's shape inference reads of a tensor, with run-time sizes."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: tuple[int, ...], dtype: DataType):
        self.shape, self.dtype = shape, dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _stand_in(t: Tensor, shape: tuple[int, ...]) -> _Concrete:
    dims = tuple(BoundDim(v, d) if isinstance(d, Sym) else v for d, v in zip(t.shape, shape))
    return _Concrete(dims, t.dtype)


def _bindings_text(bindings: Mapping[str, int]) -> str:
    shown = [f"{k}={v}" for k, v in sorted(bindings.items()) if not k.startswith("_")]
    return ", ".join(shown) or "these input shapes"


def _match(t: Tensor, actual: tuple[int, ...], bindings: dict[str, int]) -> bool:
    """Whether the graph shape of t agrees with actual, binding opaque bare names on the way."""
    if len(actual) != len(t.shape):
        return False
    for d, a in zip(t.shape, actual):
        if isinstance(d, int):
            if d != a:
                return False
            continue
        unbound = [n for n in d.names if n not in bindings]
        if not unbound:
            if d.evaluate(bindings) != a:
                return False
        elif d.name is not None:
            bindings[d.name] = a
        # else: an expression with sizes nothing binds; nothing to compare it with
    return True


def infer_run_time(op: Operator, shapes: Sequence[tuple[int, ...]], bindings: Mapping[str, int]) -> list[tuple[int, ...]]:
    """op's output shapes by its own inference on its inputs' run-time `shapes` (and its
    symbolic attributes evaluated on `bindings`); raises ShapeError where the inputs break an
    assumption (symbolic sizes enter as BoundDims, which never stretch in a broadcast)."""
    attrs: dict[str, Any] = op.opdef.normalize_attrs(op.attrs)
    if contains_sym(list(attrs.values())):
        attrs = {k: evaluate(v, bindings) for k, v in attrs.items()}
    inferred = op.opdef.infer([_stand_in(t, s) for t, s in zip(op.inputs, shapes)], attrs)
    return [tuple(int(v) for v in shape) for shape, _ in inferred]


def propagate_shapes(graph: FlowGraph, input_shapes: Sequence[tuple[int, ...]],
                     bindings: dict[str, int]) -> dict[Tensor, tuple[int, ...]]:  # fmt: skip
    """The run-time shape of every tensor of `graph`, given its inputs' shapes.

    `bindings` holds the symbol values already bound from the inputs (`bind_shape`); the
    graph's opaque sizes are added to it.  Raises ShapeError when an operator's inference on the
    run-time shapes fails or disagrees with the graph's shape: the graph was built on an
    assumption about its sizes that these inputs break."""
    shapes: dict[Tensor, tuple[int, ...]] = {}
    for t, s in zip(graph.inputs, input_shapes):
        shapes[t] = tuple(int(v) for v in s)
    for t in graph.constants:
        shapes[t] = tuple(t.data.shape)  # type: ignore[union-attr]
    for op in graph.operators:
        try:
            inferred = infer_run_time(op, [shapes[t] for t in op.inputs], bindings)
        except ShapeError as e:
            ins = ", ".join(f"{t.name}{list(shapes[t])}" for t in op.inputs)
            raise ShapeError(f"graph {graph.name}: operator {op.name} ({op.kind}) cannot run on {ins} "
                             f"({_bindings_text(bindings)}): {e}") from None  # fmt: skip
        for t, actual in zip(op.outputs, inferred):
            if not _match(t, actual, bindings):
                raise ShapeError(
                    f"graph {graph.name}: with {_bindings_text(bindings)}, operator {op.name} ({op.kind}) gives "
                    f"{t.name} the shape {list(actual)}, but the graph was built for {format_shape(t.shape)}: "
                    f"it assumed something of these sizes that the inputs break (for example a symbolic size "
                    f"that is 1 here); pass inputs that fit, or build the graph with the sizes made explicit")
            shapes[t] = actual
    return shapes
