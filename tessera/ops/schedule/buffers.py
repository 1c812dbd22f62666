"""Kernel parameters for the tensors a kernel touches, and the final rewrite of tensor reads into loads.

Every tensor becomes a global tensor parameter.  Its shape may use only constants and int32
variables (what the runtime checks against the arguments), so a compound dimension such as
the `a + b` of a concatenation gets its own scalar parameter, whose value the caller
computes from the shape symbols.  Rank-0 tensors are passed as one-element vectors.
"""

from __future__ import annotations

import re

from tessera.errors import ArgumentError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.compute import TensorElement, TensorElementMutator, TensorNode
from tessera.ir.functor import IRVisitor
from tessera.ir.types import GLOBAL, TensorType
from tessera.ops.schedule.loops import i32


def base_name(name: str) -> str:
    """A node name without the counter `fresh_name` adds ("add.17" -> "add"): stable generated code."""
    return re.sub(r"\.\d+$", "", name) or "t"


class Buffers:
    """The tensor and scalar parameters of one kernel, created on first use."""

    def __init__(self) -> None:
        self.params: dict[TensorNode, E.Var] = {}
        self.dim_params: list[tuple[E.Var, E.Expr]] = []  # (scalar parameter, its value as an expression)
        self.names: set[str] = set()

    def unique(self, name: str) -> str:
        out, k = name, 0
        while out in self.names:
            k += 1
            out = f"{name}_{k}"
        self.names.add(out)
        return out

    def var(self, t: TensorNode) -> E.Var:
        if t not in self.params:
            name = self.unique(base_name(t.name))
            dims: list[E.Expr] = []
            for k, d in enumerate(t.shape):
                if isinstance(d, (E.Const, E.Var)):
                    dims.append(d)
                else:
                    v = E.Var(self.unique(f"{name}_dim{k}"), dtypes.int32)
                    self.dim_params.append((v, d))
                    dims.append(v)
            self.params[t] = E.Var(name, TensorType(t.dtype, tuple(dims) or (i32(1),), GLOBAL))
        return self.params[t]

    def indices(self, t: TensorNode, idx: tuple[E.Expr, ...]) -> tuple[E.Expr, ...]:
        return idx if t.rank else (i32(0),)

    def load(self, t: TensorNode, idx: tuple[E.Expr, ...]) -> E.Load:
        return E.Load(self.var(t), self.indices(t, idx))

    def store(self, t: TensorNode, idx: tuple[E.Expr, ...], value: E.Expr) -> S.Store:
        return S.Store(self.var(t), self.indices(t, idx), value)


class _ReadsToLoads(TensorElementMutator):
    def __init__(self, buffers: Buffers):
        self.buffers = buffers

    def visit_TensorElement(self, e: TensorElement) -> E.Expr:
        return self.buffers.load(e.tensor, tuple(self.visit(i) for i in e.indices))


def reads_to_loads(body: S.Stmt, buffers: Buffers) -> S.Stmt:
    """Replace every remaining tensor read by a load from that tensor's parameter."""
    return _ReadsToLoads(buffers).visit(body)


class _FreeVars(IRVisitor):
    """Scalar variables used but not defined in a statement (the shape symbols)."""

    def __init__(self) -> None:
        self.defined: set[E.Var] = set()
        self.free: dict[E.Var, None] = {}

    def visit_Var(self, e: E.Var) -> None:
        if e not in self.defined and not isinstance(e.type, TensorType):
            self.free.setdefault(e, None)

    def visit_For(self, s: S.For) -> None:
        self.defined.add(s.var)
        super().visit_For(s)

    def visit_DeclareVar(self, s: S.DeclareVar) -> None:
        super().visit_DeclareVar(s)
        self.defined.add(s.var)


def free_vars(*nodes: object) -> list[E.Var]:
    finder = _FreeVars()
    for n in nodes:
        if isinstance(n, E.Expr) or isinstance(n, S.Stmt):
            finder.visit(n)
    return list(finder.free)


def scalar_params(body: S.Stmt, buffers: Buffers, launch_exprs: list[E.Expr]) -> list[tuple[E.Var, E.Expr]]:
    """The kernel's scalar parameters, each with the expression (over shape symbols) of its value."""
    dim_vars = {v for v, _ in buffers.dim_params}
    shape_exprs = [d for p in buffers.params.values() for d in p.type.shape]
    symbols = [v for v in free_vars(body, *shape_exprs, *launch_exprs) if v not in dim_vars]
    for v in symbols:
        if v.type != dtypes.int32:
            raise ArgumentError(f"variable '{v.name}' ({v.type}) is used by a compute definition but is not an "
                                "int32 shape symbol; shape symbols must be int32 Vars")  # fmt: skip
    symbols.sort(key=lambda v: v.name)
    # The runtime binds parameters by name: rename this kernel's own parameters away from the
    # shape symbols (which belong to the caller and keep their names).
    taken = {v.name for v in symbols}
    for v in [*buffers.params.values(), *(d for d, _ in buffers.dim_params)]:
        if v.name in taken:
            v.name = buffers.unique(v.name + "_")
        taken.add(v.name)
    return [(v, v) for v in symbols] + list(buffers.dim_params)
