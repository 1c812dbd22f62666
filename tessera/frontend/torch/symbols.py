"""torch sizes (ints, SymInts, sympy expressions) as tessera sizes.

Every symbolic size the torch front end meets goes through `dim_from_sym`, so the algebra
tessera uses for sizes can change in one place.  Today that algebra is `graph.symbolic.Sym`:
monomials over named sizes (`s0`, `4*s0*s1`); any other expression (a sum such as
`s0 + s1`, a floor division) becomes a fresh opaque size, which checks as "some size" but
cannot be evaluated from the inputs' shapes.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.errors import UnsupportedError
from tessera.graph.symbolic import Dim, Sym, fresh_dim


def dim_from_sym(value: Any) -> Dim:
    """A torch int, SymInt or sympy integer expression as a tessera size (int or Sym)."""
    if isinstance(value, bool):
        raise UnsupportedError(f"{value!r} is not a size")
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        hint = value.node.maybe_as_int()
        return hint if hint is not None else _sympy_dim(value.node.expr)
    if hasattr(value, "is_Integer"):  # a sympy expression
        return _sympy_dim(value)
    raise UnsupportedError(f"{value!r} is not a size")


def _sympy_dim(expr: Any) -> Dim:
    if expr.is_Integer:
        return int(expr)
    if expr.is_Symbol:
        return Sym.var(str(expr))
    if expr.is_Mul:
        out: Dim = 1
        for f in expr.args:
            d = _sympy_dim(f)
            if isinstance(d, Sym) and any(n.startswith("_") for n in d.names):
                return fresh_dim("e")  # one opaque size, bound from a shape, not a product of unbound ones
            out = d * out if isinstance(d, Sym) else out * d
        return out
    if expr.is_Pow and expr.exp.is_Integer and int(expr.exp) > 0:
        base = _sympy_dim(expr.base)
        if isinstance(base, Sym) and any(n.startswith("_") for n in base.names):
            return fresh_dim("e")
        out = 1
        for _ in range(int(expr.exp)):
            out = base * out if isinstance(base, Sym) else out * base
        return out
    return fresh_dim("e")
