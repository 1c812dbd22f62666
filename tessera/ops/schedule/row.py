"""The body of a reduction kernel for one outer index: fused reductions, then the anchor's epilogue.

The same body serves every target; a `Workers` strategy says who iterates a domain (one
thread alone, or the lanes of a warp or block striding over it), how partial accumulators
are combined, and who performs a store that must happen once.
"""

from __future__ import annotations

from collections.abc import Sequence

from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.compute import ReduceCompute, TensorElement, TensorElementMutator, TensorNode, substitute_vars
from tessera.ops.schedule.buffers import Buffers
from tessera.ops.schedule.loops import i32, index_var, serial_nest, strided
from tessera.ops.schedule.partition import KernelPlan
from tessera.ops.schedule.reduction import block_allreduce, combine, finalize, identity, warp_allreduce


class Workers:
    """One worker (a CPU thread or one CUDA thread) does everything serially."""

    def loop(self, vars_: Sequence[E.Var], extents: Sequence[E.Expr], body: S.Stmt, name: str) -> S.Stmt:
        return serial_nest(vars_, extents, body)

    def allreduce(self, acc: E.Var, op: str, name: str) -> list[S.Stmt]:
        return []

    def once(self, stmt: S.Stmt) -> S.Stmt:
        return stmt


class Cooperative(Workers):
    """`width` CUDA threads (a warp or a whole block) share each domain and combine by shuffles."""

    def __init__(self, lane: E.Expr, width: int, block: bool):
        self.lane, self.width, self.block = lane, width, block

    def loop(self, vars_: Sequence[E.Var], extents: Sequence[E.Expr], body: S.Stmt, name: str) -> S.Stmt:
        return strided(vars_, extents, self.lane, self.width, body, name)

    def allreduce(self, acc: E.Var, op: str, name: str) -> list[S.Stmt]:
        if self.block:
            return block_allreduce(acc, op, self.width, name)
        return warp_allreduce(acc, op, self.width)

    def once(self, stmt: S.Stmt) -> S.Stmt:
        return S.If(E.Binary("==", self.lane, i32(0)), stmt)


class _FusedReads(TensorElementMutator):
    """Reads of reductions computed earlier in this kernel become their local values."""

    def __init__(self, local: dict[TensorNode, E.Var]):
        self.local = local

    def visit_TensorElement(self, e: TensorElement) -> E.Expr:
        if e.tensor in self.local:
            return self.local[e.tensor]
        return super().visit_TensorElement(e)


def row_body(plan: KernelPlan, outer: dict[int, E.Expr], workers: Workers, buffers: Buffers) -> S.Stmt:
    """Statements computing the plan's reductions and epilogue at the outer index `outer` (anchor axis -> value)."""
    local: dict[TensorNode, E.Var] = {}
    stmts: list[S.Stmt] = []
    for k, red in enumerate(plan.reductions):
        pos = plan.positions[red]
        out_idx = tuple(outer[p] if p is not None else i32(0) for p in pos)
        raxes = tuple(index_var(f"r{k}_{d}") for d in range(len(red.reduce_axes)))
        mapping: dict[E.Var, E.Expr] = dict(zip(red.axes, out_idx))
        mapping.update(zip(red.reduce_axes, raxes))
        value = _FusedReads(local).visit(substitute_vars(plan.values[red], mapping))
        acc = E.Var(f"acc{k}", red.acc_dtype)
        stmts.append(S.DeclareVar(acc, identity(red.op, red.acc_dtype)))
        stmts.append(workers.loop(raxes, red.reduce_extents, S.Assign(acc, combine(red.op, acc, value)), f"rflat{k}"))
        stmts += workers.allreduce(acc, red.op, f"partials{k}")
        result = E.Var(f"red{k}", red.dtype)
        stmts.append(S.DeclareVar(result, finalize(red, acc)))
        if red in plan.stores:
            stmts.append(workers.once(buffers.store(red, out_idx, result)))
        local[red] = result
    anchor = plan.anchor
    if not isinstance(anchor, ReduceCompute):
        assert plan.outer is not None
        inner = [p for p in range(anchor.rank) if p not in plan.outer]
        inner_vars = [index_var(f"j{p}") for p in inner]
        coords = [outer.get(p) for p in range(anchor.rank)]
        for p, v in zip(inner, inner_vars):
            coords[p] = v
        value = _FusedReads(local).visit(substitute_vars(plan.values[anchor], dict(zip(anchor.axes, coords))))
        store = buffers.store(anchor, tuple(coords), value)
        stmts.append(workers.loop(inner_vars, [anchor.shape[p] for p in inner], store, "jflat"))
    return S.seq(*stmts)


def outer_extents(plan: KernelPlan) -> list[E.Expr]:
    assert plan.outer is not None
    return [plan.anchor.shape[p] for p in plan.outer]


def elementwise_value(plan: KernelPlan, coords: Sequence[E.Expr]) -> E.Expr:
    """The anchor's inlined value at `coords` (for kernels without reductions)."""
    return substitute_vars(plan.values[plan.anchor], dict(zip(plan.anchor.axes, coords)))
