"""Graph shapes over tessera's size algebra (`tessera.ir.symbolic`), and binding them to inputs.

A graph dimension is an int or a `Sym`: any integer expression over named sizes (products of
reshapes, the `past + seq` of a concatenation, the `(h + 2*p - k) // s + 1` of a convolution,
`min` of a slice).  Only sizes that depend on data (the length of `nonzero`) are fresh opaque
names (`fresh_dim`, a leading "_"): nothing binds them from the inputs' shapes.

`bind_shapes` binds a graph's named sizes from its inputs' actual shapes (solving compound
dimensions such as `2*n` or `past + 1` for their one unknown) and checks every dimension.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

from tessera.errors import ShapeError
from tessera.ir.shapes import BoundDim, as_dim, broadcast_shapes, format_shape, is_static, numel
from tessera.ir.symbolic import Dim, Shape, Sym, evaluate_dim, floordiv, parse_dim, solve, sym_max, sym_min

__all__ = ["BoundDim", "Dim", "Shape", "ShapeError", "Sym", "as_dim", "as_shape", "bind_shape", "bind_shapes",
           "broadcast_shapes", "contains_sym", "dim_add", "dim_div", "dim_mul", "evaluate", "format_shape",
           "fresh_dim", "is_static", "numel", "parse_dim", "sym_max", "sym_min"]  # fmt: skip

_fresh = itertools.count()


def fresh_dim(hint: str = "d") -> Sym:
    """A new opaque size, for sizes that depend on data (nothing can bind it from input shapes)."""
    return Sym.var(f"_{hint}{next(_fresh)}")


def as_shape(values: Iterable[object]) -> Shape:
    return tuple(as_dim(v) for v in values)


def dim_mul(a: Dim, b: Dim) -> Dim:
    return a * b  # type: ignore[operator]


def dim_add(a: Dim, b: Dim) -> Dim:
    return a + b  # type: ignore[operator]


def dim_div(a: Dim, b: Dim) -> Dim:
    """a / b where the caller knows b divides a (a reshape's -1): exact, or a floor division the
    run-time check confirms; two constants that do not divide are a ShapeError."""
    if isinstance(a, int) and isinstance(b, int) and (b == 0 or a % b):
        raise ShapeError(f"{a} is not divisible by {b}")
    return floordiv(a, b)


def evaluate(value: object, bindings: Mapping[str, int]) -> object:
    """Replace every Sym inside value (a Sym, or nested lists/tuples of them) by its int."""
    if isinstance(value, Sym):
        return evaluate_dim(value, bindings)
    if isinstance(value, (list, tuple)):
        return type(value)(evaluate(v, bindings) for v in value)
    return value


def contains_sym(value: object) -> bool:
    if isinstance(value, Sym):
        return True
    if isinstance(value, (list, tuple)):
        return any(contains_sym(v) for v in value)
    return False


def bind_shape(bindings: dict[str, int], shape: Sequence[Dim], actual: Sequence[int], what: str) -> None:
    """bind_shapes for one shape."""
    bind_shapes(bindings, [(shape, actual, what)])


def bind_shapes(bindings: dict[str, int], items: Iterable[tuple[Sequence[Dim], Sequence[int], str]]) -> None:
    """Bind the named sizes of (shape, actual shape, what) items and check every dimension exactly.

    Bare names (`batch`) are bound by their first occurrence in any item.  Then each compound
    dimension with one unbound name binds it by solving `dim == actual` (`2*n` = 8 gives n = 4,
    `past + seq` = 9 with seq = 1 gives past = 8), repeatedly, and every dimension must equal its
    value.  A dimension whose unknowns no equation determines is an error: pass those sizes in
    `bindings`."""
    items = [(tuple(shape), tuple(int(a) for a in actual), what) for shape, actual, what in items]
    pending: list[tuple[Sym, int, int, str]] = []
    for shape, actual, what in items:
        if len(shape) != len(actual):
            raise ShapeError(f"{what}: expected rank {len(shape)} {format_shape(shape)}, got shape {actual}")
        for axis, (d, a) in enumerate(zip(shape, actual)):
            name = d.name if isinstance(d, Sym) else None
            if name is not None:
                if bindings.setdefault(name, a) != a:
                    raise ShapeError(f"{what}: size {name!r} is {bindings[name]} elsewhere but {a} here (shape {actual})")
            elif isinstance(d, Sym):
                pending.append((d, a, axis, what))
            elif d != a:
                raise ShapeError(f"{what}: expected shape {format_shape(shape)}, got {actual}")
    while pending:
        progress = False
        for item in list(pending):
            d, a, axis, what = item
            if all(n in bindings for n in d.names):
                pending.remove(item)
                _check(bindings, d, a, axis, what)
                progress = True
                continue
            try:
                solved = solve(d, a, bindings)
            except ShapeError as e:
                raise ShapeError(f"{what}: dimension {axis}: {e}") from None
            if solved is not None:
                bindings[solved[0]] = solved[1]
                progress = True
        if not progress:
            d, _, axis, what = pending[0]
            unbound = [n for n in d.names if n not in bindings]
            raise ShapeError(f"{what}: dimension {axis} is {d}, but the sizes {unbound} are bound by no input's shape; "
                             "pass their values")  # fmt: skip


def _check(bindings: Mapping[str, int], d: Sym, actual: int, axis: int, what: str) -> None:
    expected = evaluate_dim(d, bindings)
    if expected != actual:
        raise ShapeError(f"{what}: dimension {axis} is {d} = {expected} for these sizes, but the array has {actual}")
