"""Turn multi-dimensional tensor accesses into one-dimensional row-major accesses.

Global tensor parameters become pointers; register and shared tensors become 1-D arrays of
the same scope.  After this pass every Load/Store has exactly one index, which is what the
C and CUDA code generators emit.
"""

from __future__ import annotations

from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir import stmt as S
from tessera.ir.func import Function
from tessera.ir.functor import IRMutator
from tessera.ir.types import GLOBAL, PointerType, Swizzle, TensorType


def flat_index(shape: tuple[E.Expr, ...], indices: tuple[E.Expr, ...]) -> E.Expr:
    """Row-major offset: ((i0 * d1 + i1) * d2 + i2) ..."""
    out = indices[0]
    for dim, idx in zip(shape[1:], indices[1:]):
        out = E.Binary("+", E.Binary("*", out, dim), idx)
    return out


def swizzled(offset: E.Expr, swizzle: Swizzle) -> E.Expr:
    """The IR form of Swizzle.apply."""
    mask = E.Const((1 << swizzle.bits) - 1, dtypes.int32)
    moved = E.Binary("&", E.Binary(">>", offset, E.Const(swizzle.base + swizzle.shift, dtypes.int32)), mask)
    return E.Binary("^", offset, E.Binary("<<", moved, E.Const(swizzle.base, dtypes.int32)))


def flat_size(shape: tuple[E.Expr, ...]) -> E.Expr:
    out = shape[0]
    for d in shape[1:]:
        out = E.Binary("*", out, d)
    return out


class FlattenBuffers(IRMutator):
    def __init__(self) -> None:
        self.replacement: dict[E.Var, E.Var] = {}

    def flat_var(self, var: E.Var) -> E.Var:
        if var not in self.replacement:
            t = var.type
            if isinstance(t, TensorType):
                if t.scope == GLOBAL:
                    new_type = PointerType(t.dtype)
                else:
                    new_type = TensorType(t.dtype, (flat_size(t.shape),), t.scope)
                self.replacement[var] = E.Var(var.name, new_type)
            else:
                self.replacement[var] = var
        return self.replacement[var]

    def access(self, buffer: E.Var, indices: tuple[E.Expr, ...]) -> tuple[E.Var, tuple[E.Expr, ...]]:
        t = buffer.type
        if isinstance(t, TensorType):
            if t.swizzle is None or len(indices) <= 2:
                flat = flat_index(t.shape, indices)
                return self.flat_var(buffer), (flat if t.swizzle is None else swizzled(flat, t.swizzle),)
            # The swizzle permutes each trailing 2-D tile; outer indices select the tile, so
            # their offset stays outside the XOR and the compiler can hoist it.
            tile = flat_index(t.shape[-2:], indices[-2:])
            outer = E.Binary("*", flat_index(t.shape[:-2], indices[:-2]), flat_size(t.shape[-2:]))
            return self.flat_var(buffer), (E.Binary("+", outer, swizzled(tile, t.swizzle)),)
        return buffer, indices

    def visit_Load(self, e: E.Load) -> E.Expr:
        idx = tuple(self.visit(i) for i in e.indices)
        buf, flat = self.access(e.buffer, idx)
        return E.Load(buf, flat)

    def visit_Address(self, e: E.Address) -> E.Expr:
        idx = tuple(self.visit(i) for i in e.indices)
        buf, flat = self.access(e.buffer, idx)
        return E.Address(buf, flat)

    def visit_Store(self, s: S.Store) -> S.Stmt:
        idx = tuple(self.visit(i) for i in s.indices)
        buf, flat = self.access(s.buffer, idx)
        out = S.Store(buf, flat, self.visit(s.value))
        out.line = s.line
        return out

    def visit_DeclareBuffer(self, s: S.DeclareBuffer) -> S.Stmt:
        out = S.DeclareBuffer(self.flat_var(s.var))
        out.line = s.line
        return out


def flatten_buffers(func: Function) -> Function:
    """Flatten all tensor accesses; tensor parameters become pointers with the same names."""
    pass_ = FlattenBuffers()
    body = pass_.visit(func.body)
    params = [pass_.flat_var(p) for p in func.params]
    sizes = {d for p in func.params if isinstance(p.type, TensorType) and p.type.scope == GLOBAL
             for d in p.type.shape if isinstance(d, E.Var)}  # fmt: skip
    out = func.with_body(body)
    out.params = params
    out.size_params = func.size_params | sizes
    return out
