"""Shapes over tessera's size algebra (`tessera.ir.symbolic`): sizes as the int32 IR expressions
kernels index with (`to_expr`, `from_expr`), shape helpers, and the broadcasting rule every layer
uses (`broadcast_shapes`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tessera.errors import ShapeError
from tessera.ir import dtypes
from tessera.ir import expr as E
from tessera.ir.symbolic import (
    Atom,
    Dim,
    FloorDiv,
    MinMax,
    Name,
    Shape,
    Sym,
    check_dim,
    floordiv,
    minmax,
    mod,
    parse_dim,
)

# ---- kernel expressions ----------------------------------------------------------------------------------------------
I32 = dtypes.int32


def to_expr(d: Dim, symbols: dict[str, E.Expr]) -> E.Expr:
    """d as an int32 IR expression for kernel index arithmetic.  Names map to `symbols[name]`
    (an int32 Var or Const); a missing name gets a new int32 Var, recorded in `symbols`."""
    if isinstance(d, int):
        return E.Const(d, I32)
    out: E.Expr | None = None
    for mono, c in sorted(d.terms, key=lambda t: (t[0] == (), tuple((a.key, p) for a, p in t[0]))):
        factors = [_atom_expr(a, symbols) for a, p in mono for _ in range(p)]
        term: E.Expr | None = None
        for f in factors:
            term = f if term is None else term * f
        mag = abs(c)
        if term is None:
            term = E.Const(mag, I32)
        elif mag != 1:
            term = term * E.Const(mag, I32)
        if out is None:
            out = term if c > 0 else E.Unary("-", term)
        else:
            out = out + term if c > 0 else out - term
    assert out is not None
    return out


def _atom_expr(a: Atom, symbols: dict[str, E.Expr]) -> E.Expr:
    if isinstance(a, Name):
        if a.name not in symbols:
            symbols[a.name] = E.Var(a.name, I32)
        return symbols[a.name]
    if isinstance(a, FloorDiv):
        return E.Binary("//", to_expr(a.num, symbols), to_expr(a.den, symbols))
    assert isinstance(a, MinMax)
    out = to_expr(a.args[0], symbols)
    for x in a.args[1:]:
        out = E.Call(a.kind, (out, to_expr(x, symbols)), I32)
    return out


def from_expr(e: E.Expr) -> Dim:
    """An integer IR expression over constants, int32 Vars (by name), + - * // %, unary minus and
    min/max, as a canonical size; a TypeError for anything else (loads, floats, selects)."""
    if isinstance(e, E.Const) and isinstance(e.value, int) and not isinstance(e.value, bool):
        return e.value
    if isinstance(e, E.Var) and isinstance(e.type, dtypes.DataType) and e.type.is_integer:
        return Sym.var(e.name)
    if isinstance(e, E.Binary) and e.op in _BINARY:
        return _BINARY[e.op](from_expr(e.a), from_expr(e.b))
    if isinstance(e, E.Unary) and e.op == "-":
        return -from_expr(e.a)  # type: ignore[operator]
    if isinstance(e, E.Cast) and e.type.is_integer:
        return from_expr(e.value)
    if isinstance(e, E.Call) and e.func in ("min", "max"):
        return minmax(e.func, [from_expr(x) for x in e.args])
    raise TypeError(f"{e} is not a size expression (ints, int32 variables, + - * // %, min, max)")


_BINARY: dict[str, Callable[[Dim, Dim], Dim]] = {
    "+": lambda a, b: check_dim(a) + check_dim(b),
    "-": lambda a, b: check_dim(a) - check_dim(b),
    "*": lambda a, b: check_dim(a) * check_dim(b),
    "//": floordiv,
    "%": mod,
}


# ---- shapes and broadcasting -------------------------------------------------------------------------------------------
def as_dim(value: object) -> Dim:
    """A size given as int, Sym, numpy int or text ("batch", "2*batch*seq", "past + seq")."""
    if isinstance(value, Sym):
        return value
    if isinstance(value, str):
        return parse_dim(value)
    if not isinstance(value, bool) and hasattr(value, "__index__"):
        return int(value)  # type: ignore[arg-type]
    raise TypeError(f"a size must be an int or a symbolic size, not {value!r}")


def numel(shape: Sequence[Dim]) -> Dim:
    total: Dim = 1
    for d in shape:
        total = total * d
    return total


def is_static(shape: Sequence[Dim]) -> bool:
    return all(isinstance(d, int) for d in shape)


def format_shape(shape: Sequence[Dim]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


class BoundDim(int):
    """The run-time value of a symbolic size (`sym`), for checking a graph's shape assumptions on
    concrete shapes.  It compares as its int; broadcasting never stretches it, even when it is 1."""

    sym: Dim

    def __new__(cls, value: int, sym: Dim) -> BoundDim:
        obj = super().__new__(cls, value)
        obj.sym = sym
        return obj


def broadcast_shapes(*shapes: Sequence[Dim], assume: bool = True) -> Shape:
    """numpy broadcasting over sizes: right-aligned, and only a literal 1 stretches.

    Two sizes meeting on an axis must be equal.  When one of them is symbolic and the algebra
    cannot show it (`n` against 8, `n` against `m`), `assume=True` (the graph) *assumes* them
    equal: the result takes the constant, else a bare name, else the first, and the kernels index it
    as that size, so `tessera.graph.shape_check` enforces the assumption at run time.  A symbolic
    size that is 1 at run time therefore does not stretch; give the graph a literal 1 where an
    axis broadcasts.  `assume=False` (the ops library, which has no run-time check) refuses them.
    On concrete shapes holding `BoundDim`s, a broken assumption is refused here.  Failures are
    ShapeErrors."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[Dim] = []
    for i in range(rank):
        dims = [s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0]
        result: Dim | None = None
        for d in dims:
            if d == result or (d == 1 and not isinstance(d, BoundDim)):
                continue
            if result is None or (result == 1 and not isinstance(result, BoundDim)):
                result = d
            elif isinstance(d, BoundDim) or isinstance(result, BoundDim):
                raise ShapeError(_bound_mismatch(result, d, i))
            elif isinstance(result, int) and isinstance(d, int) or not assume:
                listed = ", ".join(format_shape(s) for s in shapes)
                hint = "" if isinstance(result, int) and isinstance(d, int) else (
                    "; symbolic sizes broadcast only against an equal size or 1")  # fmt: skip
                raise ShapeError(f"shapes {listed} cannot be broadcast together: dimension {i} is {result} in one and {d} "
                                 f"in another{hint}")  # fmt: skip
            elif isinstance(result, Sym) and (isinstance(d, int) or d.name is not None and result.name is None):
                result = d  # the constant, else the plainer size
        out.append(1 if result is None else result)
    return tuple(out)


def _bound_mismatch(a: int, b: int, axis: int) -> str:
    def name(d: int) -> str:
        return f"{d.sym}={int(d)}" if isinstance(d, BoundDim) else str(int(d))

    return (f"sizes {name(a)} and {name(b)} meet on broadcast axis {axis}, where the graph assumed them equal "
            f"(a symbolic size broadcasts only against an equal size or a literal 1, also when it is 1 at "
            f"run time); pass inputs with equal sizes there, or give the graph a literal 1 on the axis "
            f"that broadcasts")
