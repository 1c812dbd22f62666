"""Fusion by inlining: replace reads of injective `Compute` nodes by their defining expressions.

After inlining, a stage's value reads only *materialised* tensors: placeholders, reductions,
outputs and injective nodes that were kept because inlining them would blow up the
expression (a producer read many times by many consumers).  A chain of elementwise,
broadcast, reshape and transpose ops thus becomes one expression, computed by one kernel.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from tessera.ir import expr as E
from tessera.ir.compute import (
    Compute,
    ExprKeys,
    Placeholder,
    Program,
    ReduceCompute,
    TensorElement,
    TensorElementMutator,
    TensorNode,
    substitute_vars,
)

# Largest inlined expression (counted as a tree, as codegen prints it) before the scheduler
# materialises a producer instead of recomputing it inline.
MAX_INLINED_SIZE = 3000


class Inliner(TensorElementMutator):
    """Inline every Compute that is not in `materialised`; count how often each was inlined
    (as often as codegen, which prints expressions as trees, will print its value)."""

    def __init__(self, materialised: set[TensorNode]):
        self.materialised = materialised
        self.memo: dict[tuple, E.Expr] = {}
        self.keys = ExprKeys()
        self.inlined: Counter = Counter()
        # A node shared by many expressions (index arithmetic over symbolic sizes is a DAG that
        # is exponentially larger as a tree) is rewritten once: id(node) -> (node, result, the
        # counts a visit of it adds once its inlined values are memoised), added at each later use.
        self._visited: dict[int, tuple[E.Expr, E.Expr, Counter]] = {}
        self._recount: Counter = Counter()

    def visit(self, node: E.Expr) -> E.Expr:
        hit = self._visited.get(id(node))
        if hit is not None:
            self.inlined.update(hit[2])
            self._recount.update(hit[2])
            return hit[1]
        outer, outer_recount = self.inlined, self._recount
        self.inlined, self._recount = Counter(), Counter()
        try:
            out = super().visit(node)
        finally:
            counted, recount = self.inlined, self._recount
            self.inlined, self._recount = outer, outer_recount
        outer.update(counted)
        outer_recount.update(recount)
        self._visited[id(node)] = (node, out, recount)
        return out

    def visit_TensorElement(self, e: TensorElement) -> E.Expr:
        idx = tuple(self.visit(i) for i in e.indices)
        t = e.tensor
        if t in self.materialised or not isinstance(t, Compute):
            return e if all(a is b for a, b in zip(idx, e.indices)) else TensorElement(t, idx)
        self.inlined[t] += 1
        self._recount[t] += 1
        key = (id(t), tuple(self.keys(i) for i in idx))
        if key not in self.memo:
            body = substitute_vars(t.value, dict(zip(t.axes, idx)))
            recount, self._recount = self._recount, Counter()  # a later visit finds the body memoised
            try:
                self.memo[key] = self.visit(body)
            finally:
                self._recount = recount
        return self.memo[key]


def tree_size(e: E.Expr, memo: dict[int, int] | None = None) -> int:
    """Number of nodes of `e` counted as a tree (shared subexpressions count every time)."""
    memo = {} if memo is None else memo
    if id(e) in memo:
        return memo[id(e)]
    if isinstance(e, E.Binary):
        n = 1 + tree_size(e.a, memo) + tree_size(e.b, memo)
    elif isinstance(e, E.Unary):
        n = 1 + tree_size(e.a, memo)
    elif isinstance(e, E.Cast):
        n = 1 + tree_size(e.value, memo)
    elif isinstance(e, E.Select):
        n = 1 + tree_size(e.cond, memo) + tree_size(e.a, memo) + tree_size(e.b, memo)
    elif isinstance(e, E.Call):
        n = 1 + sum(tree_size(a, memo) for a in e.args)
    elif isinstance(e, TensorElement):
        n = 1 + sum(tree_size(i, memo) for i in e.indices)
    else:
        n = 1
    memo[id(e)] = n
    return n


def inline_stages(order: list[TensorNode], outputs: Iterable[TensorNode]) -> tuple[list[TensorNode], dict[TensorNode, E.Expr]]:
    """Choose the materialised nodes and inline the rest.

    Returns the stages (materialised non-placeholder nodes, producers first) and each
    stage's inlined value.
    """
    materialised: set[TensorNode] = set(outputs)
    materialised |= {n for n in order if isinstance(n, (Placeholder, ReduceCompute, Program))}
    while True:
        stages = [n for n in order if n in materialised and not isinstance(n, Placeholder)]
        inliner = Inliner(materialised)
        values = {s: inliner.visit(s.value) for s in stages}
        too_big = any(tree_size(v) > MAX_INLINED_SIZE for v in values.values())
        repeated = [(n, c) for n, c in inliner.inlined.items() if c > 1]
        if not too_big or not repeated:
            return stages, values
        worst = max(repeated, key=lambda nc: nc[1] * tree_size(nc[0].value))[0]
        materialised.add(worst)
