"""torch's symbolic sizes (SymInts, sympy expressions of its ShapeEnv) as tessera sizes.

dynamo names dynamic sizes `s0`, `s1`... and computes with them in sympy (through
`torch.utils._sympy.functions`: FloorDiv, CleanDiv, Mod, Min, Max...).  `dim_from_sym` maps
every such integer expression onto tessera's size algebra (`tessera.ir.symbolic`), which keeps
it evaluable from the input shapes.  dynamo's guards decide when a graph is recompiled; tessera
only needs the expressions.
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
from torch.utils._sympy import functions as F

from tessera.errors import UnsupportedError
from tessera.ir.symbolic import Dim, Sym, floordiv, mod, sym_max, sym_min


def dim_from_sym(value: Any) -> Dim:
    """An int, a torch.SymInt or an integer sympy expression as a tessera size.

    Supported: integers, symbols, + and *, powers by natural numbers, floor/ceil/exact
    division, modulo (C and Python), ModularIndexing, min and max.  Anything else (a float,
    a data-dependent size without a symbol) raises UnsupportedError naming the expression."""
    if isinstance(value, bool):
        raise UnsupportedError(f"{value!r} is not a size")
    if isinstance(value, int):
        return value
    if isinstance(value, torch.SymInt):
        hint = value.node.maybe_as_int()
        return hint if hint is not None else _convert(value.node.expr)
    if isinstance(value, sympy.Basic):
        return _convert(value)
    raise UnsupportedError(f"{value!r} ({type(value).__name__}) is not a size")


def _convert(e: Any) -> Dim:
    if e.is_Integer:
        return int(e)
    if e.is_Symbol:
        return Sym.var(str(e))
    args = [_convert(a) for a in e.args] if not e.is_Mul else None
    if e.is_Add:
        total: Dim = 0
        for a in args:  # type: ignore[union-attr]
            total = total + a
        return total
    if e.is_Mul:
        return _product(e)
    if e.is_Pow or isinstance(e, F.PowByNatural):
        base, exp = e.args
        if not (exp.is_Integer and int(exp) >= 0):
            raise UnsupportedError(f"symbolic size {e}: only powers by natural numbers are sizes")
        out: Dim = 1
        for _ in range(int(exp)):
            out = out * _convert(base)
        return out
    if isinstance(e, (F.FloorDiv, F.CleanDiv)):
        return floordiv(args[0], args[1])  # type: ignore[index]
    if isinstance(e, F.CeilDiv):
        return -floordiv(-args[0], args[1])  # type: ignore[index,operator]
    if isinstance(e, (F.Mod, F.PythonMod)):  # sizes are non-negative, where C and Python agree
        return mod(args[0], args[1])  # type: ignore[index]
    if isinstance(e, F.ModularIndexing):
        base, div, modulus = args  # type: ignore[misc]
        return mod(floordiv(base, div), modulus)
    if isinstance(e, (sympy.Min, F.Min)):
        return sym_min(*args)  # type: ignore[misc]
    if isinstance(e, (sympy.Max, F.Max)):
        return sym_max(*args)  # type: ignore[misc]
    if isinstance(e, F.Identity):
        return args[0]  # type: ignore[index]
    raise UnsupportedError(f"symbolic size {e} ({type(e).__name__}) has no tessera form "
                           "(sums, products, floor division, modulo, min and max do)")  # fmt: skip


def _product(e: Any) -> Dim:
    """A sympy product; a rational coefficient (sympy writes `s0/2` for an exact half) divides
    the integer part, exactly where torch proved it divides."""
    out: Dim = 1
    denominator = 1
    for f in e.args:
        if f.is_Rational and not f.is_Integer:
            out = out * int(f.p)
            denominator *= int(f.q)
        else:
            out = out * _convert(f)
    return out if denominator == 1 else floordiv(out, denominator)
